"""Read coalescing: one step's extents become few large aligned transfers, and samples become views.

The native coalescer (``foresight._core``, GIL released, O(n log n)) groups extents per file, sorts them,
and merges neighbours whose gap is at most ``max_gap`` bytes while a merged transfer stays at most
``max_transfer`` bytes. Transfers are aligned to ``align`` (offset down, end up) so O_DIRECT works, and
are laid out back to back in one destination region; ``x_dest[i]`` says where extent ``i`` starts there.

Example::

    import numpy as np
    from foresight.io.coalesce import coalesce

    tr = coalesce(np.array([0, 0], np.int32), np.array([0, 9000]), np.array([100, 50]),
                  max_gap=64 << 10, max_transfer=1 << 20)
    region = np.empty(tr.total_bytes, np.uint8)
    # read file tr.t_file[k] bytes [t_offset[k], +t_length[k]) into region[t_dest[k]:] for every k, then
    sample_1 = region[tr.x_dest[1] : tr.x_dest[1] + 50]   # a view, no copy

Reads past the end of a file: ``t_length`` is a multiple of ``align``, so the last transfer of a file may ask
for bytes beyond its end and come back short. ``t_needed[k]`` is what transfer ``k`` must deliver (everything
an extent asked for); a reader accepts a short read of at least that many bytes. Pass ``file_sizes`` to have
extents checked against their files (:class:`~foresight.errors.FormatError` names the one that is past the end).

Overlapping and duplicate extents share bytes; zero-length extents cause no read (their ``x_dest`` is 0).
When merging would exceed ``max_transfer`` but the next extent shares an aligned block with the open transfer,
the next transfer starts right where the open one ends; such transfers are contiguous in the region too, so the
extent spanning both is still one view. A ``max_transfer`` below ``align`` turns merging off.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from foresight._native import load

_core = load("_core")

__all__ = [
    "Transfers", "coalesce", "transfer_limit_for", "DEFAULT_MAX_GAP", "DEFAULT_MAX_TRANSFER", "DEFAULT_ALIGN",
]

# Chosen by bench/read_path.py's sweep (block-local 16 KiB, O_DIRECT): one 16 KiB random read costs about
# 22 us of disk time, ~55 KB of streaming at 2.5 GB/s, so holes up to 64 KiB are cheaper read than skipped;
# 4 MiB transfers were best with huge-page arenas (the loader's), 1 MiB without them (segment limit).
DEFAULT_MAX_GAP = 64 << 10
DEFAULT_MAX_TRANSFER = 4 << 20
DEFAULT_ALIGN = 4096
# Large samples: a transfer holds at least this many typical extents, up to the cap (the 1 MiB sweep in
# bench/read_path.py: 4 -> 32 MiB transfers keep or raise MB/s cold and warm, with 8x fewer I/Os).
EXTENTS_PER_TRANSFER = 16
MAX_AUTO_TRANSFER = 64 << 20

_INT32 = np.iinfo(np.int32)


def transfer_limit_for(mean_extent_bytes: float, *, floor: int = DEFAULT_MAX_TRANSFER,
                       align: int = DEFAULT_ALIGN) -> int:
    """The ``max_transfer`` for extents of this mean size: ``floor`` for small ones, room for
    ``EXTENTS_PER_TRANSFER`` of them for large ones, at most ``MAX_AUTO_TRANSFER`` (and never below ``floor``).

    The arena holds a whole step whatever the transfer size, so a larger limit costs no memory; it only merges
    neighbours the gap rule already allows into fewer, larger reads.

    Example::

        transfer_limit_for(16 << 10)   # 4 MiB: 256 samples of 16 KiB per transfer at most
        transfer_limit_for(1 << 20)    # 16 MiB: 16 samples of 1 MiB
    """
    want = int(EXTENTS_PER_TRANSFER * max(0.0, float(mean_extent_bytes)))
    want = -(-want // align) * align
    return max(int(floor), min(MAX_AUTO_TRANSFER, want))


@dataclass(frozen=True, eq=False)
class Transfers:
    """The reads for one step and where every extent lands.

    Per transfer ``k``: ``t_file`` (int32), ``t_offset``, ``t_length``, ``t_needed``, ``t_dest`` (int64).
    Per input extent ``i``: ``x_dest`` (int64) and ``x_length`` (the input lengths).
    """

    t_file: np.ndarray
    t_offset: np.ndarray
    t_length: np.ndarray
    t_needed: np.ndarray
    t_dest: np.ndarray
    x_dest: np.ndarray
    x_length: np.ndarray
    total_bytes: int
    requested_bytes: int
    read_bytes: int
    align: int

    @property
    def io_count(self) -> int:
        return len(self.t_offset)

    @property
    def amplification(self) -> float:
        """Bytes read per byte requested (1.0 when nothing was requested)."""
        return self.read_bytes / self.requested_bytes if self.requested_bytes else 1.0

    def stats(self) -> dict[str, float]:
        """``{"extents", "io_count", "requested_bytes", "read_bytes", "amplification"}``."""
        return {
            "extents": len(self.x_dest),
            "io_count": self.io_count,
            "requested_bytes": self.requested_bytes,
            "read_bytes": self.read_bytes,
            "amplification": self.amplification,
        }

    def view(self, region: np.ndarray, i: int) -> np.ndarray:
        """Extent ``i`` as a zero-copy slice of the filled destination ``region``."""
        start = int(self.x_dest[i])
        return region[start : start + int(self.x_length[i])]


def _as_int_array(name: str, values, dtype: np.dtype) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        return values  # what the checks below return for it, without their calls (the per-step case)
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"coalesce: {name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:  # np.asarray([]) is float64; an empty list is still a valid empty step
            return np.empty(0, dtype)
        raise TypeError(f"coalesce: {name} must hold integers (int8..int64, uint8..uint64), got {arr.dtype}")
    if arr.dtype != dtype and arr.size:
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"coalesce: {name} holds {lo if lo < info.min else hi}, outside {np.dtype(dtype)}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _check_option(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"coalesce: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"coalesce: {name} must be >= {minimum}, got {value}")
    return int(value)


def coalesce(
    file,
    offset,
    length,
    /,
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    max_transfer: int = DEFAULT_MAX_TRANSFER,
    align: int = DEFAULT_ALIGN,
    file_sizes=None,
) -> Transfers:
    """Merge one step's extents into aligned transfers (see the module docstring).

    ``file`` (int32 file/shard index), ``offset`` and ``length`` (int64 bytes) are parallel arrays of any
    integer dtype that fits; ``align`` is a power of two (1 = no alignment, 4096 for O_DIRECT).

    >>> import numpy as np
    >>> tr = coalesce(np.zeros(2, np.int32), np.array([0, 4096]), np.array([4096, 4096]), align=4096)
    >>> tr.io_count, tr.t_length.tolist(), tr.x_dest.tolist()
    (1, [8192], [0, 4096])
    """
    if not (type(max_gap) is int and type(max_transfer) is int and type(align) is int  # the per-step case: no calls
            and max_gap >= 0 and max_transfer >= 1 and align >= 1):
        max_gap = _check_option("max_gap", max_gap, 0)
        max_transfer = _check_option("max_transfer", max_transfer, 1)
        align = _check_option("align", align, 1)
    if align & (align - 1):
        raise ValueError(f"coalesce: align must be a power of two (1, 512, 4096, ...), got {align}")
    f = _as_int_array("file", file, np.int32)
    o = _as_int_array("offset", offset, np.int64)
    n = _as_int_array("length", length, np.int64)
    if not len(f) == len(o) == len(n):
        raise ValueError(f"coalesce: file, offset and length differ in length ({len(f)}, {len(o)}, {len(n)})")
    sizes = None if file_sizes is None else _as_int_array("file_sizes", file_sizes, np.int64)
    out = _core.coalesce(f, o, n, max_gap=max_gap, max_transfer=max_transfer, align=align, file_sizes=sizes)
    return Transfers(x_length=n, align=align, **out)
