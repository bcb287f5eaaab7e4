"""The CPU guard: when the node's CPU stays above a threshold, stop decoding and serve raw sample bytes.

A sampler thread reads ``psutil.cpu_percent`` every ``interval`` seconds and keeps the last ``window`` readings;
the guard engages when their mean is at or above ``threshold`` and releases when it falls ``hysteresis`` points
below, so one busy second neither flips it on nor one idle second off ("sustained", as in the paper's 80% rule).
``threshold=0`` engages it at once (always raw); ``threshold > 100`` never does.

Example::

    guard = CpuGuard(threshold=80.0)
    guard.start()
    if guard.engaged: ...            # serve raw bytes, marked raw; the client decodes with the same spec
    guard.stop()
"""
from __future__ import annotations

import threading
from collections import deque


class CpuGuard:
    """Sustained-CPU switch between decoded and raw serving; see the module docstring."""

    def __init__(self, threshold: float = 80.0, *, interval: float = 0.5, window: int = 4,
                 hysteresis: float = 10.0) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 (percent), got {threshold}")
        self.threshold = float(threshold)
        self.interval = float(interval)
        self.hysteresis = float(hysteresis)
        self._readings: deque[float] = deque(maxlen=max(1, int(window)))
        self._engaged = self.threshold <= 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.switches = 0

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
        import psutil

        psutil.cpu_percent(None)  # prime: the first call measures nothing

        def run() -> None:
            while not self._stop.wait(self.interval):
                self.observe(psutil.cpu_percent(None))

        self._thread = threading.Thread(target=run, name="foresight-cpu-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


__all__ = ["CpuGuard"]
