"""A thread pool that decodes the media samples of a step at once, slowest first.

PyAV releases the GIL inside the codec and swscale, so plain threads use every core. The batch
planner estimates each sample's cost from the pack-time index (frames from keyframe to last
wanted frame x pixels; pixels for images; samples for audio) and submits the most expensive first,
so the step is not left waiting on one big clip that started last.

Defaults, from bench/decode.py on the 2-core dev machine: ``os.cpu_count()`` workers with one FFmpeg
thread each. More workers than cores only add CPU per clip (720p: 180 ms at 1-2 workers, 198-208 ms
at 3-4), and FFmpeg frame threads inside one decode cost 12-16% more CPU per clip than decoding two
samples at once; use ``codec_threads=2`` only when a batch has fewer samples than cores. Under 3% of
a 720p decode (12% at 360p) runs in Python holding the GIL, so the pool scales with cores.
Creating a pool removes any Python FFmpeg log callback (``av.logging.set_level(None)``): with
FFmpeg threads such a callback can deadlock when a decoder closes (see ``_av``).

Processes: a ``fork`` copies the pool but not its threads, so a forked child (a ``DataLoader`` worker) gets
fresh threads and locks at the fork (``os.register_at_fork``); a pickled pool starts its own in the new process.
Waits are bounded: ``result()`` raises :class:`~foresight.errors.DecodeTimeoutError` naming a sample still
pending after ``timeout_s`` (and at once for a batch submitted before a fork, whose threads are gone).

Example::

    with DecodePool(threads=2) as pool:
        spec = TransformSpec(modality="video", size=(224, 224))
        tensors = pool.decode(spec, datas, metas, sample_ids, seed=1, epoch=0)   # in input order
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from foresight.errors import DecodeTimeoutError

from ._av import ensure_quiet_logging
from .sampling import sample_frame_indices
from .transforms import TransformSpec
from .video import decode_cost


def estimate_cost(spec: TransformSpec, meta: dict[str, Any] | None, *, seed: int, epoch: int, sample_id: int,
                  nbytes: int = 0) -> float:
    """Relative decode cost of one sample (used only to order work; units are ~pixels decoded)."""
    if meta is None:
        return float(nbytes) * 100.0  # unknown: bigger files cost more
    if spec.modality == "video":
        idx = sample_frame_indices(meta, spec.frames, seed=seed, epoch=epoch, sample_id=sample_id)
        return decode_cost(meta, idx)
    if spec.modality == "image":
        return float(meta["width"] * meta["height"])
    window = spec.audio.window_s or meta.get("duration_s", 0.0)
    return float(window) * meta.get("sample_rate", 48000) * 10.0


_POOL_TIMEOUT: Any = object()  # result()'s default: the pool's timeout_s


class BatchHandle:
    """Futures of one submitted batch; ``result()`` returns outputs in input order."""

    def __init__(self, futures: list[cf.Future], return_exceptions: bool, sample_ids: Sequence[int] = (),
                 timeout_s: float | None = None):
        self.futures = futures
        self.return_exceptions = return_exceptions
        self.sample_ids = list(sample_ids)
        self.timeout_s = timeout_s
        self._pid = os.getpid()

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = _POOL_TIMEOUT) -> list:
        """Outputs in input order. Waits at most ``timeout`` seconds for the whole batch (default: the pool's
        ``timeout_s``; None: no limit), then raises :class:`DecodeTimeoutError` naming a pending sample."""
        if self._pid != os.getpid() and not self.done():
            raise DecodeTimeoutError(
                "decode batch was submitted in another process (before a fork): its threads are not in this one; "
                "submit it again here", submitted_in=self._pid, waited_in=os.getpid(), sample=self._pending())
        limit = self.timeout_s if timeout is _POOL_TIMEOUT else timeout
        deadline = None if limit is None else time.monotonic() + float(limit)
        out = []
        for f in self.futures:
            try:
                e = f.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except cf.TimeoutError:
                raise DecodeTimeoutError(
                    f"decode pool gave no result within {limit} s ({sum(not f.done() for f in self.futures)} of "
                    f"{len(self.futures)} samples pending)", sample=self._pending()) from None
            if e is not None and not self.return_exceptions:
                raise e
            out.append(e if e is not None else f.result())
        return out

    def _pending(self) -> int | None:
        pending = [i for f, i in zip(self.futures, self.sample_ids) if not f.done()]
        return pending[0] if pending else None

    def stacked(self):
        """All outputs stacked into one batch tensor (torch.stack or np.stack); shapes must agree."""
        out = self.result()
        if not out:
            raise ValueError("empty batch")
        shapes = {tuple(x.shape) for x in out}
        if len(shapes) != 1:
            raise ValueError(f"outputs differ in shape, cannot stack: {sorted(shapes)}")
        if isinstance(out[0], np.ndarray):
            return np.stack(out)
        import torch

        return torch.stack(out)


_LIVE_POOLS: "weakref.WeakSet[DecodePool]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_LIVE_POOLS):
        pool._start_threads()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DecodePool:
    """Decode many samples concurrently; see module docstring. Thread-safe submission.

    ``timeout_s``: the longest ``result()`` waits for one submitted batch by default (None: no limit).
    """

    def __init__(self, threads: int | None = None, *, codec_threads: int = 1,
                 timeout_s: float | None = 300.0) -> None:
        threads = (os.cpu_count() or 1) if threads is None else threads
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not isinstance(codec_threads, int) or codec_threads < 1:
            raise ValueError(f"codec_threads must be an int >= 1, got {codec_threads!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        ensure_quiet_logging()
        self.threads = threads
        self.codec_threads = codec_threads
        self.timeout_s = timeout_s
        self._stats: dict[str, dict[str, float]] = {}
        self._closed = False
        self._start_threads()
        _LIVE_POOLS.add(self)

    def _start_threads(self) -> None:
        """A new executor and lock: at creation, and in a forked child, where the parent's threads do not exist
        and a lock one of them held stays locked forever. Runs in the child before any other thread starts."""
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="foresight-decode")
        if self._closed:
            self._pool.shutdown()

    def __getstate__(self) -> dict:
        # Threads and locks do not travel: the unpickled pool starts its own.
        return {"threads": self.threads, "codec_threads": self.codec_threads, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["threads"], codec_threads=state["codec_threads"], timeout_s=state["timeout_s"])

    def _run(self, spec: TransformSpec, data, meta, seed: int, epoch: int, sample_id: int):
        t0 = time.perf_counter()
        ok = False
        try:
            out = spec.apply(data, meta, seed=seed, epoch=epoch, sample_id=sample_id, threads=self.codec_threads)
            ok = True
            return out
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                s = self._stats.setdefault(spec.modality, {"samples": 0, "seconds": 0.0, "errors": 0})
                s["samples"] += 1
                s["seconds"] += dt
                s["errors"] += 0 if ok else 1

    def submit(self, spec: TransformSpec, datas: Sequence, metas: Sequence[dict | None], sample_ids: Sequence[int], *,
               seed: int, epoch: int, return_exceptions: bool = False) -> BatchHandle:
        """Queue a batch, most expensive sample first; returns at once (overlap it with reads)."""
        n = len(datas)
        if not (len(metas) == len(sample_ids) == n):
            raise ValueError(f"datas, metas, sample_ids must have one length, got {n}, {len(metas)}, {len(sample_ids)}")
        costs = np.array([estimate_cost(spec, m, seed=seed, epoch=epoch, sample_id=int(i), nbytes=len(d))
                          for d, m, i in zip(datas, metas, sample_ids)], dtype=np.float64)
        futures: list[cf.Future | None] = [None] * n
        for j in np.argsort(-costs, kind="stable"):
            futures[j] = self._pool.submit(self._run, spec, datas[j], metas[j], seed, epoch, int(sample_ids[j]))
        return BatchHandle(futures, return_exceptions, [int(i) for i in sample_ids],  # type: ignore[arg-type]
                           self.timeout_s)

    def decode(self, spec: TransformSpec, datas: Sequence, metas: Sequence[dict | None], sample_ids: Sequence[int], *,
               seed: int, epoch: int, return_exceptions: bool = False) -> list:
        """Decode a batch and wait; outputs in input order. A bad sample raises (or is returned as) DecodeError."""
        return self.submit(spec, datas, metas, sample_ids, seed=seed, epoch=epoch,
                           return_exceptions=return_exceptions).result()

    def map(self, fn, *iterables) -> list:
        """Run any pure decode function over the pool (e.g. ``decode_video`` with custom args)."""
        return list(self._pool.map(fn, *iterables))

    def stats(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Per modality: samples decoded, summed decode seconds (thread time), errors."""
        with self._lock:
            out = {k: dict(v) for k, v in self._stats.items()}
            if reset:
                self._stats.clear()
        return out

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BatchHandle", "DecodePool", "estimate_cost"]
