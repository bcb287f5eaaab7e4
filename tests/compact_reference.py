"""A plain materialized reference of the compact plan algorithm (docs/formats.md, "Compact plans"), for tests.

Written again from the spec, in scalar Python and numpy, importing nothing from foresight.plan.compact or
foresight.plan.permute: the Feistel bijection, the keys, the tiled blocks (format 3; ``block_group=None`` is format 2's one
tile strided over the corpus), the blend period and the packing.
It materializes every dataset's whole document order, so it is for small corpora only.

Example::

    arrays = reference_compact([sizes], [1.0], seed=1, seq_len=16, num_items=64, block_size=4, block_group=64)
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

M64 = (1 << 64) - 1


def mix(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def key(*parts: int) -> int:
    h = 0x6A09E667F3BCC908
    for p in parts:
        h = mix(h ^ (p & M64))
    return h


def perm(x: int, m: int, k: int) -> int:
    if m <= 1:
        return 0
    half = max(1, ((m - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    while True:
        left, right = x >> half, x & mask
        for j in range(4):
            left, right = right, left ^ (mix(k ^ ((j << 32) | right)) & mask)
        x = (left << half) | right
        if x < m:
            return x


def blend(weights, num_items):
    """(dataset, dataset-local item) of every global item."""
    d_count = len(weights)
    period = 1 if d_count == 1 else 65536
    exact = [float(x) / math.fsum(float(v) for v in weights) * period for x in weights]
    counts = [int(np.floor(x)) for x in exact]
    rest = sorted(range(d_count), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in rest[: period - sum(counts)]:
        counts[d] += 1
    pairs = sorted(((2 * j + 1) / (2 * counts[d]), d, j) for d in range(d_count) for j in range(counts[d]))
    out = []
    for i in range(num_items):
        r, q = divmod(i, period)
        _, d, j = pairs[q]
        out.append((d, r * counts[d] + j))
    return out


def blocks(n: int, block_size: int | None, group: int | None) -> list[list[int]]:
    """Every block's documents in slot order 0.. (before the in-block permutation)."""
    strided = -(-n // block_size) if block_size else max(-(-n // 256), min(n, 4096))
    if group is None:  # format 2: block b holds b, b + nb, ...
        return [list(range(b, n, strided)) for b in range(strided)]
    tile = group * (block_size or -(-n // strided))
    out = []
    for start in range(0, n, tile):
        docs = list(range(start, min(n, start + tile)))
        g = group if len(docs) == tile else -(-len(docs) // (tile // group))  # a short last tile: blocks of ~S
        out += [docs[r::g] for r in range(g)]
    return out


def doc_order(n: int, block_size: int | None, seed: int, dataset: int, epoch: int,
              group: int | None = 64) -> list[int]:
    layout = blocks(n, block_size, group)
    nb = len(layout)
    order = []
    for k in range(nb):
        b = perm(k, nb, key(seed, dataset, epoch, 0))
        count = len(layout[b])
        inner = mix(key(seed, dataset, epoch, 1) ^ b)
        order += [layout[b][perm(j, count, inner)] for j in range(count)]
    return order


def reference_compact(sizes, weights, *, seed: int, seq_len: int, num_items: int, block_size: int | None,
                      block_group: int | None = 64) -> dict:
    """The five plan arrays of the compact plan of ``sizes`` (token counts per dataset)."""
    items = blend(weights, num_items)
    need = [0] * len(sizes)
    for d, k in items:
        need[d] = max(need[d], k + 1)
    streams = []
    for d, sz in enumerate(sizes):
        total = int(np.sum(sz))
        epochs = -(-(need[d] * seq_len + 1) // total) if need[d] else 0
        docs = [doc for e in range(epochs) for doc in doc_order(len(sz), block_size, seed, d, e, block_group)]
        docs = [doc for doc in docs if sz[doc] > 0]
        ends = np.cumsum([int(sz[doc]) for doc in docs]) if docs else np.zeros(0, np.int64)
        streams.append((docs, ends))
    ptr, ds, sample, offset, length = [0], [], [], [], []
    for d, k in items:
        docs, ends = streams[d]
        t0, t1 = k * seq_len, k * seq_len + seq_len + 1
        i = int(np.searchsorted(ends, t0, side="right"))
        t = t0
        while t < t1:
            start = int(ends[i - 1]) if i else 0
            take = min(t1, int(ends[i])) - t
            ds.append(d), sample.append(docs[i]), offset.append(t - start), length.append(take)
            t += take
            i += 1
        ptr.append(len(sample))
    return {"item_ptr": np.array(ptr, np.int64), "piece_dataset": np.array(ds, np.uint16),
            "piece_sample": np.array(sample, np.int64), "piece_offset": np.array(offset, np.int64),
            "piece_length": np.array(length, np.int64)}


def draw_corpus(data, num_sources: int) -> tuple[list[np.ndarray], list[float]]:
    """Hypothesis: ``num_sources`` corpora of up to 120 document lengths (zeros allowed, never all zero) and their
    blending weights."""
    sizes, weights = [], []
    for _ in range(num_sources):
        n = data.draw(st.integers(1, 120))
        hi = data.draw(st.integers(1, 60))
        arr = np.array(data.draw(st.lists(st.integers(0, hi), min_size=n, max_size=n)), dtype=np.int64)
        if arr.sum() == 0:
            arr[0] = 1
        sizes.append(arr)
        weights.append(data.draw(st.floats(0.05, 5.0)))
    return sizes, weights
