"""bench/object_store_cpu.py's per-thread CPU: every thread of the run counts, from the scheduler's own count.

The tick-sampled utime/stime of /proc/<pid>/task/<tid>/stat left over half of a media epoch's CPU out of the sum over
its ~70 threads, and a thread that ended before the last batch (the prefetcher's) was not counted at all."""
from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import object_store_cpu as oc  # noqa: E402


def _burn(cpu_s: float, burned: threading.Semaphore | None = None, done: threading.Event | None = None) -> None:
    """Busy for ``cpu_s`` of this thread's own CPU (a loop, not a sleep), then say so and wait for ``done``."""
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        sum(range(1000))
    if burned is not None:
        burned.release()
        done.wait()


def test_threads_cpu_matches_the_process_cpu_across_many_short_busy_threads():
    burned, release = threading.Semaphore(0), threading.Event()
    before, t0 = oc.threads_cpu(), os.times()
    threads = [threading.Thread(target=_burn, args=(0.004, burned, release), name=f"burner-{i}") for i in range(40)]
    for t in threads:
        t.start()
    for _ in threads:  # every thread has burned its share and is still alive
        burned.acquire()
    after, t1 = oc.threads_cpu(), os.times()
    release.set()
    for t in threads:
        t.join()
    process = (t1.user + t1.system) - (t0.user + t0.system)
    assert {after[t.native_id][0] for t in threads} == {t.name for t in threads}  # Python's names
    # each burner used at least 4 ms of its own CPU (time.thread_time): counted by the scheduler's count, not by
    # ticks (10 ms each: most 4 ms threads showed none). The burners alone, not the process: other threads of the
    # test process (left by earlier tests) may end inside the window, counted by the process and by no thread
    burners = sum(after[t.native_id][1] - before.get(t.native_id, ("", 0.0))[1] for t in threads)
    assert burners >= 0.9 * len(threads) * 0.004, (burners, process)


def test_the_sampler_counts_a_thread_that_ended_before_the_run_did():
    with oc.ThreadSampler() as sampler:
        t = threading.Thread(target=_burn, args=(3 * oc.SAMPLE_S,), name="foresight-bucket-prefetch")
        t.start()
        t.join()
        tid = t.native_id
    # joined, the thread may still show in /proc/self/task for a moment (the kernel releases it after the join's
    # wake-up): wait for it to go, so the figure below can only come from the sampler's samples while it ran
    for _ in range(2000):
        if tid not in oc.threads_cpu():
            break
        time.sleep(0.005)
    else:
        raise AssertionError(f"thread {tid} never left /proc/self/task after its join")
    name, cpu = sampler.seen[tid]
    assert name == "foresight-bucket-prefetch" and cpu > 0
