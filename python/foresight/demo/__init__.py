"""``foresight demo``: the whole engine end to end on an embedded default, printing what it measured.

1. generates a small multimodal corpus (token documents, JPEG/PNG images, H.264 clips, WAV audio) and packs it;
2. builds deterministic plans (token sequences packed like Megatron-LM; media samples) and prints step 0;
3. trains a toy language model through the loader, saves an async checkpoint (model, optimizer and the loader's
   plan position in one commit) and keeps training;
4. "crashes", restores the checkpoint into a fresh model and loader, and checks that the resumed run's losses
   equal the uninterrupted run's, bit for bit;
5. decodes the media plan frame-selectively on the host, then serves the same plan through a storage node
   (``foresight node serve`` as a separate process, decoding next to the data) and checks both give the same
   tensors (``output_hash``);
6. uploads the token dataset and its plan to a loopback S3 bucket (SeaweedFS) and trains from
   ``Loader("s3://...")`` through a cache a quarter of the dataset's size, evicting by the plan's future; checks the
   batches equal step 3's (:mod:`.bucket`);
7. saves step 3's checkpoint with ``Replication`` to an evaluation site on loopback (units sent while the file is
   written, published after the commit, merged there to safetensors) and checks the replica loads equal
   (:mod:`.replication`);
8. prints a table of what it measured.

The servers of sections 6 and 7 start on threads once the timed training is over (:mod:`.background`), so their
start-up overlaps section 5; one that cannot start (no ``weed`` binary, say) skips its section with one line, and
every server is stopped at the end whatever happens.

Example::

    python -m foresight demo --out demo-out --steps 24
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import time
from typing import Any

import numpy as np

from foresight.cli import main as cli_main
from foresight.testing.tether import start_tethered

VOCAB = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="demo-out", help="working directory (recreated)")
    parser.add_argument("--steps", type=int, default=24, help="training steps (checkpoint at the middle)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data, the plan and the model")


#: What the demo imports, checked before it starts (a missing one is named with its extra, see foresight.cli): the
#: storage node it starts needs the node extra, which a failed start would only report as "see node.log"; the
#: bucket section needs the bucket extra, the evaluation site's merge the checkpoint extra.
NEEDS = ("torch", "av", "PIL", "prometheus_client", "obstore", "safetensors")


def run(args: argparse.Namespace) -> int:
    for module in NEEDS:
        importlib.import_module(module)
    import torch

    torch.manual_seed(args.seed)
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with contextlib.ExitStack() as servers:  # whatever happens: a start under way is waited for, then stopped
        return _run(args, out, servers)


def _run(args: argparse.Namespace, out: str, servers: contextlib.ExitStack) -> int:
    from foresight.demo.background import Starting  # lazy: demo --help stays fast
    from foresight.demo.bucket import start_seaweed  # lazy: demo --help stays fast
    from foresight.demo.replication import start_sites, stop_sites  # lazy: demo --help stays fast

    t_start = time.perf_counter()
    measured: dict[str, Any] = {}

    _section("1. generate and pack a small multimodal corpus")
    token_ds, media_ds = _pack_corpus(out, args.seed, measured)

    _section("2. plans")
    from foresight.plan import build_plan  # lazy: demo --help stays fast

    t0 = time.perf_counter()
    plan_args = dict(seed=args.seed, global_batch_size=8, seq_len=64, num_steps=args.steps, shuffle="block",
                     block_size=16)
    token_plan = build_plan([(token_ds, 1.0)], **plan_args)
    token_plan.save(os.path.join(out, "plan-tokens"))
    media_plan = build_plan([(media_ds, 1.0)], seed=args.seed, global_batch_size=4, num_steps=3)
    media_plan.save(os.path.join(out, "plan-media"))  # under the node's data root, so the node finds it
    measured["plan build (s)"] = round(time.perf_counter() - t0, 4)
    print(f"token plan: {token_plan}\ndigest {token_plan.digest[:16]}...")
    step0 = token_plan.step_dict(0)
    print("step 0 (first 2 sequences):", json.dumps(_head(step0, 2))[:600])

    _section("3. train a toy model through the loader, checkpoint asynchronously")
    losses, ckpt_info, loader_stats, batch_hashes = _train(out, token_ds, token_plan, args.steps, args.seed)
    measured.update(ckpt_info)
    measured["loader"] = loader_stats

    _section("4. crash, restore model + optimizer + loader position, resume")
    resumed = _resume(out, token_ds, token_plan, args.steps, args.seed)
    half = args.steps // 2
    exact = resumed == losses[half:]
    print(f"resumed losses for steps {half}..{args.steps - 1} equal the uninterrupted run: {exact}")
    measured["resume bit-exact"] = exact
    # the servers of sections 6 and 7 start now, on threads: after the timed training, overlapping section 5
    s3 = Starting("SeaweedFS", lambda: start_seaweed(out), lambda server: server.stop())
    servers.callback(s3.stop)
    sites = Starting("replication sites", lambda: start_sites(out), stop_sites)
    servers.callback(sites.stop)

    _section("5. media decoded frame-selectively, on the host and through a storage node")
    measured.update(_media_batch(media_ds, media_plan, args.seed, out))
    served_same = measured.get("node tensors equal host's") is True

    _section("6. train from an S3 bucket (loopback SeaweedFS) through a cache a quarter of the dataset's size")
    from foresight.demo.bucket import train_from_bucket  # lazy: demo --help stays fast

    server = s3.get()
    if server is None:
        print(f"  skipped: {s3.what} did not start ({s3.reason})")
        measured["bucket"] = {"skipped": s3.reason}
    else:
        measured["bucket"] = train_from_bucket(server, out, token_ds, plan_args, batch_hashes)
    bucket_ok = measured["bucket"].get("batches equal the local run's", True) is True

    _section(f"7. replicate the step-{half} checkpoint to an evaluation site while it is saved")
    from foresight.demo.replication import replicate_checkpoint  # lazy: demo --help stays fast

    pair = sites.get()
    if pair is None:
        print(f"  skipped: {sites.what} did not start ({sites.reason})")
        measured["replication"] = {"skipped": sites.reason}
    else:
        measured["replication"] = replicate_checkpoint(pair, os.path.join(out, "ckpt-local"), half)
    replication_ok = all(measured["replication"].get(k, True) is True
                         for k in ("replica loads equal", "merged model equals"))

    _section("8. measured")
    measured["demo (s)"] = round(time.perf_counter() - t_start, 1)
    for key, value in measured.items():
        if isinstance(value, dict):
            print(f"  {key}:")
            for k, v in value.items():
                print(f"      {k:<30} {v}")
        else:
            print(f"  {key:<34} {value}")
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump(measured, f, indent=2, default=str)
    return 0 if exact and served_same and bucket_ok and replication_ok else 1


# -- stages ---------------------------------------------------------------------------------------------------


def _pack_corpus(out: str, seed: int, measured: dict):
    from foresight.format import open_dataset, pack_jsonl, pack_media  # lazy: demo --help stays fast

    rng = np.random.default_rng(seed)
    src = os.path.join(out, "src")
    os.makedirs(os.path.join(src, "media"))
    # Token documents with learnable structure: each document counts upward from a random start.
    with open(os.path.join(src, "docs.jsonl"), "w") as f:
        for _ in range(400):
            start, n = int(rng.integers(0, VOCAB)), int(rng.integers(8, 120))
            f.write(json.dumps({"tokens": [(start + i) % VOCAB for i in range(n)]}) + "\n")
    _write_media(os.path.join(src, "media"), rng)
    t0 = time.perf_counter()
    pack_jsonl(os.path.join(src, "docs.jsonl"), os.path.join(out, "tokens"), column="tokens", progress=False)
    pack_media(os.path.join(src, "media"), os.path.join(out, "media"), progress=False)
    measured["pack (s)"] = round(time.perf_counter() - t0, 3)
    token_ds, media_ds = open_dataset(os.path.join(out, "tokens")), open_dataset(os.path.join(out, "media"))
    print(f"{token_ds}\n{media_ds}")
    return token_ds, media_ds


def _write_media(folder: str, rng: np.random.Generator) -> None:
    import av
    from PIL import Image

    for i, ext in enumerate(["jpg", "png", "webp", "jpg"]):
        arr = (np.linspace(0, 255, 96 * 128 * 3).reshape(96, 128, 3) + rng.integers(0, 40)).astype(np.uint8)
        Image.fromarray(arr).save(os.path.join(folder, f"image{i}.{ext}"))
    for i in range(3):
        with av.open(os.path.join(folder, f"clip{i}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=25)
            stream.width, stream.height, stream.pix_fmt = 160, 96, "yuv420p"
            stream.options = {"g": "25"}
            for t in range(75):
                img = np.zeros((96, 160, 3), np.uint8)
                img[:, (t * 2 + i * 10) % 160] = 255
                img[..., 1] = t * 3
                for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    import wave

    for i in range(2):
        t = np.arange(16000) / 16000.0
        pcm = (np.sin(2 * np.pi * (220 + 110 * i) * t) * 12000).astype(np.int16)
        with wave.open(os.path.join(folder, f"tone{i}.wav"), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
            w.writeframes(pcm.tobytes())


class _ToyLM:
    """Embedding -> MLP -> vocabulary: enough to see the loss fall on counting sequences."""

    def __init__(self, seed: int):
        import torch

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, VOCAB)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def step(self, batch) -> float:
        import torch

        logits = self.model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.item())

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def _train(out: str, ds, plan, steps: int, seed: int):
    from foresight.checkpoint import Checkpointer  # lazy: demo --help stays fast
    from foresight.demo.bucket import step_hash  # lazy: demo --help stays fast
    from foresight.loader import Loader  # lazy: demo --help stays fast

    lm = _ToyLM(seed)
    ckpt = Checkpointer([os.path.join(out, "ckpt-local"), os.path.join(out, "ckpt-durable")], keep=[2, 3])
    losses, info, hashes = [], {}, []
    with Loader(plan, datasets=ds, prefetch=2) as loader:
        for batch in loader:
            hashes.append(step_hash(batch))  # what the bucket section's batches must equal
            losses.append(lm.step(batch))
            if batch.step == steps // 2 - 1:  # checkpoint after this step: model + optimizer + loader position
                t0 = time.perf_counter()
                handle = ckpt.save(lm.state(), batch.step + 1, extra_state={"loader": loader.state_dict()})
                info["checkpoint blocking (ms)"] = round((time.perf_counter() - t0) * 1e3, 2)
        t0 = time.perf_counter()
        handle.wait()
        ckpt.wait()
        info["checkpoint drain wait (ms)"] = round((time.perf_counter() - t0) * 1e3, 2)
        stats = loader.stats.as_dict()
    ckpt.close()
    print("losses:", " ".join(f"{x:.3f}" for x in losses))
    keep = ("backend", "steps", "ios", "extents", "bytes_requested", "bytes_read", "amplification",
            "io_wait_s", "collate_s", "stall_s")
    return (losses, info, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items() if k in keep},
            hashes)


def _resume(out: str, ds, plan, steps: int, seed: int) -> list[float]:
    from foresight.checkpoint import Checkpointer  # lazy: demo --help stays fast
    from foresight.loader import Loader  # lazy: demo --help stays fast

    lm = _ToyLM(seed + 100)  # a fresh process would start from different weights: the checkpoint must win
    ckpt = Checkpointer([os.path.join(out, "ckpt-local"), os.path.join(out, "ckpt-durable")], keep=[2, 3])
    restored = ckpt.load("latest", into=lm.state())
    lm.model.load_state_dict(restored.state_dict["model"])
    lm.opt.load_state_dict(restored.state_dict["optim"])
    losses = []
    with Loader(plan, datasets=ds, prefetch=2) as loader:
        loader.load_state_dict(restored.extra_state["loader"])
        print(f"restored step {restored.step} from {restored.path} (tier {restored.tier}); "
              f"loader resumes at step {loader.state_dict()['next_step']}")
        for batch in loader:
            losses.append(lm.step(batch))
    ckpt.close()
    return losses


def _media_stage(ds, seed: int):
    from foresight.loader import MediaDecodeStage  # lazy: demo --help stays fast
    from foresight.media import FrameSampling, TransformSpec  # lazy: demo --help stays fast

    return MediaDecodeStage([ds], {
        "image": TransformSpec(modality="image", size=(64, 64), crop="random_resized", dtype="uint8"),
        "video": TransformSpec(modality="video", size=(64, 64), frames=FrameSampling(num_frames=4, window_s=1.0)),
        "audio": TransformSpec(modality="audio"),
    }, seed=seed, threads=2)


def _decode_pass(ds, plan, source) -> tuple[list[str], dict, dict]:
    """One pass over the media plan: each batch's output hashes, shapes per modality, decode time by modality."""
    from foresight.loader import Loader  # lazy: demo --help stays fast
    from foresight.media import output_hash  # lazy: demo --help stays fast

    hashes, shapes = [], {}
    with Loader(plan, datasets=ds, decode=source) as loader:
        for batch in loader:
            for name in ("image", "video", "audio"):
                if name in batch:
                    value = batch[name]
                    hashes.append(f"{batch.step}:{name}:{output_hash(value)}")
                    shapes.setdefault(name, []).append(
                        tuple(value.shape) if hasattr(value, "shape") else [tuple(t.shape) for t in value])
        decode = {k: round(v, 4) for k, v in loader.stats.decode_by_modality_s.items()}
    return hashes, shapes, decode


def _media_batch(ds, plan, seed: int, out: str) -> dict:
    stage = _media_stage(ds, seed)
    try:
        host_hashes, shapes, decode = _decode_pass(ds, plan, stage)
    finally:
        stage.close()
    for name, seen in shapes.items():
        print(f"  {name}: {seen}")
    measured: dict[str, Any] = {"media decode (s) by modality": decode}
    node_hashes, node_stats = _through_a_node(ds, plan, seed, out)
    same = node_hashes == host_hashes
    print(f"  through a storage node: {node_stats}; same tensors as the host's decode: {same}")
    measured["node tensors equal host's"] = same
    measured["node"] = {k: v for k, v in node_stats.items() if k.startswith(("samples_", "parts_", "steps"))}
    return measured


def _through_a_node(ds, plan, seed: int, out: str) -> tuple[list[str], dict]:
    """Start `foresight node serve` on the demo's directory (a single node, no etcd), decode the plan through it."""
    import subprocess
    import sys

    from foresight.node import NodeSource  # lazy: demo --help stays fast

    ready = os.path.join(out, "node.ready.json")
    log = open(os.path.join(out, "node.log"), "w")
    proc = start_tethered([sys.executable, "-m", "foresight", "node", "serve", "--root", out, "--ready-file", ready,
                           "--decode-threads", "2", "--cpu-threshold", "101"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the storage node did not start (see {log.name})")
            time.sleep(0.05)
        with open(ready) as f:
            location = json.load(f)["location"]
        print(f"  storage node serving {out} at {location} (log: {log.name})")
        stage = _media_stage(ds, seed)
        source = NodeSource(stage, plan, nodes=[location], token="foresight-demo-token", job="demo")
        try:
            hashes, _, _ = _decode_pass(ds, plan, source)
            return hashes, dict(source.stats)
        finally:
            source.close()
            stage.close()
    finally:
        proc.terminate()  # SIGTERM: the node drains its streams and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _section(title: str) -> None:
    print(f"\n== {title}")


def _head(step: dict, n: int) -> dict:
    out = dict(step)
    for key, value in out.items():
        if isinstance(value, list):
            out[key] = value[:n]
    return out


def main() -> int:
    import sys

    return cli_main(["demo", *sys.argv[1:]])  # its error handling: one line for a missing module

