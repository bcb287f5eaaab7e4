"""IO engines for steps a node prepares on its gRPC call threads (a step not yet in the job's queue).

gRPC's sync server starts and ends call threads as load comes and goes; an engine (an io_uring and its buffers)
per thread, kept until the node stops, grew with every thread that ever served a step. Call threads borrow an
engine here for one step instead: the node holds at most as many as were ever in use at once, and keeps up to
``keep`` idle ones for the next calls (a step's part owns its read region, so an engine is free once it returns).

Example::

    pool = EnginePool(lambda: IOEngine(queue_depth=64))
    with pool.borrow() as engine:
        part = job.prepare(step, engine, ...)
    pool.close()
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator


class EnginePool:
    """Engines lent to one thread at a time; see the module docstring."""

    def __init__(self, factory: Callable[[], Any], *, keep: int = 4) -> None:
        self._factory = factory
        self._keep = int(keep)
        self._idle: list = []
        self._lent = 0
        self._closed = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Any]:
        with self._lock:
            engine = self._idle.pop() if self._idle else None
            self._lent += 1
        try:
            if engine is None:
                engine = self._factory()
            yield engine
        finally:
            with self._lock:
                self._lent -= 1
                keep = engine is not None and not self._closed and len(self._idle) < self._keep
                if keep:
                    self._idle.append(engine)
            if engine is not None and not keep:
                _close(engine)

    @property
    def size(self) -> tuple[int, int]:
        """(engines lent now, engines idle)."""
        with self._lock:
            return self._lent, len(self._idle)

    def close(self) -> None:
        """Close the idle engines; those lent now are closed when they come back."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for engine in idle:
            _close(engine)


def _close(engine: Any) -> None:
    try:
        engine.close()
    except Exception:  # already closed: nothing more to free
        pass


__all__ = ["EnginePool"]
