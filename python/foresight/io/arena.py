"""Arena: page-aligned host memory allocated and pre-touched once, split into slots, pinned when CUDA is there.

A loader reads each step into one slot and hands out tensors that view it; a slot goes back to the pool only
after its consumer is done (``release``), so host memory is bounded by ``slots x slot_bytes`` and is stated
up front (:meth:`Arena.describe`, logged at creation). With CUDA available the whole arena is page-locked with
``cudaHostRegister`` so ``tensor(i).to("cuda", non_blocking=True)`` copies straight from it; without CUDA
pinning is skipped.

Example::

    from foresight.io.arena import Arena

    with Arena(64 << 20, 4) as arena:       # 4 slots of 64 MiB
        i = arena.acquire(timeout=5.0)     # blocks while all slots are in use; TimeoutError after 5 s
        buf = arena.slot(i)                # numpy uint8 view, no copy
        t = arena.tensor(i)                # torch uint8 tensor over the same memory
        arena.release(i)

Lifetime: :meth:`close` ends the arena at once (any further use raises ``ValueError``, waiters in
:meth:`acquire` are woken with ``ValueError``) and unpins it, but the memory itself is unmapped only when the last
view (numpy array or tensor made from one) is gone, so a view never dangles. ``live_views`` counts them.
Unpinning happens at close, so finish (synchronize) any GPU copy from the arena before closing it.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from foresight._closing import Closing
from foresight._native import load

_core = load("_core")

__all__ = ["Arena"]

log = logging.getLogger(__name__)

_PIN_CHOICES = ("auto", True, False)
# Slices of a blocking acquire: short enough that Ctrl-C and close() are noticed promptly.
_WAIT_SLICE_S = 0.1


def _cudart():
    """torch's CUDA runtime bindings when a CUDA device is usable, else None (torch itself is optional)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch.cuda.cudart() if torch.cuda.is_available() else None
    except Exception as e:  # a broken driver means no pinning, not no loader
        log.warning("CUDA reported available but its runtime failed to load (%s); arena not pinned", e)
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Arena(Closing):
    """``slots`` page-aligned buffers of ``slot_bytes`` (rounded up to the page size) with an acquire/release pool.

    ``pin``: ``"auto"`` pins with CUDA when available, ``True`` requires it, ``False`` never pins.
    ``hugepages`` advises transparent huge pages before the memory is touched (fewer TLB misses, pinning faster).

    >>> with Arena(10_000, 2, pin=False) as a:
    ...     a.slot_bytes, a.nbytes, a.address(1) % 4096
    (12288, 24576, 0)
    """

    def __init__(self, slot_bytes: int, slots: int, *, pin: bool | str = "auto", hugepages: bool = False) -> None:
        for name, value in (("slot_bytes", slot_bytes), ("slots", slots)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Arena: {name} must be an int >= 1, got {value!r}")
        if pin not in _PIN_CHOICES or isinstance(pin, int) and not isinstance(pin, bool):
            raise ValueError(f"Arena: pin must be one of {_PIN_CHOICES}, got {pin!r}")
        self._core = _core.Arena(int(slot_bytes), int(slots), hugepages=bool(hugepages))
        self._cudart = None
        if pin is not False:
            cudart = _cudart()
            if cudart is None and pin is True:
                self._core.close()
                raise RuntimeError("Arena: pin=True needs a CUDA device, and torch.cuda.is_available() is False")
            if cudart is not None:
                self._pin(cudart)
        log.info("%s", self.describe())

    def _pin(self, cudart) -> None:
        err = cudart.cudaHostRegister(self._core.address(0), self._core.nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            self._core.close()
            raise OSError(f"Arena: cudaHostRegister of {_mib(self._core.nbytes)} failed with CUDA error {code}"
                          " (page-locked memory limit? see ulimit -l)")
        self._cudart = cudart

    # -- what it is ------------------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        return self._core.slot_bytes

    @property
    def slots(self) -> int:
        return self._core.slots

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    @property
    def pinned(self) -> bool:
        return self._cudart is not None

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def free_slots(self) -> int:
        return self._core.free_slots

    @property
    def live_views(self) -> int:
        """Views of the arena's memory still alive (they keep it mapped after :meth:`close`)."""
        return self._core.live_views

    def describe(self) -> str:
        """One line stating the memory the arena holds, e.g. for the loader's start-up log."""
        state = "closed" if self.closed else "pinned (CUDA)" if self.pinned else "not pinned (no CUDA)"
        huge = ", huge pages advised" if self._core.hugepages_advised else ""
        return (f"Arena: {self.slots} slots x {_mib(self.slot_bytes)} = {_mib(self.nbytes)} page-aligned, "
                f"pre-touched host memory, {state}{huge}")

    def __repr__(self) -> str:
        return f"<{self.describe()}>"

    # -- memory ----------------------------------------------------------------------------------------

    def slot(self, i: int) -> np.ndarray:
        """Slot ``i`` as a writable numpy uint8 array over the arena memory (no copy)."""
        return self._core.slot(i)

    def tensor(self, i: int):
        """Slot ``i`` as a torch uint8 tensor over the arena memory (no copy; pinned if the arena is)."""
        import torch

        return torch.frombuffer(self._core.slot(i), dtype=torch.uint8)

    def address(self, i: int) -> int:
        """Address of slot ``i``'s first byte (page-aligned), for the I/O engine."""
        return self._core.address(i)

    def buffers(self) -> list[tuple[int, int]]:
        """``[(address, nbytes)]`` per slot, for ``IOEngine.register_buffers`` (io_uring fixed buffers)."""
        return [(self._core.address(i), self._core.slot_bytes) for i in range(self._core.slots)]

    # -- the pool --------------------------------------------------------------------------------------

    def try_acquire(self, *, timeout: float = 0.0) -> int | None:
        """A free slot's index, waiting at most ``timeout`` seconds; ``None`` if none came free."""
        i = self._core.acquire(max(0.0, float(timeout)))
        return None if i < 0 else i

    def acquire(self, *, timeout: float | None = None) -> int:
        """A free slot's index, blocking until one is released; ``TimeoutError`` after ``timeout`` seconds.

        ``timeout=None`` waits indefinitely (still interruptible by Ctrl-C and woken by :meth:`close`).
        """
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        while True:
            left = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - time.monotonic())
            i = self._core.acquire(max(0.0, left))
            if i >= 0:
                return i
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"Arena: no slot free after {timeout} s (all {self.slots} slots in use; "
                                   "release batches the consumer is done with)")

    def release(self, i: int) -> None:
        """Return slot ``i`` to the pool; ``ValueError`` if it is not acquired."""
        self._core.release(i)

    # -- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unpin and end the arena; idempotent. Memory is unmapped once no view of it is alive."""
        if self._core.closed:
            return
        if self._cudart is not None:
            err = self._cudart.cudaHostUnregister(self._core.address(0))
            self._cudart = None
            if int(getattr(err, "value", err)) != 0:
                log.warning("Arena: cudaHostUnregister failed with CUDA error %s", getattr(err, "value", err))
        self._core.close()
        log.debug("arena closed (%d views still alive)", self._core.live_views)

