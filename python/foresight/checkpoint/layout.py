"""Byte layout of one checkpoint's data file, identical to its layout in the staging buffer.

Small tensors are packed densely at the front, ordered by element size (largest first) so that every
tensor starts at a multiple of its element size without padding; big tensors follow, each at a 4096-byte
boundary, so they can be read back with O_DIRECT straight into place. The total is padded to 4096 so the
whole file is written with aligned O_DIRECT writes (the pad bytes are never referenced).

Example::

    layout = plan_layout([t.nbytes for t in tensors], [t.element_size() for t in tensors])
    layout.offsets[i], layout.total
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 4096
BIG_TENSOR_BYTES = 256 * 1024  # at or above this size a tensor gets its own aligned extent

_DTYPES = {
    str(d): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)
}


def dtype_from_name(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``; unknown names raise ``KeyError``."""
    return _DTYPES[name]


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Layout:
    offsets: np.ndarray  # int64 byte offset of each tensor in the data file
    nbytes: np.ndarray  # int64 byte length of each tensor
    small_end: int  # bytes [0, small_end) hold the densely packed small tensors
    total: int  # padded file size (multiple of ALIGN)


def plan_layout(nbytes: Sequence[int], itemsize: Sequence[int], *, big: int = BIG_TENSOR_BYTES) -> Layout:
    """Offsets for tensors of the given byte sizes and element sizes (see module docstring)."""
    nb = np.asarray(nbytes, dtype=np.int64)
    isz = np.asarray(itemsize, dtype=np.int64)
    offsets = np.zeros(len(nb), dtype=np.int64)
    is_big = nb >= big
    small = np.flatnonzero(~is_big)
    small = small[np.argsort(-isz[small], kind="stable")]
    if len(small):
        ends = np.cumsum(nb[small])
        offsets[small] = ends - nb[small]
        small_end = int(ends[-1])
    else:
        small_end = 0
    bigs = np.flatnonzero(is_big)
    if len(bigs):
        padded = (nb[bigs] + ALIGN - 1) // ALIGN * ALIGN
        starts = align_up(small_end) + np.concatenate(([0], np.cumsum(padded)[:-1]))
        offsets[bigs] = starts
        total = int(starts[-1] + padded[-1])
    else:
        total = align_up(small_end)
    return Layout(offsets=offsets, nbytes=nb, small_end=small_end, total=max(total, 0))
