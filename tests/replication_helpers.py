"""Real processes for replication tests: an etcd server and replication sites, on loopback."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    def __init__(self, data_dir: str) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.skip("etcd is not installed (scripts/setup.sh installs etcd-server)")
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.path.dirname(data_dir), "etcd.log"), "w")
        self.proc = subprocess.Popen(
            [exe, "--data-dir", data_dir, "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


class Site:
    """``python -m foresight.checkpoint.replicate.service`` as a real process."""

    def __init__(self, site: str, root: str, *, etcd: str | None = None, routes: dict[str, str] | None = None,
                 unit_bytes: int = 64 << 10, streams: int = 1, replica_ttl: int = 3600, port: int = 0) -> None:
        self.site, self.root = site, root
        args = [sys.executable, "-m", "foresight.checkpoint.replicate.service", "--site", site, "--root", root,
                "--unit-bytes", str(unit_bytes), "--streams", str(streams), "--replica-ttl", str(replica_ttl),
                "--port", str(port)]
        if etcd:
            args += ["--etcd", etcd]
        for s, url in (routes or {}).items():
            args += ["--route", f"{s}={url}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"site {site} did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"grpc://127.0.0.1:{self.port}"

    def call(self, action: str, body: dict | None = None) -> dict:
        from foresight.checkpoint.replicate.service import call

        return call(self.url, action, body)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def wait_until(pred, what: str, timeout: float = 60.0):
    """Poll ``pred`` until truthy (a bound for a hung test, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def write_checkpoint_phases(root: str, step: int, nbytes: int, seed: int = 0):
    """The checkpoint writer's phases on real files: data file in a temp dir (yielded), then index + COMMIT and
    the atomic rename (yielded again). Returns a generator: ``tmp = next(g); final = next(g)``."""
    import numpy as np

    from foresight.checkpoint import store
    from foresight.checksum import xxh3_many

    rng = np.random.default_rng(seed)
    data = rng.integers(0, 255, nbytes, dtype=np.uint8)
    cuts = np.unique(np.concatenate(([0], np.sort(rng.integers(1, nbytes, 40)), [nbytes])))
    offs, lens = cuts[:-1].astype(np.int64), np.diff(cuts).astype(np.int64)
    os.makedirs(root, exist_ok=True)
    tmp = store.new_tmp_dir(root, step)
    with open(os.path.join(tmp, "data-00000.bin"), "wb") as f:
        f.write(data.tobytes())
        os.fsync(f.fileno())
    yield tmp
    sums = xxh3_many(data, offs, lens)
    index = {"format": store.FORMAT, "version": store.VERSION, "step": step,
             "files": [{"name": "data-00000.bin", "bytes": nbytes}],
             "tensors": {"name": [f"t{i}" for i in range(len(offs))], "file": [0] * len(offs),
                         "offset": offs.tolist(), "nbytes": lens.tolist(), "dtype": ["torch.uint8"] * len(offs),
                         "shape": [[int(n)] for n in lens], "xxh3": [f"{int(h):016x}" for h in sums]},
             "skeleton": None, "extra_state": None}
    store.write_index_and_commit(tmp, index)
    yield store.publish(tmp, root, step)
