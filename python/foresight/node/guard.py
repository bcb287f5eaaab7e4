"""The CPU guard: when the node's CPU stays above a threshold, stop decoding and serve raw sample bytes.

A sampler thread measures CPU every ``interval`` seconds and keeps the last ``window`` readings; the guard engages
when their mean is at or above ``threshold`` and releases when it falls ``hysteresis`` points below, so one busy
second neither flips it on nor one idle second off ("sustained", as in the paper's 80% rule). ``threshold=0``
engages it at once (always raw); ``threshold > 100`` never does.

What is measured (``measure``), each as a percent of the CPUs in that scope:

``process`` (default)  the node's process and all its descendants, over the CPUs it may run on
                       (``sched_getaffinity``): "my node is busy"; other work on the machine does not count.
``cgroup``             the node's cgroup (v2 ``cpu.stat``, else v1 ``cpuacct.usage``), over its CPU quota
                       (``cpu.max`` / CFS quota) or, without one, its CPUs: a container's or a systemd slice's load.
``machine``            every CPU of the machine (``psutil.cpu_percent``): a node that must yield to anything.

Example::

    guard = CpuGuard(threshold=80.0, measure="process")
    guard.start()
    if guard.engaged: ...            # serve raw bytes, marked raw; the client decodes with the same spec
    guard.stop()
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Callable

import psutil

from foresight.errors import NodeError

MEASURES = ("process", "cgroup", "machine")


class CpuGuard:
    """Sustained-CPU switch between decoded and raw serving; see the module docstring."""

    def __init__(self, threshold: float = 80.0, *, interval: float = 0.5, window: int = 4,
                 hysteresis: float = 10.0, measure: str = "process") -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 (percent), got {threshold}")
        if measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
        self.threshold = float(threshold)
        self.interval = float(interval)
        self.hysteresis = float(hysteresis)
        self.measure = measure
        self._readings: deque[float] = deque(maxlen=max(1, int(window)))
        self._engaged = self.threshold <= 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.switches = 0
        self.samples = 0  # readings taken by the sampler (tests wait on counts, not on time)

    @property
    def engaged(self) -> bool:
        return self._engaged

    @property
    def cpu_percent(self) -> float:
        """Mean CPU over the window (0 before the first reading)."""
        r = list(self._readings)
        return sum(r) / len(r) if r else 0.0

    def observe(self, percent: float) -> bool:
        """Feed one reading (the sampler does; tests may too); returns whether the guard is engaged."""
        self._readings.append(float(percent))
        mean = self.cpu_percent
        if self.threshold <= 0:
            engaged = True
        elif self._engaged:
            engaged = mean >= self.threshold - self.hysteresis
        else:
            engaged = len(self._readings) == self._readings.maxlen and mean >= self.threshold
        if engaged != self._engaged:
            self.switches += 1
            self._engaged = engaged
        return engaged

    def start(self) -> "CpuGuard":
        sample = sampler(self.measure)

        def run() -> None:
            while not self._stop.wait(self.interval):
                self.observe(sample())
                self.samples += 1

        self._thread = threading.Thread(target=run, name="foresight-cpu-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def sampler(measure: str) -> Callable[[], float]:
    """A function returning the CPU percent of ``measure`` since its previous call (primed here)."""
    if measure == "machine":
        psutil.cpu_percent(None)  # prime: the first call measures nothing
        return lambda: psutil.cpu_percent(None)
    used, cpus = (_process_tree_seconds, _affinity_cpus) if measure == "process" else _cgroup_usage()
    last = [time.monotonic(), used()]

    def sample() -> float:
        now, total = time.monotonic(), used()
        elapsed, busy = now - last[0], max(0.0, total - last[1])  # a child that exited takes its time along
        last[:] = [now, total]
        return min(100.0, 100.0 * busy / (elapsed * cpus())) if elapsed > 0 else 0.0

    return sample


def _affinity_cpus() -> float:
    return float(len(os.sched_getaffinity(0)))


def _process_tree_seconds() -> float:
    """CPU seconds of this process (all threads, reaped children) and of every live descendant."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:  # exited meanwhile
            pass
    return total


def _cgroup_usage() -> tuple[Callable[[], float], Callable[[], float]]:
    """(CPU seconds used by this process's cgroup, CPUs it may use) for cgroup v2, else v1 (cpuacct, cpu)."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    paths = {c: p for _, controllers, p in lines for c in (controllers.split(",") if controllers else [""])}
    if "" in paths:  # v2 (unified), mounted at /sys/fs/cgroup or, in a hybrid layout, /sys/fs/cgroup/unified
        for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
            base = mount + paths[""].rstrip("/")
            if _has_usage(base + "/cpu.stat"):
                return (lambda: _v2_usage(base + "/cpu.stat")), (lambda: _v2_cpus(base + "/cpu.max"))
    if "cpuacct" in paths:
        for mount in ("/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu,cpuacct"):
            usage = mount + paths["cpuacct"].rstrip("/") + "/cpuacct.usage"
            if os.path.exists(usage):
                cpu_dir = "/sys/fs/cgroup/cpu" + paths.get("cpu", paths["cpuacct"]).rstrip("/")
                return (lambda: _read_int(usage) / 1e9), (lambda: _v1_cpus(cpu_dir))
    raise NodeError("the CPU guard cannot measure this cgroup (neither cgroup v2 cpu.stat nor v1 cpuacct.usage "
                    "found); use --cpu-measure process or machine", path="/proc/self/cgroup")


def _has_usage(path: str) -> bool:
    try:
        with open(path) as f:
            return any(line.startswith("usage_usec ") for line in f)
    except OSError:
        return False


def _v2_usage(path: str) -> float:
    with open(path) as f:
        for line in f:
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    raise NodeError("cgroup cpu.stat lost its usage_usec line", path=path)


def _v2_cpus(path: str) -> float:
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return max(0.01, int(quota) / int(period))
    except (OSError, ValueError):  # the root cgroup has no cpu.max: no quota
        pass
    return _affinity_cpus()


def _v1_cpus(cpu_dir: str) -> float:
    try:
        quota, period = _read_int(cpu_dir + "/cpu.cfs_quota_us"), _read_int(cpu_dir + "/cpu.cfs_period_us")
        if quota > 0 and period > 0:
            return max(0.01, quota / period)
    except (OSError, ValueError):  # no cpu controller mounted: no quota
        pass
    return _affinity_cpus()


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


__all__ = ["CpuGuard", "MEASURES", "sampler"]
