"""A per-node service limit: token buckets on bytes and on requests, so one node serves a bounded load.

A real disk or NIC serves a bounded number of requests and bytes per second; a storage node on a fast test
machine does not. :class:`ServiceLimit` makes it so: every read first takes one request token, then one byte
token per byte it sends. Each bucket hands out *reservations* in arrival order (virtual time: the caller sleeps
until its turn), so waiting is FIFO, needs no polling thread, and a burst of ``burst_s`` seconds' worth of tokens
may pass at once after idle time.

A *priority* reservation (a node pulling a hinted copy) does not queue behind the readers: it waits only for its own
tokens, and pushes the queue back by them, so the copy lands while a restart's reads are in flight and its bytes are
still paid for (the readers already sleeping keep their slots: the node runs over its rate by one priority chunk at
most, taken back from the readers that come after).

Example::

    limit = ServiceLimit.parse("32M:400")      # 32 MiB/s and 400 requests/s; "0" or None: unlimited
    limit.request()                            # blocks until the request may start
    limit.consume(len(chunk))                  # blocks until these bytes may go out
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from foresight.errors import ProtocolError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_amounts(text: str | None, what: str = "limit") -> tuple[float, float]:
    """``"BYTES[K|M|G][:COUNT]"`` -> (bytes, count); missing parts are 0 (``"32M"``, ``":400"``, ``None``)."""
    if not text or text.strip() == "0":
        return 0.0, 0.0
    b, _, r = text.strip().partition(":")
    try:
        b = b.strip().upper().removesuffix("B").removesuffix("I")  # 32MiB, 32MB and 32M alike
        unit = b[-1] if b and b[-1] in _UNITS else ""
        nbytes = float(b[: len(b) - len(unit)]) * _UNITS[unit] if b else 0.0
        count = float(r) if r.strip() else 0.0
    except ValueError:
        raise ProtocolError(f"{what} must look like 32M:400 (bytes[:count])", value=text) from None
    if nbytes < 0 or count < 0:
        raise ProtocolError(f"{what} must not be negative", value=text)
    return nbytes, count


class TokenBucket:
    """Tokens at ``rate`` per second with a burst of ``rate * burst_s``; ``take(n)`` sleeps until they are due.

    Example::

        bucket = TokenBucket(100.0, burst_s=0.0)
        bucket.reserve(100), bucket.reserve(100)   # (1.0, 2.0): one second of tokens each, in arrival order
    """

    def __init__(self, rate: float, *, burst_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ProtocolError(f"token bucket rate {rate!r} must be > 0")
        self.rate, self.burst_s = float(rate), float(burst_s)
        self._clock = clock  # seconds; injectable so the arithmetic is checked on a clock the caller controls
        self._next = 0.0  # theoretical arrival time (GCRA): when every token reserved so far is due
        self._lock = threading.Lock()
        self.waited_s = 0.0  # total time callers slept (how much the limit bit)

    def reserve(self, n: float, *, priority: bool = False) -> float:
        """Reserve ``n`` tokens; the seconds to wait before using them (0 when the burst covers them). With
        ``priority`` the wait is for these tokens alone, ahead of the queue, which moves back by them."""
        now = self._clock()
        with self._lock:
            self._next = max(self._next, now) + n / self.rate
            due = now + n / self.rate if priority else self._next
            delay = max(0.0, due - self.burst_s - now)
            self.waited_s += delay
        return delay

    def take(self, n: float, *, priority: bool = False) -> None:
        delay = self.reserve(n, priority=priority)
        if delay > 0:
            time.sleep(delay)


class ServiceLimit:
    """Bytes per second and requests per second a node serves (either may be None: unlimited)."""

    def __init__(self, bytes_per_s: float | None = None, requests_per_s: float | None = None) -> None:
        self.bytes_per_s, self.requests_per_s = bytes_per_s, requests_per_s
        self._bytes = TokenBucket(bytes_per_s) if bytes_per_s else None
        self._requests = TokenBucket(requests_per_s, burst_s=1.0 / requests_per_s) if requests_per_s else None

    @classmethod
    def parse(cls, text: str | None) -> "ServiceLimit":
        """``"BYTES[K|M|G]:REQUESTS"`` per second, e.g. ``"32M:400"``; ``"32M"`` limits bytes only; ``":400"``
        requests only; ``None``, ``""`` or ``"0"``: unlimited."""
        nbytes, nreq = parse_amounts(text, "service limit")
        return cls(nbytes or None, nreq or None)

    @property
    def limited(self) -> bool:
        return self._bytes is not None or self._requests is not None

    def request(self, *, priority: bool = False) -> None:
        if self._requests is not None:
            self._requests.take(1, priority=priority)

    def consume(self, nbytes: int, *, priority: bool = False) -> None:
        if self._bytes is not None and nbytes:
            self._bytes.take(nbytes, priority=priority)

    def describe(self) -> dict:
        return {"bytes_per_s": self.bytes_per_s, "requests_per_s": self.requests_per_s,
                "waited_s": sum(b.waited_s for b in (self._bytes, self._requests) if b is not None)}


__all__ = ["ServiceLimit", "TokenBucket", "parse_amounts"]
