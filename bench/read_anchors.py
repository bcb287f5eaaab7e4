"""The read path's anchors, each configured as its own experts would run it, with the sweep that picked it.

* **torch DataLoader**: a map-style dataset that preads samples, swept over ``num_workers`` (2, 4, 8, 16), per-sample
  ``__getitem__`` against a batched ``__getitems__`` (one call per batch, samples pread into one preallocated
  ``(B, size)`` array, no collate copy), ``prefetch_factor`` (2, 8) and, where CUDA exists, ``pin_memory``; cold rows
  also try O_DIRECT (``os.preadv`` into page-aligned buffers). The best configuration is the anchor.
* **np.memmap**: per-sample indexing as Megatron-LM's dataset does; cold runs advise ``MADV_RANDOM`` so the disk's
  readahead does not read megabytes per 16 KiB sample.
* **fio**: io_uring random reads swept over ``numjobs`` x ``iodepth`` x submission mode (plain; batched
  submit/complete; SQPOLL; ``hipri`` polling where the device has poll queues), always with ``fixedbufs`` and
  ``registerfiles``: the best is the disk's limit that foresight is compared with.

Each runner takes ``(case, cold, order, **config)``, where ``order`` is the plan order (global or block-local), and
returns the figures of ``read_path.result``. Example::

    from read_anchors import dataloader_configs, run_dataloader
    for cfg in dataloader_configs(cold=True):
        print(cfg, run_dataloader(case, True, case.order("global"), **cfg)["mb_per_s"])
"""
from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess

import numpy as np

WORKERS = (2, 4, 8, 16)
PREFETCH_FACTORS = (2, 8)


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), as O_DIRECT needs."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


class _Pread:
    """Shared part of the anchor datasets: the fd is opened per worker process (after fork)."""

    def __init__(self, path: str, offsets: np.ndarray, size: int, direct: bool) -> None:
        self.path, self.offsets, self.size, self.direct = path, offsets, size, direct
        self._fd, self._pid = -1, -1

    def __len__(self) -> int:
        return len(self.offsets)

    def _file(self) -> int:
        if self._pid != os.getpid():
            flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
            self._fd, self._pid = os.open(self.path, flags), os.getpid()
        return self._fd

    def _read_into(self, fd: int, buf: np.ndarray, i: int) -> None:
        if os.preadv(fd, [buf], int(self.offsets[i])) != self.size:
            raise OSError(f"short read of sample {i} at offset {int(self.offsets[i])} of {self.path}")


class PreadSamples(_Pread):
    """Per-sample ``__getitem__``: one pread into a fresh buffer; the default collate stacks the batch."""

    def __getitem__(self, i: int) -> np.ndarray:
        buf = _aligned(self.size) if self.direct else np.empty(self.size, dtype=np.uint8)
        self._read_into(self._file(), buf, i)
        return buf


class PreadBatches(_Pread):
    """Batched ``__getitems__``: the whole batch pread into one preallocated array, returned as one tensor."""

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, ids: list[int]):
        import torch

        fd = self._file()
        n = len(ids)
        out = (_aligned(n * self.size) if self.direct else np.empty(n * self.size, dtype=np.uint8)).reshape(n, -1)
        for j, i in enumerate(ids):
            self._read_into(fd, out[j], i)
        return torch.from_numpy(out)


def _identity(batch):
    return batch


def dataloader_configs(cold: bool, *, smoke: bool = False) -> list[dict]:
    """The sweep: workers x {per-sample, batched} x prefetch factor (x pin_memory with CUDA) (x O_DIRECT cold)."""
    import torch

    workers = (2, 4) if smoke else WORKERS
    prefetch = (2,) if smoke else PREFETCH_FACTORS
    pins = (False, True) if torch.cuda.is_available() else (False,)
    directs = (False, True) if cold else (False,)
    return [{"workers": w, "batched": b, "prefetch_factor": p, "pin_memory": pin, "direct": d}
            for w in workers for b in (False, True) for p in prefetch for pin in pins for d in directs]


def config_label(cfg: dict) -> str:
    return (f"w{cfg['workers']} {'getitems' if cfg['batched'] else 'getitem'} pf{cfg['prefetch_factor']}"
            + (" pin" if cfg.get("pin_memory") else "") + (" O_DIRECT" if cfg.get("direct") else ""))


def run_dataloader(case, cold: bool, order: np.ndarray, *, workers: int, batched: bool, prefetch_factor: int,
                   pin_memory: bool = False, direct: bool = False) -> dict:
    import torch.utils.data as tud
    from read_path import Meter, result

    offsets = np.asarray(case.ds.lookup(np.arange(case.ds.num_samples)).offset, dtype=np.int64)
    cls = PreadBatches if batched else PreadSamples
    dl = tud.DataLoader(cls(case.path, offsets, case.size, direct), batch_size=case.batch, sampler=order.tolist(),
                        num_workers=workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory,
                        collate_fn=_identity if batched else None, shuffle=False, persistent_workers=False)
    meter = Meter()
    it = iter(dl)
    try:
        first = next(it)  # workers forked and the pipeline full: start-up is not timed (favours the anchor)
        assert tuple(first.shape) == (case.batch, case.size)
        meter.start()
        samples = 0
        for batch in it:
            samples += batch.shape[0]
        wall, cpu = meter.stop()
    finally:
        del it
        gc.collect()
    return result(samples, samples * case.size, wall, cpu, ios_per_sample=1.0, config=config_label(
        {"workers": workers, "batched": batched, "prefetch_factor": prefetch_factor, "pin_memory": pin_memory,
         "direct": direct}))


def run_memmap(case, cold: bool, order: np.ndarray) -> dict:
    from read_path import Meter, result

    order = order.reshape(case.steps, case.batch)
    offsets = np.asarray(case.ds.lookup(np.arange(case.ds.num_samples)).offset, dtype=np.int64)
    mm = np.memmap(case.path, dtype=np.uint8, mode="r")  # mapped per run: mapped pages survive a cache drop
    if cold:  # without it each 16 KiB fault reads the device's readahead window (megabytes)
        mm._mmap.madvise(mmap.MADV_RANDOM)
    size = case.size
    meter = Meter()
    try:

        def step(ids):
            out = np.empty((len(ids), size), dtype=np.uint8)
            for j, i in enumerate(ids.tolist()):  # per sample, as Megatron's dataset __getitem__ does
                off = int(offsets[i])
                out[j] = mm[off : off + size]
            return out

        step(order[0])
        meter.start()
        for ids in order[1:]:
            step(ids)
        wall, cpu = meter.stop()
    finally:
        mm._mmap.close()
        del mm
    samples = (case.steps - 1) * case.batch
    return result(samples, samples * size, wall, cpu, ios_per_sample=None,
                  config="MADV_RANDOM" if cold else "default readahead")


def fio_configs(*, smoke: bool = False) -> list[dict]:
    """numjobs x iodepth x submission mode; fixedbufs and registerfiles always on."""
    if smoke:
        return [{"numjobs": 1, "iodepth": 32, "mode": "plain"}]
    out = [{"numjobs": j, "iodepth": d, "mode": m} for j in (1, 2, 4) for d in (32, 128)
           for m in ("plain", "batch", "sqpoll")]
    out.append({"numjobs": 1, "iodepth": 128, "mode": "hipri"})
    return out


def run_fio(case, cold: bool, order: np.ndarray | None = None, *, numjobs: int = 1, iodepth: int = 128,
            mode: str = "plain") -> dict:
    """fio's io_uring random read over the same file, as many bytes as the other methods time."""
    from read_path import result

    samples = (case.steps - 1) * case.batch
    per_job = -(-samples // numjobs)
    cmd = [
        "fio", "--name=randread", f"--filename={case.path}", "--rw=randread", f"--bs={case.size}",
        f"--iodepth={iodepth}", "--ioengine=io_uring", "--fixedbufs=1", "--registerfiles=1",
        f"--direct={1 if cold else 0}", "--invalidate=0", "--norandommap", "--randrepeat=0",
        f"--size={os.path.getsize(case.path)}", f"--io_size={per_job * case.size}", f"--numjobs={numjobs}",
        "--group_reporting", "--thread", "--output-format=json",
    ]
    if mode == "batch":
        batch = max(1, iodepth // 4)
        cmd += [f"--iodepth_batch_submit={batch}", f"--iodepth_batch_complete_min={batch}",
                f"--iodepth_batch_complete_max={iodepth}"]
    elif mode == "sqpoll":
        cmd += ["--sqthread_poll=1"]
    elif mode == "hipri":
        cmd += ["--hipri=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or "{" not in proc.stdout:
        raise RuntimeError(f"fio {mode} failed: {(proc.stderr or proc.stdout).strip()[-200:]}")
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    read = job["read"]
    wall = read["runtime"] / 1e3
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1e3
    if wall <= 0 or read["total_ios"] == 0:
        raise RuntimeError(f"fio {mode} read nothing (hipri needs a device with poll queues)")
    return result(int(read["total_ios"]), int(read["io_bytes"]), wall, cpu, ios_per_sample=1.0,
                  fio_iops=read["iops"], config=f"numjobs={numjobs} iodepth={iodepth} {mode}")
