"""Extents into bytes in memory: coalesce, bind the transfers to a region, read them in one engine batch.

The one sequence every reader of sample bytes runs (the loader into an arena slot, asynchronously; the node's job
and the node client's local fallback into a mapped region, synchronously):

1. :func:`coalesce_extents`: the extents become few large transfers aligned to :data:`ALIGN` (native, GIL released);
2. a region to land in: an arena slot, :func:`anonymous_region` (a fresh mapping, for bytes handed on) or a
   :class:`ReusableRegion` (grown on demand, kept across steps: no page faults per read after the first step);
3. :class:`Reads`: the engine's arguments for those transfers in that region, run with
   :meth:`Reads.run` (``read_batch``: blocks, GIL released) or started with :meth:`Reads.submit` (waited for later).

:func:`read_extents` is the three in one call and returns :class:`PartBytes`: sample ``i`` is the view
``region[offsets[i] : offsets[i] + lengths[i]]`` (zero copy).

Example::

    part = read_extents(engine, files, file, offset, length)             # synchronous, a fresh region
    sample_0 = part.sample(0)
    tr = coalesce_extents(file, offset, length, max_transfer=16 << 20)   # the loader's asynchronous path
    ticket = Reads.into(files, tr, arena.slot(k)).submit(engine)
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from foresight.io.coalesce import DEFAULT_ALIGN as ALIGN  # one alignment for every read path: O_DIRECT's
from foresight.io.coalesce import DEFAULT_MAX_GAP, DEFAULT_MAX_TRANSFER, Transfers, coalesce

# Transfers served by the page cache (buffered files) need no O_DIRECT alignment: there a pad is a copy that saves
# nothing (a 4 KiB token piece at an odd offset copied 8 KiB at ALIGN). 8 bytes keeps a sample's place in the region
# aligned as in its file (``x_dest`` = its file offset modulo 8: typed views still line up) for at most 14 bytes of
# pad per transfer.
CACHED_ALIGN = 8


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``.

    >>> round_up(1), round_up(4096), round_up(4097)
    (4096, 4096, 8192)
    """
    return (int(n) + align - 1) // align * align


def coalesce_extents(file: np.ndarray, offset: np.ndarray, length: np.ndarray, *, max_gap: int = DEFAULT_MAX_GAP,
                     max_transfer: int = DEFAULT_MAX_TRANSFER, align: int = ALIGN) -> Transfers:
    """The transfers of these extents, aligned to ``align`` (:func:`foresight.io.coalesce.coalesce`; ``ALIGN``
    for O_DIRECT, :data:`CACHED_ALIGN` for reads the page cache serves); ``max_gap < 0`` turns coalescing off (one
    transfer per extent).

    >>> tr = coalesce_extents(np.zeros(2, np.int32), np.array([0, 4096]), np.array([100, 100]))
    >>> tr.io_count, tr.x_dest.tolist(), tr.read_bytes
    (1, [0, 4096], 8192)
    >>> coalesce_extents(np.zeros(2, np.int32), np.array([0, 4096]), np.array([100, 100]), max_gap=0,
    ...                  align=CACHED_ALIGN).t_length.tolist()
    [104, 104]
    """
    if max_gap < 0:
        return coalesce(file, offset, length, max_gap=0, max_transfer=1, align=align)
    return coalesce(file, offset, length, max_gap=max_gap, max_transfer=max_transfer, align=align)


def anonymous_region(nbytes: int) -> np.ndarray:
    """A fresh page-aligned anonymous mapping of at least ``nbytes`` (at least one :data:`ALIGN` block), as uint8.

    >>> anonymous_region(10).nbytes
    4096
    """
    return np.frombuffer(mmap.mmap(-1, max(ALIGN, round_up(nbytes))), dtype=np.uint8)


class ReusableRegion:
    """One mapping reused step after step, grown when a step needs more. For a reader whose outputs never view
    the region after the step (a decode stage copies into its tensors): a fresh mapping per step would cost a page
    fault per 4 KiB of every read.

    Example::

        here = ReusableRegion()
        region = here.get(tr.total_bytes)      # the same memory next time, unless more is needed
    """

    def __init__(self) -> None:
        self._region: np.ndarray | None = None

    def get(self, nbytes: int) -> np.ndarray:
        if self._region is None or self._region.nbytes < nbytes:
            self._region = anonymous_region(nbytes)
        return self._region


@dataclass(frozen=True, eq=False)
class Reads:
    """The engine's arguments for ``transfers`` landing in a region: ``fds``, ``offsets``, ``lengths``, ``addrs``
    (uint64), ``needed`` (the least a short read at a file's end must deliver).

    Example::

        reads = Reads.into(files, tr, region)
        reads.run(engine)                      # or: ticket = reads.submit(engine); engine.wait(ticket)
    """

    fds: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    addrs: np.ndarray
    needed: np.ndarray

    @classmethod
    def into(cls, files: Any, tr: Transfers, region: np.ndarray) -> "Reads":
        """``tr``'s transfers of ``files`` (a :class:`~foresight.source.FileTable`) into ``region``."""
        return cls(files.fds[tr.t_file], tr.t_offset, tr.t_length,
                   (region.ctypes.data + tr.t_dest).astype(np.uint64), tr.t_needed)

    def run(self, engine: Any) -> None:
        """Read them all; returns when every transfer is in (``IOEngine.read_batch``)."""
        engine.read_batch(self.fds, self.offsets, self.lengths, self.addrs, needed=self.needed)

    def submit(self, engine: Any) -> Any:
        """Start them; the returned ticket goes to ``engine.wait`` / ``engine.poll``."""
        return engine.submit_reads(self.fds, self.offsets, self.lengths, self.addrs, needed=self.needed)


@dataclass(eq=False)
class PartBytes:
    """Samples in memory: sample ``i`` is ``region[offsets[i] : offsets[i] + lengths[i]]``. ``transfers`` is how
    they were read (None for bytes that came from elsewhere: a loader's slot, a node's raw reply)."""

    region: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    transfers: Transfers | None = None

    @property
    def bytes_read(self) -> int:
        return 0 if self.transfers is None else int(self.transfers.t_length.sum())

    def sample(self, i: int) -> np.ndarray:
        start = int(self.offsets[i])
        return self.region[start : start + int(self.lengths[i])]


def read_extents(engine: Any, files: Any, file: np.ndarray, offset: np.ndarray, length: np.ndarray, *,
                 into: ReusableRegion | None = None, max_gap: int = DEFAULT_MAX_GAP,
                 max_transfer: int = DEFAULT_MAX_TRANSFER) -> PartBytes:
    """Coalesce the extents, land them in ``into`` (else a fresh mapping: bytes that may be handed on), read them
    with one blocking engine batch; see the module docstring."""
    tr = coalesce_extents(file, offset, length, max_gap=max_gap, max_transfer=max_transfer)
    region = anonymous_region(tr.total_bytes) if into is None else into.get(round_up(tr.total_bytes))
    Reads.into(files, tr, region).run(engine)
    return PartBytes(region, tr.x_dest, np.asarray(length, dtype=np.int64), tr)


__all__ = ["ALIGN", "CACHED_ALIGN", "PartBytes", "Reads", "ReusableRegion", "anonymous_region", "coalesce_extents", "read_extents",
           "round_up"]
