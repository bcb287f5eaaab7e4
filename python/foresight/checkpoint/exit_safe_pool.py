"""A minimal daemon thread pool that keeps working during interpreter shutdown.

``concurrent.futures`` refuses new work once shutdown begins, but a checkpoint queued just before exit
must still be written by the ``atexit`` hook; this pool has no such cut-off.

Example::

    pool = ExitSafePool(2, "hash")
    fut = pool.submit(fn, arg)
    fut.result()
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ExitSafePool:
    """``threads`` daemon threads named ``foresight-ckpt-<name>-<i>`` running submitted calls in order."""

    def __init__(self, threads: int, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"foresight-ckpt-{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._q.put(None)
