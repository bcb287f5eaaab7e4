"""Real processes for replication tests: an etcd server and replication sites, on loopback."""
from __future__ import annotations

import os
import time

from foresight.testing.etcd import EtcdProcess
from foresight.testing.sites import SiteProcess
from installed import require


class Etcd(EtcdProcess):
    def __init__(self, data_dir: str, **kw) -> None:
        require("etcd")  # a failed set-up fails the test, never skips it
        super().__init__(data_dir, **kw)


class Site(SiteProcess):
    def __init__(self, site: str, root: str, **kw) -> None:
        kw.setdefault("unit_bytes", 64 << 10)
        kw.setdefault("streams", 1)
        super().__init__(site, root, **kw)


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


def assert_same_merged(got: dict, want: dict) -> int:
    """Two merged outputs (``{group: [paths]}``) hold the same files by name, each with the same tensors (dtype,
    shape, bytes) and the same header metadata; returns the tensors compared. safetensors writes its metadata in
    a hash order that changes from process to process, so files are compared loaded, not byte for byte."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    assert sorted(got) == sorted(want)
    n = 0
    for g in want:
        assert [os.path.basename(p) for p in got[g]] == [os.path.basename(p) for p in want[g]], g
        for a, b in zip(got[g], want[g]):
            ta, tb = load_file(a), load_file(b)
            assert sorted(ta) == sorted(tb), a
            for k in tb:
                assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, (a, k)
                assert torch.equal(ta[k].view(torch.uint8) if ta[k].dim() else ta[k],
                                   tb[k].view(torch.uint8) if tb[k].dim() else tb[k]), (a, k)
                n += 1
            with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
                assert fa.metadata() == fb.metadata(), a
    return n
