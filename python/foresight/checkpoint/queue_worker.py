"""One daemon thread that handles queued items in order: the Checkpointer's writer and its tier drain.

Example::

    worker = QueueWorker(write_one, "foresight-ckpt-writer")
    worker.put(job)          # handled on the thread, in the order put
    worker.join()            # every queued item handled
    worker.stop()            # after the queued items, the thread ends
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class QueueWorker:
    """Calls ``handle(item)`` on its own thread for each item put, in order; ``handle`` deals with its own errors
    (an exception escaping it ends the thread)."""

    def __init__(self, handle: Callable[[Any], None], name: str) -> None:
        self._handle = handle
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def join(self) -> None:
        """Wait until every queued item is handled."""
        self._q.join()

    def stop(self) -> None:
        """End the thread after the queued items."""
        self._q.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                self._handle(item)
            finally:
                self._q.task_done()
