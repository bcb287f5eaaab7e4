"""Deterministic sample orders: one numpy Generator per (seed, dataset, epoch).

``epoch_order`` is the order in which one epoch visits a dataset's samples:

* ``"global"``: a uniform random permutation, drawn as Rao-Sandelius does it: every sample gets
  a uniform random bucket, buckets are laid out in order (a counting-sort scatter in Cython), and
  each bucket, small enough for the CPU cache, is shuffled with ``Generator.shuffle``. This is a
  uniform permutation like ``Generator.permutation`` but about twice as fast at 10^8 samples
  (2.5 s against 6 s here) because its shuffles never jump around a large array.
* ``"block"``: runs of ``block_size`` consecutive samples stay together; only the order of the
  blocks and the order inside each block are shuffled, so a step's samples sit close on disk.

All randomness comes from ``np.random.Generator(np.random.PCG64(SeedSequence((seed, d, e))))``;
the loops are integer-only, so the result is byte-identical on any machine.

Example::

    order = epoch_order(10, seed=1, dataset_index=0, epoch=0, shuffle="global")
    sorted(order) == list(range(10))
"""
from __future__ import annotations

import numpy as np

from foresight._native import load

_kernels = load("_plan_kernels")

#: Samples per bucket of the global shuffle: 64 Ki int32 entries (256 KiB) stay in L2 cache.
BUCKET_TARGET = 1 << 16
MAX_BUCKETS = 65535


def generator(seed: int, dataset_index: int, epoch: int) -> np.random.Generator:
    """The Generator of one (seed, dataset, epoch), stable across machines and processes."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, dataset_index, epoch))))


def index_dtype(n: int) -> np.dtype:
    """int32 while every sample id fits, else int64 (halves the memory of large orders)."""
    return np.dtype(np.int32) if n <= np.iinfo(np.int32).max else np.dtype(np.int64)


def num_buckets(n: int) -> int:
    return int(min(MAX_BUCKETS, max(1, -(-n // BUCKET_TARGET))))


def epoch_order(
    n: int,
    *,
    seed: int,
    dataset_index: int,
    epoch: int,
    shuffle: str = "global",
    block_size: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Fill ``out`` (or a new array of :func:`index_dtype`) with one epoch's order of ``range(n)``."""
    dtype = index_dtype(n) if out is None else out.dtype
    if out is None:
        out = np.empty(n, dtype=dtype)
    if out.shape != (n,) or out.dtype not in (np.int32, np.int64):
        raise ValueError("out must be a 1-D int32 or int64 array of length n")
    rng = generator(seed, dataset_index, epoch)
    if shuffle == "global":
        _global_order(n, rng, out)
    elif shuffle == "block":
        if block_size is None or block_size < 1:
            raise ValueError("block shuffle needs block_size >= 1")
        _block_order(n, rng, block_size, out)
    else:
        raise ValueError(f"shuffle must be 'global' or 'block', not {shuffle!r}")
    return out


def _global_order(n: int, rng: np.random.Generator, out: np.ndarray) -> None:
    k = num_buckets(n)
    if k == 1:
        out[:] = np.arange(n, dtype=out.dtype)
        rng.shuffle(out)
        return
    keys = rng.integers(0, k, size=n, dtype=np.uint16)
    cursor = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=k), out=cursor[1:])
    bounds = cursor.copy()
    _kernels.bucket_scatter(keys, cursor[:k], out)
    del keys
    for b in range(k):  # k <= 65535 small shuffles; the Python loop is per bucket, not per sample
        rng.shuffle(out[bounds[b] : bounds[b + 1]])


def _block_order(n: int, rng: np.random.Generator, block_size: int, out: np.ndarray) -> None:
    num_blocks = -(-n // block_size)
    block_order = rng.permutation(num_blocks).astype(np.int64, copy=False)
    inner = np.arange(n, dtype=out.dtype)
    full = n // block_size
    if full:
        rows = inner[: full * block_size].reshape(full, block_size)
        rng.permuted(rows, axis=1, out=rows)
    if full * block_size < n:
        rng.shuffle(inner[full * block_size :])
    _kernels.block_expand(block_order, inner, out, block_size)
