"""What ``Checkpointer.save`` returns: one save's progress, timings and background failure.

The writer thread sets a handle "local" once the step is committed on the fastest tier, the drain thread sets it
"durable" once every slower tier holds it; a failure on either thread is kept on the handle and re-raised by
``wait()`` (or by the Checkpointer's next ``save()``/``close()``), never dropped.

Example::

    h = ckpt.save(model.state_dict(), step)
    h.wait(durable=False)      # committed locally; h.path is the step directory
    print(h.timings)           # {"snapshot": ..., "write": ..., "commit": ...}
"""
from __future__ import annotations

import threading
from typing import Any

from foresight.errors import CheckpointError


class SaveHandle:
    """Tracks one save. ``wait()`` blocks until it is committed (and drained, with ``durable=True``)."""

    def __init__(self, step: int, owner: Any) -> None:
        self.step = step
        self.path: str | None = None  # the committed directory on the fastest tier
        # seconds spent in each phase: "snapshot" (caller's thread), "write" (data file written and
        # fsynced), "commit" (index, marker, rename); filled in as the phases finish
        self.timings: dict[str, float] = {}
        self.nbytes = 0  # bytes of the data file
        self._owner = owner  # the Checkpointer: a reported failure is forgotten there
        self._local = threading.Event()
        self._durable = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._drain_tiers: set[int] | None = None  # slower tiers to copy to (None: all)

    def done(self, *, durable: bool = True) -> bool:
        """True once written and committed (to every tier when ``durable``), or failed."""
        return (self._durable if durable else self._local).is_set()

    def wait(self, *, durable: bool = True, timeout: float | None = None) -> SaveHandle:
        """Block until done; re-raise a background failure as :class:`CheckpointError`."""
        if not (self._durable if durable else self._local).wait(timeout):
            raise CheckpointError("timed out waiting for checkpoint", step=self.step, timeout=timeout)
        self._raise()
        return self

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._local.set()
        self._durable.set()

    def _raise(self) -> None:
        if self._error is not None:
            self._reported = True
            self._owner._forget(self)
            err = self._error
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"background checkpoint write failed: {err}", step=self.step) from err
