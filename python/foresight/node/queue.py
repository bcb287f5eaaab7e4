"""Per-job consumer queues and the scheduler that fills them fairly.

Each job's queue holds the parts of steps ``progress+1 .. progress+lead`` once prepared, bounded by the job's
``queue_bytes`` (backpressure: a job whose queue is full gets no more work until its client takes a step; one
part is always allowed so a step larger than the cap still moves). Worker threads pick work round-robin by lead:
the job with the fewest steps ready (ties: the one served longest ago), so one greedy job cannot starve another.
A ``take`` for a step that is neither ready nor being prepared prepares it on the caller's thread; a step being
prepared is waited for; steps older than the one taken are dropped (the client moved on without them).

Example::

    sched = Scheduler(produce=lambda job, step, engine: job.prepare(step, engine, raw=False, ...), workers=1)
    q = sched.add(job)
    part = q.take(step=5, engine=engine)          # the part of step 5 (waits or prepares it)
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from foresight.errors import NodeError

log = logging.getLogger("foresight.node.queue")


class JobQueue:
    def __init__(self, job: Any, cond: threading.Condition) -> None:
        self.job = job
        self.cond = cond
        self.progress = -1  # the last step the job consumed
        self.ready: dict[int, Any] = {}
        self.producing: set[int] = set()
        self.failed: dict[int, BaseException] = {}
        self.nbytes = 0
        self.last_served = 0.0
        self.closed = False

    @property
    def num_steps(self) -> int:
        return self.job.plan.num_steps

    def next_wanted(self) -> int | None:
        """The first step of the lead window neither ready nor being prepared, if the queue may take more."""
        if self.closed or (self.ready and self.nbytes >= self.job.queue_bytes):
            return None
        for s in range(self.progress + 1, min(self.progress + self.job.lead, self.num_steps - 1) + 1):
            if s not in self.ready and s not in self.producing and s not in self.failed:
                return s
        return None

    def lead(self) -> int:
        """Consecutive steps ready (or in preparation) right after the job's progress."""
        s = self.progress + 1
        while s in self.ready or s in self.producing:
            s += 1
        return s - self.progress - 1

    def set_progress(self, step: int) -> None:
        """The job consumed ``step``: drop parts it can no longer ask for (caller holds the lock)."""
        if step <= self.progress:
            return
        self.progress = step
        for s in [s for s in self.ready if s <= step]:
            self.nbytes -= self.ready.pop(s).nbytes
        for s in [s for s in self.failed if s <= step]:
            del self.failed[s]
        self.cond.notify_all()

    def take(self, step: int, produce: Callable[[int], Any], *, timeout: float = 120.0):
        """The part of ``step``: from the queue, from a worker preparing it, or prepared here."""
        with self.cond:
            self.set_progress(step - 1)
            deadline = time.monotonic() + timeout
            while step in self.producing:
                if self.closed:
                    raise NodeError("job was unregistered", job=self.job.job)
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise NodeError("step not prepared in time", job=self.job.job, step=step)
            part = self.ready.pop(step, None)
            if part is not None:
                self.nbytes -= part.nbytes
            else:
                self.failed.pop(step, None)  # retry a failed step here, so its error reaches the client
                self.producing.add(step)
        if part is None:
            try:
                part = produce(step)
            finally:
                with self.cond:
                    self.producing.discard(step)
                    self.cond.notify_all()
        with self.cond:
            self.last_served = time.monotonic()
            self.set_progress(step)
        return part


class Scheduler:
    """Worker threads that prepare the steps every job will want next; see the module docstring."""

    def __init__(self, produce: Callable[[Any, int, Any], Any], *, workers: int = 1,
                 engine_factory: Callable[[], Any] | None = None,
                 on_change: Callable[[JobQueue], None] | None = None) -> None:
        self.produce = produce
        self.cond = threading.Condition()
        self.queues: dict[str, JobQueue] = {}
        self._stop = False
        self._on_change = on_change or (lambda q: None)
        self._engine_factory = engine_factory
        self._threads = [threading.Thread(target=self._work, name=f"foresight-node-worker-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def add(self, job: Any) -> JobQueue:
        with self.cond:
            q = JobQueue(job, self.cond)
            self.queues[job.job] = q
            self.cond.notify_all()
            return q

    def remove(self, job_id: str) -> JobQueue | None:
        with self.cond:
            q = self.queues.pop(job_id, None)
            if q is not None:
                q.closed = True
                q.ready.clear()
                q.nbytes = 0
            self.cond.notify_all()
            return q

    def _pick(self) -> tuple[JobQueue, int] | None:
        best = None
        for q in self.queues.values():
            s = q.next_wanted()
            if s is None:
                continue
            key = (q.lead(), q.last_served)
            if best is None or key < best[0]:
                best = (key, q, s)
        return None if best is None else (best[1], best[2])

    def _work(self) -> None:
        engine = self._engine_factory() if self._engine_factory else None
        try:
            while True:
                with self.cond:
                    while not self._stop and (pick := self._pick()) is None:
                        self.cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    q, step = pick
                    q.producing.add(step)
                try:
                    part, error = self.produce(q.job, step, engine), None
                except BaseException as e:  # kept for the client's take(), which retries and reports it
                    part, error = None, e
                    log.warning("preparing a step failed", extra={"job": q.job.job, "step": step, "error": str(e)})
                with self.cond:
                    q.producing.discard(step)
                    if not q.closed and step > q.progress:
                        if error is not None:
                            q.failed[step] = error
                        else:
                            q.ready[step] = part
                            q.nbytes += part.nbytes
                    self.cond.notify_all()
                self._on_change(q)
        finally:
            if engine is not None:
                engine.close()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=30)


__all__ = ["JobQueue", "Scheduler"]
