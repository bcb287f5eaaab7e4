"""Keyed bijections of ``[0, m)`` without arrays: the compact plan's shuffles, in plain numpy.

A four-round balanced Feistel network over ``[0, 2^(2h))`` with ``h = max(1, ceil(bit_length(m - 1) / 2))``,
cycle-walked back into ``[0, m)`` (apply it again until the value falls below ``m``; the domain is less than
4m, so fewer than 4 passes on average). Round ``j`` (0..3) maps ``(L, R)`` to
``(R, L ^ (splitmix64(key ^ (j << 32 | R)) & (2^h - 1)))``; the input is ``L << h | R``. Keys come from
:func:`derive_key`, a splitmix64 chain over integers. This module is the specification; the compact
plan's Cython kernel (``foresight._compact_kernels``) computes the same function, and the tests hold them
equal.

Example::

    p = permute(np.arange(10, dtype=np.uint64), 10, derive_key(1, 0, 0, 0))
    sorted(p.tolist()) == list(range(10))
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
#: Start of every key chain (the first 64 bits of the fractional part of sqrt(2)).
KEY_ORIGIN = 0x6A09E667F3BCC908
#: What a key is for: the order of the blocks of an epoch, or the orders inside its blocks.
BLOCK_ORDER, INNER_ORDER = 0, 1


def splitmix64(z: int) -> int:
    """The splitmix64 finalizer of one Python integer (mod 2^64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def derive_key(*parts: int) -> int:
    """``h = KEY_ORIGIN; for p in parts: h = splitmix64(h ^ (p mod 2^64))``."""
    h = KEY_ORIGIN
    for p in parts:
        h = splitmix64(h ^ (int(p) & MASK64))
    return h


def block_key(seed: int, dataset: int, epoch: int) -> int:
    """Key of the block order of one (seed, dataset, epoch)."""
    return derive_key(seed, dataset, epoch, BLOCK_ORDER)


def inner_key(seed: int, dataset: int, epoch: int, block: int) -> int:
    """Key of the document order inside ``block`` in one epoch: ``splitmix64(derive_key(seed, dataset, epoch,
    INNER_ORDER) ^ block)``."""
    return splitmix64(derive_key(seed, dataset, epoch, INNER_ORDER) ^ block)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def half_bits(m: int) -> int:
    return max(1, ((m - 1).bit_length() + 1) // 2)


def _feistel(x: np.ndarray, key: np.uint64, half: int) -> np.ndarray:
    h = np.uint64(half)
    mask = np.uint64((1 << half) - 1)
    left, right = x >> h, x & mask
    for j in range(4):
        f = _mix(key ^ (np.uint64(j << 32) | right)) & mask
        left, right = right, left ^ f
    return (left << h) | right


def permute(x: np.ndarray, m: int, key: int) -> np.ndarray:
    """The bijection of ``[0, m)`` keyed by ``key`` at each of ``x`` (uint64, all < m)."""
    x = np.asarray(x, dtype=np.uint64)
    if m <= 1:
        return np.zeros_like(x)
    half, k = half_bits(m), np.uint64(key & MASK64)
    with np.errstate(over="ignore"):
        y = _feistel(x, k, half)
        out = y >= np.uint64(m)
        while out.any():
            y[out] = _feistel(y[out], k, half)
            out = y >= np.uint64(m)
    return y
