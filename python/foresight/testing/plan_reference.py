"""The plan algorithm in plain vectorized numpy: an independent oracle for tests and the baseline
of ``bench/plan_build.py``. Same randomness, same output arrays as :func:`build_plan`, but with
numpy's whole-array temporaries (argsort, cumsum, searchsorted, repeat) instead of Cython loops,
and a Python loop for multi-dataset blending (fine for tests, too slow for large mixtures).

It imports nothing from the code it checks: the seeding, the index dtype and the bucket count of the global
shuffle are written out again here from the documented rules, so a bug in ``foresight.plan.shuffle`` cannot
hide in both (a change to those rules has to be made twice, on purpose).

Example::

    arrays = reference_arrays([counts], weights=[1.0], kind="tokens", seed=0, num_items=64,
                              seq_len=128)
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: The global shuffle's buckets: about 64 Ki samples each, at most 65535 of them (uint16 keys).
_BUCKET_TARGET = 1 << 16
_MAX_BUCKETS = 65535


def _generator(seed: int, dataset_index: int, epoch: int) -> np.random.Generator:
    """One PCG64 stream per (seed, dataset, epoch), seeded through SeedSequence of that tuple."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, dataset_index, epoch))))


def _index_dtype(n: int) -> np.dtype:
    """Sample ids as int32 while they fit, else int64."""
    return np.dtype(np.int32) if n <= 2**31 - 1 else np.dtype(np.int64)


def _num_buckets(n: int) -> int:
    return min(_MAX_BUCKETS, max(1, -(-n // _BUCKET_TARGET)))


def reference_epoch_order(n: int, *, seed: int, dataset_index: int, epoch: int, shuffle: str,
                          block_size: int | None, dtype: np.dtype) -> np.ndarray:
    rng = _generator(seed, dataset_index, epoch)
    if shuffle == "global":
        k = _num_buckets(n)
        if k == 1:
            out = np.arange(n, dtype=dtype)
            rng.shuffle(out)
            return out
        keys = rng.integers(0, k, size=n, dtype=np.uint16)
        out = np.argsort(keys, kind="stable").astype(dtype)
        bounds = np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=k))])
        for b in range(k):
            rng.shuffle(out[bounds[b] : bounds[b + 1]])
        return out
    num_blocks = -(-n // block_size)
    block_order = rng.permutation(num_blocks)
    inner = np.arange(n, dtype=dtype)
    full = n // block_size
    if full:
        rows = inner[: full * block_size].reshape(full, block_size)
        rng.permuted(rows, axis=1, out=rows)
    if full * block_size < n:
        rng.shuffle(inner[full * block_size :])
    starts = block_order * block_size
    lens = np.minimum(block_size, n - starts)
    shift = starts - (np.cumsum(lens) - lens)
    return inner[np.repeat(shift, lens) + np.arange(n)]


def reference_blend(weights: Sequence[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    choice = np.zeros(n, dtype=np.uint16)
    if len(w) == 1:
        counts[0] = n
        return choice, counts
    wl = w.tolist()
    cl = [0] * len(w)
    for i in range(n):
        x = float(i + 1)
        best = max(range(len(wl)), key=lambda d: (wl[d] * x - float(cl[d]), -d))
        choice[i] = best
        cl[best] += 1
    counts[:] = cl
    return choice, counts


def _pack_one(sizes: np.ndarray, order: np.ndarray, count: int, seq_len: int):
    c = sizes[order]
    keep = c > 0
    order, c = order[keep], c[keep]
    ends = np.cumsum(c)
    starts = ends - c
    j = np.arange(count, dtype=np.int64)
    s0 = j * seq_len
    s1 = s0 + seq_len + 1
    first = np.searchsorted(ends, s0, side="right")
    last = np.searchsorted(ends, s1 - 1, side="right")
    npieces = last - first + 1
    ptr = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(npieces, out=ptr[1:])
    doc = np.repeat(first - ptr[:-1], npieces) + np.arange(ptr[-1])
    seq = np.repeat(j, npieces)
    offset = np.maximum(s0[seq] - starts[doc], 0)
    length = np.minimum(ends[doc], s1[seq]) - (starts[doc] + offset)
    return ptr, order[doc].astype(np.int64), offset, length


def reference_arrays(sizes: Sequence[np.ndarray], *, weights: Sequence[float], kind: str, seed: int,
                     num_items: int, seq_len: int | None = None, shuffle: str = "global",
                     block_size: int | None = None) -> dict[str, np.ndarray]:
    """The five plan arrays for ``num_items`` items (``sizes[d]``: tokens or bytes per sample)."""
    choice, counts = reference_blend(weights, num_items)
    dtype = _index_dtype(max(len(s) for s in sizes))
    local = []
    for d, sz in enumerate(sizes):
        n, count = len(sz), int(counts[d])
        total = int(sz.sum())
        epochs = 0 if count == 0 else (-(-(count * seq_len + 1) // total) if kind == "tokens" else -(-count // n))
        order = np.concatenate(
            [reference_epoch_order(n, seed=seed, dataset_index=d, epoch=e, shuffle=shuffle,
                                   block_size=block_size, dtype=dtype) for e in range(epochs)]
            or [np.zeros(0, dtype)]
        )
        if kind == "tokens":
            local.append(_pack_one(sz, order, count, seq_len))
        else:
            sample = order[:count].astype(np.int64)
            local.append((np.arange(count + 1, dtype=np.int64), sample, np.zeros(count, np.int64), sz[sample]))
    per_item = np.zeros(num_items, dtype=np.int64)
    for d, (ptr, *_rest) in enumerate(local):
        per_item[choice == d] = np.diff(ptr)
    item_ptr = np.zeros(num_items + 1, dtype=np.int64)
    np.cumsum(per_item, out=item_ptr[1:])
    total = int(item_ptr[-1])
    out = {
        "item_ptr": item_ptr,
        "piece_dataset": np.repeat(choice, per_item),
        "piece_sample": np.empty(total, np.int64),
        "piece_offset": np.empty(total, np.int64),
        "piece_length": np.empty(total, np.int64),
    }
    for d, (ptr, sample, offset, length) in enumerate(local):
        items = np.flatnonzero(choice == d)
        npc = np.diff(ptr)
        dest = np.repeat(item_ptr[items] - ptr[:-1], npc) + np.arange(ptr[-1])
        out["piece_sample"][dest] = sample
        out["piece_offset"][dest] = offset
        out["piece_length"][dest] = length
    return out
