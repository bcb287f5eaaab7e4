"""A thread pool's queue that runs urgent steps' work first, else in the order submitted.

The bucket site (:mod:`foresight.replication.bucket_site`) sends parts and publishes through it, so an evaluation
made urgent (``Replication.urgent(step)``) overtakes the steps queued before it, as the node path's lane does.

Example::

    urgent: set[int] = set()
    q = UrgentFirst(ThreadPoolExecutor(4), urgent, on_error=lambda fn, e: log.error("%s failed: %s", fn, e))
    q.submit(10, send_part, 0)      # queued behind nothing
    urgent.add(20)
    q.submit(20, send_part, 0)      # runs before step 10's calls still queued
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["UrgentFirst"]


class UrgentFirst:
    """The work of one pool, urgent steps' first, else in the order submitted: each :meth:`submit` queues the call
    and one run on the pool, which takes the best call queued when it starts (so the order is decided when a
    thread frees up, and a step made urgent later still overtakes what is queued)."""

    def __init__(self, pool: ThreadPoolExecutor, urgent: set[int],
                 on_error: Callable[[Callable[..., Any], BaseException], None]) -> None:
        self.pool, self._urgent, self._on_error = pool, urgent, on_error
        self._queued: list[tuple[int, int, Callable[..., Any], tuple[Any, ...], Future]] = []
        self._seq = 0
        self._lock = threading.Lock()

    def submit(self, step: int, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            self._seq += 1
            self._queued.append((self._seq, step, fn, args, fut))
        self.pool.submit(self._run_one)
        return fut

    def _run_one(self) -> None:
        with self._lock:
            item = min(self._queued, key=lambda q: (q[1] not in self._urgent, q[0]))
            self._queued.remove(item)
        _, _, fn, args, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future, and logged, counted:
            self._on_error(fn, e)  # a publish's or an abort's future has nobody waiting on it
            fut.set_exception(e)
