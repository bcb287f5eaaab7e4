"""Shared set-up for the storage-node tests: a media data root, node subprocesses, reference decodes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from process_diagnostics import kernel_state, kill_and_reap, stop

from foresight.media import FrameSampling, TransformSpec
from foresight.testing.tether import start_tethered

PY = sys.executable
SPECS = {
    "image": TransformSpec(modality="image", size=(32, 32), crop="random_resized", flip=0.5),
    "video": TransformSpec(modality="video", size=(32, 32), frames=FrameSampling(num_frames=3, window_s=0.8)),
}
TOKEN = "token-of-job-a"
#: Specs whose step parts are about 100 MB: more than gRPC buffers for a reader that stops reading.
BIG_SPECS = {
    "image": TransformSpec(modality="image", size=(2048, 2048)),
    "video": TransformSpec(modality="video", size=(2048, 2048), frames=FrameSampling(num_frames=3, window_s=0.8)),
}


def make_root(root: str, *, samples: int = 12, steps: int = 6, batch: int = 4, shard_bytes: int = 20000) -> dict:
    """A data root with one media dataset (several shards) and a plan under ``plans/p1``."""
    from test_loader_media import _clip, _jpeg

    from foresight.format import DatasetWriter, open_dataset
    from foresight.media import probe_media
    from foresight.plan import build_plan

    os.makedirs(root, exist_ok=True)
    with DatasetWriter(os.path.join(root, "media"), shard_bytes=shard_bytes) as w:
        for i in range(samples):
            data, kind = (_jpeg(i), "image") if i % 2 else (_clip(i), "video")
            w.add(data, modality=kind, meta=probe_media(data, kind))
    ds = open_dataset(os.path.join(root, "media"))
    plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=batch, num_steps=steps)  # steps straddle epochs
    plan.save(os.path.join(root, "plans", "p1"))
    return {"root": root, "dataset": ds, "plan": plan}


def job_request(root: dict, job: str = "good", transforms: dict | None = None, **over) -> dict:
    """A ``register_job`` body for the plan of :func:`make_root` decoding with ``transforms`` (default
    :data:`SPECS`); ``over`` replaces fields as they are. For raw Flight calls."""
    from foresight.node.jobs import spec_digest

    specs = SPECS if transforms is None else transforms
    req = {"job": job, "datasets": ["media"], "plan": "plans/p1", "plan_digest": root["plan"].digest, "rank": 0,
           "world_size": 1, "specs": {k: v.to_dict() for k, v in specs.items()}, "seed": 9, "step": 0,
           "spec_digest": spec_digest(specs)}
    req.update(over)
    return req


def flight_action(client, name: str, body, job: str | None = None, token: str | None = None) -> dict:
    """One ``DoAction`` on a raw Flight client; its JSON answer."""
    import pyarrow.flight as flight

    from foresight.cluster.auth import call_options

    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    res = list(client.do_action(flight.Action(name, body), call_options(job, token, timeout=60)))
    return json.loads(res[0].body.to_pybytes())


class NodeProc:
    """``python -m foresight node serve`` as a subprocess; ready when its ready file appears."""

    def __init__(self, root: str, workdir: str, *args: str, name: str = "n", timeout: float = 120.0) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.ready_file = os.path.join(workdir, f"{name}.ready.json")
        self.log_path = os.path.join(workdir, f"{name}.log")
        if os.path.exists(self.ready_file):
            os.unlink(self.ready_file)
        self._log = open(self.log_path, "ab")
        path = os.pathsep.join([os.path.abspath("python"), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path, PYTHONFAULTHANDLER="1")  # SIGABRT prints every thread's stack
        self.proc = start_tethered([PY, "-m", "foresight", "node", "serve", "--root", root, "--ready-file",
                                    self.ready_file, "--decode-threads", "2", *args],
                                   stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited at start ({self.proc.returncode}): {self.log()[-2000:]}")
            if time.monotonic() > deadline:  # where it waits, taken before the kill: the question a hang asks
                state = "\n".join(kernel_state(self.proc.pid))
                self.proc.send_signal(signal.SIGABRT)  # its Python threads' stacks go to the log (faulthandler)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass  # stuck in the kernel: the state above says where; SIGKILL next
                self.kill()
                raise RuntimeError(f"node not ready in {timeout}s; where it was:\n{state}\nits log (with the "
                                   f"threads' stacks at SIGABRT): {self.log()[-6000:]}")
            time.sleep(0.1)
        with open(self.ready_file) as f:
            self.info = json.load(f)
        self.location = self.info["location"]
        self.node_id = self.info["node"]

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and the exit code; a node still running ``timeout`` s later is killed and reported, never left
        behind."""
        try:
            return stop(self.proc, f"node {self.node_id_or_name}", grace=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL; a node not reaped within 60 s is stuck in the kernel: the error says where."""
        try:
            kill_and_reap(self.proc, f"node {self.node_id_or_name}")
        finally:
            self._log.close()

    @property
    def node_id_or_name(self) -> str:
        return getattr(self, "node_id", None) or os.path.basename(self.log_path).removesuffix(".log")


def host_reference(ds, plan, *, seed: int = 9, rank: int = 0, world_size: int = 1) -> list[dict]:
    """Per step: {modality: (positions, output_hash per sample)} decoded on the host with the plain stage."""
    from foresight.loader import Loader, MediaDecodeStage

    stage = MediaDecodeStage([ds], SPECS, seed=seed, threads=2)
    try:
        with Loader(ds, plan, decode=stage, rank=rank, world_size=world_size) as loader:
            return [summary(b) for b in loader]
    finally:
        stage.close()


def summary(batch) -> dict:
    from foresight.media import output_hash

    out = {"step": batch.step, "sample_ids": np.asarray(batch["sample_ids"]).tolist()}
    for name in SPECS:
        if name in batch:
            out[name] = (np.asarray(batch[f"{name}_index"]).tolist(), [output_hash(t) for t in batch[name]],
                         output_hash(batch[name]))
    return out


def run_source(ds, plan, source, *, rank: int = 0, world_size: int = 1, on_step=None, before_decode=None) -> list[dict]:
    """Batch summaries of a loader decoding through ``source``; ``before_decode(step)`` runs on the loader thread
    right before the source sees the step (so a fault lands on a known step whatever the loader prefetched)."""
    from foresight.loader import Loader

    decode = source
    if before_decode is not None:
        def decode(fields, **kw):
            before_decode(int(fields["step"]))
            return source(fields, **kw)

    out = []
    with Loader(ds, plan, decode=decode, rank=rank, world_size=world_size) as loader:
        for batch in loader:
            out.append(summary(batch))
            if on_step is not None:
                on_step(batch.step)
    return out


def wait_for(predicate, *, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
