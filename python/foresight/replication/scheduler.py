"""The priority lane: which transfer's next unit goes on the wire.

Each transfer carries a priority derived from what the job knows (:func:`priority_of`: model size, job
importance, anomaly severity). The lane always dispatches the unit of the transfer with the highest
*effective* priority = its priority + credit, where every waiting transfer gains ``aging`` credit each time
another transfer's unit is dispatched, and loses its credit when served. So an urgent evaluation's units
overtake bulk replication already in progress (at unit granularity), and bulk is never starved: after
about ``(urgent - bulk) / aging`` dispatches it gets a unit. Ties go to the older transfer (FIFO).
Aging counts dispatches, not seconds, so the order is deterministic.

Example::

    lane = PriorityLane()
    lane.add("bulk", units=[0, 1, 2], priority=priority_of(model_bytes=7 << 30))
    lane.add("urgent", units=[0, 1], priority=priority_of(model_bytes=7 << 30, severity=1.0))
    lane.pop()  # ("urgent", 0)
"""
from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

URGENT_BOOST = 100.0  # severity 1.0 multiplies the priority by 101: urgent lands far above any bulk transfer
DEFAULT_AGING = 1.0


def priority_of(*, model_bytes: int = 0, importance: float = 1.0, severity: float = 0.0) -> float:
    """Priority of a replication: bigger models and more important jobs first; an anomaly (severity in
    (0, 1], e.g. a loss spike's size) makes it urgent.

    >>> priority_of(model_bytes=0) < priority_of(model_bytes=70 << 30) < priority_of(severity=0.5)
    True
    """
    if importance <= 0 or not 0.0 <= severity <= 1.0 or model_bytes < 0:
        raise ValueError(f"need importance > 0, 0 <= severity <= 1, model_bytes >= 0; got "
                         f"{importance}, {severity}, {model_bytes}")
    size_term = 1.0 + math.log2(1.0 + model_bytes / 2**30) / 10.0  # 1.0 for tiny, ~2 for 1 TiB
    return importance * size_term * (1.0 + URGENT_BOOST * severity)


@dataclass
class _Entry:
    key: Hashable
    priority: float
    seq: int
    units: deque = field(default_factory=deque)
    credit: float = 0.0


class PriorityLane:
    """Thread-safe lane of transfers; ``pop`` blocks until a unit may go (or the lane is closed).
    ``fifo=True`` ignores priorities (transfers go in arrival order): the baseline a plain network queue gives."""

    def __init__(self, aging: float = DEFAULT_AGING, *, fifo: bool = False) -> None:
        if aging <= 0:
            raise ValueError("aging must be > 0 (bulk would starve)")
        self.aging = aging
        self.fifo = fifo
        self._entries: dict[Hashable, _Entry] = {}
        self._seq = 0
        self._cv = threading.Condition()
        self._closed = False
        self._budget: int | None = None  # units that may still go (None: no limit; 0: paused)

    def set_budget(self, units: int | None) -> None:
        """Let exactly ``units`` more units go, then hold the rest (0 pauses; None lifts the limit)."""
        with self._cv:
            self._budget = units
            self._cv.notify_all()

    def add(self, key: Hashable, units: Iterable[Any], priority: float) -> None:
        """Queue ``units`` of transfer ``key`` (appended if the transfer is already queued)."""
        with self._cv:
            e = self._entries.get(key)
            if e is None:
                self._seq += 1
                e = self._entries[key] = _Entry(key, float(priority), self._seq)
            e.units.extend(units)
            self._cv.notify_all()

    def reprioritize(self, key: Hashable, priority: float) -> None:
        """Change a queued transfer's priority (an evaluation turned urgent while its replica was in flight)."""
        with self._cv:
            if key in self._entries:
                self._entries[key].priority = float(priority)
                self._cv.notify_all()

    def remove(self, key: Hashable) -> None:
        with self._cv:
            self._entries.pop(key, None)

    def pending(self, key: Hashable) -> int:
        with self._cv:
            e = self._entries.get(key)
            return len(e.units) if e else 0

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def take(self, key: Hashable, n: int, *, max_bytes: int | None = None) -> list[Any]:
        """Up to ``n`` more units of transfer ``key`` at once, within the budget (a sender's window: they share
        one acknowledgement); ``max_bytes``: only while their ``length`` adds up to at most that. Counts as part
        of the dispatch that popped the window's first unit."""
        with self._cv:
            e = self._entries.get(key)
            if e is None or n <= 0:
                return []
            n = min(n, len(e.units), n if self._budget is None else self._budget)
            if max_bytes is not None:
                k, total = 0, 0
                while k < n and total + e.units[k].length <= max_bytes:
                    total += e.units[k].length
                    k += 1
                n = k
            if self._budget is not None:
                self._budget -= n
            out = [e.units.popleft() for _ in range(n)]
            if not e.units:
                del self._entries[key]
            return out

    def pop(self, timeout: float | None = None) -> tuple[Hashable, Any] | None:
        """The next ``(key, unit)`` by effective priority; ``None`` when closed or on timeout."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                ready = [e for e in self._entries.values() if e.units] if self._budget != 0 else []
                if ready:
                    break
                if not self._cv.wait(timeout):
                    return None
            best = min(ready, key=lambda e: e.seq) if self.fifo else \
                max(ready, key=lambda e: (e.priority + e.credit, -e.seq))
            for e in ready:
                e.credit = 0.0 if e is best else e.credit + self.aging
            if self._budget is not None:
                self._budget -= 1
            unit = best.units.popleft()  # (take() may add the rest of a window)
            if not best.units:
                del self._entries[best.key]
            return best.key, unit
