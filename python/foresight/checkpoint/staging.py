"""A reusable pool of page-aligned, pre-touched (and CUDA-pinned when CUDA is present) staging buffers.

A save copies every tensor into one slot at its data-file offset (see :mod:`.layout`), so the background
writer writes the slot out as one contiguous, aligned region. The pool is sized once: ``slot_bytes`` per
slot and ``slots`` slots. When every slot is still being written, :meth:`StagingPool.acquire` either blocks
until one drains (``on_busy="block"``) or raises (``on_busy="raise"``); a state dict larger than a slot
always raises :class:`CheckpointError` naming both sizes.

Example::

    pool = StagingPool(slot_bytes=1 << 30, slots=1)
    slot = pool.acquire(nbytes)
    ...
    pool.release(slot)
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from foresight.checkpoint.layout import Layout, align_up, dtype_from_name
from foresight.errors import CheckpointError

ON_BUSY = ("block", "raise")


def _alloc_pinned(nbytes: int) -> tuple[mmap.mmap, torch.Tensor, bool]:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses during the snapshot memcpy; advisory only
    except (AttributeError, OSError):
        pass
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.zero_()  # pre-touch: first-touch page faults run at 0.3-1 GB/s, far below memcpy speed
    pinned = False
    if torch.cuda.is_available():
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        pinned = int(rc) == 0 if not hasattr(rc, "value") else rc.value == 0
    return mm, buf, pinned


@dataclass(eq=False)
class Slot:
    index: int
    buffer: torch.Tensor  # uint8 over the whole slot
    mm: mmap.mmap
    pinned: bool
    view_cache: dict[Any, list[torch.Tensor]] = field(default_factory=dict)

    def memoryview(self, nbytes: int) -> memoryview:
        return memoryview(self.mm)[:nbytes]

    def views(self, key: Any, layout: Layout, dtypes: list[str], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Typed tensor views of each tensor's place in the slot; cached per layout signature."""
        cached = self.view_cache.get(key)
        if cached is None:
            buf = self.buffer
            cached = [
                buf[o:o + n].view(dtype_from_name(dt)).view(shape)
                for o, n, dt, shape in zip(layout.offsets.tolist(), layout.nbytes.tolist(), dtypes, shapes)
            ]
            self.view_cache.clear()  # keep one layout per slot: training saves the same shapes every time
            self.view_cache[key] = cached
        return cached


class StagingPool:
    """``slots`` buffers of ``slot_bytes`` each; see the module docstring for the overflow rules."""

    def __init__(self, slot_bytes: int, *, slots: int = 1, on_busy: str = "block") -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {ON_BUSY}, got {on_busy!r}")
        self.slot_bytes = align_up(slot_bytes)
        self.on_busy = on_busy
        self._slots = []
        for i in range(slots):
            mm, buf, pinned = _alloc_pinned(self.slot_bytes)
            self._slots.append(Slot(i, buf, mm, pinned))
        self._free = list(self._slots)
        self._cv = threading.Condition()

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def pinned(self) -> bool:
        return all(s.pinned for s in self._slots)

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> Slot:
        if nbytes > self.slot_bytes:
            raise CheckpointError("state dict does not fit the staging pool; raise staging_bytes",
                                  needed=nbytes, slot_bytes=self.slot_bytes)
        with self._cv:
            if not self._free and self.on_busy == "raise":
                raise CheckpointError("all staging slots are still being written (on_busy='raise')",
                                      slots=len(self._slots))
            if not self._cv.wait_for(lambda: self._free, timeout=timeout):
                raise CheckpointError("timed out waiting for a free staging slot", slots=len(self._slots))
            # prefer the most recently used slot: its view cache probably matches this layout
            return self._free.pop()

    def release(self, slot: Slot) -> None:
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def close(self) -> None:
        for s in self._slots:
            if s.pinned:
                torch.cuda.cudart().cudaHostUnregister(s.buffer.data_ptr())
            s.view_cache.clear()
        self._slots.clear()
        self._free.clear()


class StagedPrefix:
    """How much of a slot the snapshot has copied: the writer thread may write bytes ``[0, upto)`` while the rest is
    still being copied (a replicated save's first units then leave during the snapshot).

    >>> s = StagedPrefix(100); s.advance(40); s.wait(40, timeout=0), s.wait(41, timeout=0)
    (True, False)
    """

    def __init__(self, total: int) -> None:
        self.total, self.upto = total, 0
        self.error: BaseException | None = None
        self._cv = threading.Condition()

    def advance(self, upto: int) -> None:
        with self._cv:
            self.upto = max(self.upto, min(int(upto), self.total))
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        """The snapshot failed: a writer waiting on it raises instead of writing bytes never copied."""
        with self._cv:
            self.error = error
            self._cv.notify_all()

    def wait(self, upto: int, timeout: float | None = None) -> bool:
        """Block until bytes ``[0, upto)`` are staged (``timeout``: at most that long; returns whether they are)."""
        with self._cv:
            ok = self._cv.wait_for(lambda: self.error is not None or self.upto >= min(upto, self.total), timeout)
            if self.error is not None:
                raise CheckpointError(f"the snapshot failed: {self.error}")
            return ok


def copy_into(views: list[torch.Tensor], tensors: list[torch.Tensor], *, small: list[int],
              big: list[int], offsets: Any = None, staged: StagedPrefix | None = None) -> Any:
    """Copy ``tensors`` into their staging ``views``; return a CUDA event to wait on, or ``None``.

    CPU tensors: small ones in one batched ``_foreach_copy_`` call, big ones with ``copy_`` (multi-threaded
    memcpy that releases the GIL), in slot order. CUDA tensors: ``non_blocking`` copies on a side stream that first
    waits for the current stream; the current stream then waits for the copies, so training may overwrite the
    tensors right away without racing the snapshot. ``staged`` (with the tensors' slot ``offsets``) is advanced as
    the CPU copies complete a prefix of the slot; it is left to the caller once CUDA tensors are among them.
    """
    cuda_idx = [i for i in small + big if tensors[i].device.type == "cuda"]
    cpu_small = [i for i in small if tensors[i].device.type != "cuda"]
    cpu_big = [i for i in big if tensors[i].device.type != "cuda"]
    if offsets is not None:
        cpu_big.sort(key=lambda i: int(offsets[i]))
    progress = staged is not None and offsets is not None and not cuda_idx
    with torch.no_grad():
        if cpu_small:
            src = [tensors[i] for i in cpu_small]
            dst = [views[i] for i in cpu_small]
            try:
                torch._foreach_copy_(dst, src)
            except (RuntimeError, AttributeError):
                for d, s in zip(dst, src):
                    d.copy_(s)
        for i in cpu_big:
            if progress:  # everything before this tensor's place is copied (small ones first, big ones in order)
                staged.advance(int(offsets[i]))
            views[i].copy_(tensors[i])
        if progress:
            staged.advance(staged.total)
        if cuda_idx and torch.cuda.is_available():
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for i in cuda_idx:
                    views[i].copy_(tensors[i], non_blocking=True)
                    tensors[i].record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
            current.wait_event(event)
            return event
    return None
