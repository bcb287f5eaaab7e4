"""The node's per-job queues and scheduler: lead window, byte cap (backpressure), fairness between jobs, and take()
semantics (ready, in preparation, or prepared by the caller; older steps dropped)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from foresight.node.queue import Scheduler
from node_helpers import wait_for


def _job(name, *, lead=2, queue_bytes=1 << 30, steps=100):
    return SimpleNamespace(job=name, lead=lead, queue_bytes=queue_bytes, plan=SimpleNamespace(num_steps=steps))


class Recorder:
    """A produce function that records its calls; ``gate`` holds workers until a test opens it."""

    def __init__(self, nbytes=10, gate=None):
        self.calls, self.nbytes, self.gate = [], nbytes, gate
        self.lock = threading.Lock()

    def __call__(self, job, step, engine):
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            self.calls.append((job.job, step))
        return SimpleNamespace(step=step, nbytes=self.nbytes)


def _idle(sched, *queues):
    with sched.cond:
        return all(not q.producing and q.next_wanted() is None for q in queues)


def test_queue_fills_its_lead_window_and_no_more():
    rec = Recorder()
    sched = Scheduler(rec, workers=1)
    try:
        q = sched.add(_job("a", lead=3))
        wait_for(lambda: _idle(sched, q), what="queue full")
        assert sorted(q.ready) == [0, 1, 2] and q.lead() == 3
        part = q.take(0, produce=lambda s: None)
        assert part.step == 0
        wait_for(lambda: _idle(sched, q), what="queue refilled")
        assert sorted(q.ready) == [1, 2, 3]
    finally:
        sched.close()


def test_byte_cap_is_backpressure_but_one_part_always_fits():
    rec = Recorder(nbytes=100)
    sched = Scheduler(rec, workers=1)
    try:
        q = sched.add(_job("a", lead=8, queue_bytes=250))
        wait_for(lambda: _idle(sched, q), what="queue at its cap")
        assert sorted(q.ready) == [0, 1, 2] and q.nbytes == 300  # stops once at or over the cap
        big = sched.add(_job("big", lead=8, queue_bytes=10))
        wait_for(lambda: _idle(sched, big), what="big queue")
        assert sorted(big.ready) == [0]  # larger than its cap, yet the step moves
    finally:
        sched.close()


def test_one_worker_alternates_between_jobs():
    gate = threading.Event()
    rec = Recorder(gate=gate)
    sched = Scheduler(rec, workers=1)
    try:
        a = sched.add(_job("a", lead=3))
        b = sched.add(_job("b", lead=3))
        gate.set()
        wait_for(lambda: _idle(sched, a, b), what="both queues full")
        # a's step 0 was picked before b existed; from then on the job with fewer steps ready goes next
        assert [j for j, _ in rec.calls] == ["a", "b"] * 3
        assert sorted(s for j, s in rec.calls if j == "a") == [0, 1, 2] == sorted(s for j, s in rec.calls if j == "b")
    finally:
        sched.close()


def test_take_prepares_missing_steps_itself_and_drops_older_ones():
    gate = threading.Event()  # workers blocked: nothing is prepared ahead
    rec = Recorder(gate=gate)
    sched = Scheduler(rec, workers=1)
    try:
        q = sched.add(_job("a", lead=2))
        wait_for(lambda: q.producing, what="a worker to claim step 0")
        part = q.take(5, produce=lambda s: SimpleNamespace(step=s, nbytes=1))
        assert part.step == 5 and q.progress == 5
        gate.set()
        wait_for(lambda: _idle(sched, q), what="queue refilled after the jump")
        assert sorted(q.ready) == [6, 7]  # step 0, prepared for nobody, was dropped
        assert q.nbytes == 20
    finally:
        sched.close()


def test_removed_job_gets_no_more_work():
    rec = Recorder()
    sched = Scheduler(rec, workers=1)
    try:
        q = sched.add(_job("a", lead=2))
        wait_for(lambda: _idle(sched, q), what="queue full")
        sched.remove("a")
        n = len(rec.calls)
        sched.add(_job("b", lead=1))
        wait_for(lambda: any(j == "b" for j, _ in rec.calls), what="b served")
        assert all(j == "b" for j, _ in rec.calls[n:]) and q.closed and not q.ready
    finally:
        sched.close()
