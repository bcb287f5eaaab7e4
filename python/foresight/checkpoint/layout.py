"""Byte layout of one checkpoint's data file, identical to its layout in the staging buffer.

Small tensors are packed densely at the front, ordered by element size (largest first) so that every
tensor starts at a multiple of its element size without padding; big tensors follow, each at a 4096-byte
boundary, so they can be read back with O_DIRECT straight into place. The total is padded to 4096 so the
whole file is written with aligned O_DIRECT writes (the pad bytes are never referenced).

Example::

    layout = plan_layout([t.nbytes for t in tensors], [t.element_size() for t in tensors])
    layout.offsets[i], layout.total
    dtype_info(torch.float8_e4m3fnuz).stored  # "raw"

Every torch dtype has one entry in ``DTYPES`` (its name as recorded in indexes and DCP metadata, its
item size, and how its tensors are stored), so the Checkpointer, its reader and the DCP plug-ins agree
on what can be saved and what is refused at save time with a clear error.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from foresight.errors import CheckpointError

ALIGN = 4096
BIG_TENSOR_BYTES = 256 * 1024  # at or above this size a tensor gets its own aligned extent

RAW = "raw"  # the tensor's bytes as they are in memory, viewed back with the dtype
TORCH_SAVE = "torch.save"  # serialised whole by torch.save, as PyTorch's FileSystemWriter does (DCP only)
REFUSED = "refused"  # cannot be stored; ``DtypeInfo.why`` says why and what to do instead

# quantized tensors carry a scale and zero point (per tensor or per channel) besides their bytes
_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


@dataclass(frozen=True)
class DtypeInfo:
    """One torch dtype: its recorded name, item size, and how checkpoints store its tensors."""

    dtype: torch.dtype
    name: str  # str(dtype), e.g. "torch.bfloat16": what indexes and DCP metadata record
    itemsize: int
    stored: str  # RAW, TORCH_SAVE or REFUSED
    why: str = ""  # for anything but RAW: why the bytes alone are not enough


def _classify(dtype: torch.dtype) -> DtypeInfo:
    name = str(dtype)
    if dtype in _QUANTIZED:
        return DtypeInfo(dtype, name, dtype.itemsize, TORCH_SAVE,
                         "a quantized tensor carries its scale and zero point besides its bytes")
    try:  # sub-byte dtypes (uint1..7, int1..7) exist as tensors but torch cannot copy them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
            torch.empty(1, dtype=dtype).clone()
    except (RuntimeError, TypeError):
        return DtypeInfo(dtype, name, dtype.itemsize, REFUSED,
                         f"torch has no copy kernel for {name}; store t.view(torch.uint8) instead")
    return DtypeInfo(dtype, name, dtype.itemsize, RAW)


# every dtype this torch has (aliases such as torch.half map to one entry), so new dtypes are classified too
DTYPES: dict[str, DtypeInfo] = {
    info.name: info
    for info in map(_classify, sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
}
_BY_DTYPE = {info.dtype: info for info in DTYPES.values()}


def dtype_info(dtype: torch.dtype) -> DtypeInfo:
    """The table entry of ``dtype`` (see :data:`DTYPES`)."""
    return _BY_DTYPE[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``; names this torch does not know raise ``KeyError``."""
    info = DTYPES.get(name)
    if info is None:
        raise KeyError(f"unknown dtype {name!r} (written by a newer torch?)")
    return info.dtype


def require_raw(dtype: torch.dtype, **where: Any) -> None:
    """Raise :class:`CheckpointError` (naming ``where``) unless tensors of ``dtype`` are stored as raw bytes."""
    info = dtype_info(dtype)
    if info.stored != RAW:
        hint = (" (torch.distributed.checkpoint with ForesightStorageWriter stores them as PyTorch's writer does)"
                if info.stored == TORCH_SAVE else "")
        raise CheckpointError(f"{info.name} tensors cannot be checkpointed as raw bytes: {info.why}{hint}", **where)


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
