"""Claims on a cache's samples: what a fetcher of this process (a :class:`~foresight.bucket.prefetch.PlanPrefetcher`)
is fetching or is about to fetch, so a lookup of those samples waits for it instead of fetching them itself.

Without claims a loader's lookup that overtook the prefetcher (reached a step whose group the prefetcher had
planned but not yet sent) fetched that step itself: on a media plan, whose step reads a few large samples from as
many objects, one GET per sample, and the prefetcher's block fill then fetched the same bytes again. With them, a
lookup splits its absent samples: the claimed ones it waits for (while GETs keep landing: this process's, or, for an
owner waiting on the samples' locks, another process's sharing the cache, seen as the index's marks change; a wait
that sees no GET land for ``wait_s`` raises a :class:`~foresight.errors.BucketError` naming the sample), the rest it
fetches. A lookup that waits marks the claim ``wanted``, which tells its owner to start at once (a prefetcher holding back
for its window goes on), so a wait never depends on the consumer moving. A released claim (its owner closed or
failed) lets its waiters fetch for themselves.

Example::

    claim = cache.claim(on_wanted=wake_me, wait_s=90.0)
    claim.set(step_ids)                      # a lookup of these (absent) samples waits from now on
    cache.ensure(step_ids, claim=claim)      # an owner's fetch waits on no claim (two owners never wait on each other)
    claim.release()
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from foresight.errors import BucketError

__all__ = ["FetchClaim", "Claims"]


class FetchClaim:
    """One owner's claimed samples (sorted, unique); made by :meth:`Claims.claim`, changed with :meth:`set`."""

    def __init__(self, claims: "Claims", on_wanted: Callable[[], None], wait_s: float) -> None:
        self._claims = claims
        self.on_wanted = on_wanted
        self.wait_s = float(wait_s)
        self.ids = np.zeros(0, dtype=np.int64)
        self.wanted = False  # a lookup waits on one of ``ids``: the owner should fetch now

    def set(self, ids: np.ndarray) -> None:
        """Claim exactly ``ids`` (replacing the last set at once: a sample in both stays claimed throughout)."""
        self._claims.update(self, np.unique(np.asarray(ids, dtype=np.int64)))

    def release(self) -> None:
        """Claim nothing: waiters on the claimed samples fetch them themselves."""
        self.set(np.zeros(0, dtype=np.int64))


class Claims:
    """The claims on one cache. ``cv`` is the cache's condition (notified whenever a GET lands); ``present()``
    returns its index; ``name_of(sample)`` names the object a timed-out sample lives in."""

    def __init__(self, cv: threading.Condition, present: Callable[[], np.ndarray],
                 name_of: Callable[[int], str]) -> None:
        self._cv = cv
        self._present = present
        self._name_of = name_of
        self._claims: list[FetchClaim] = []
        self.landed = 0  # GETs landed so far (bumped by the cache under ``cv``): a waiter's sign of progress

    def claim(self, on_wanted: Callable[[], None], wait_s: float) -> FetchClaim:
        claim = FetchClaim(self, on_wanted, wait_s)
        with self._cv:
            self._claims.append(claim)
        return claim

    def update(self, claim: FetchClaim, ids: np.ndarray) -> None:
        with self._cv:
            claim.ids, claim.wanted = ids, False
            if not ids.size and claim in self._claims:
                self._claims.remove(claim)
            elif ids.size and claim not in self._claims:
                self._claims.append(claim)
            self._cv.notify_all()

    def holds(self, missing: np.ndarray) -> bool:
        """Whether a claim holds one of ``missing`` (sorted, unique, absent); the caller holds ``cv``."""
        return any(np.isin(missing, claim.ids, assume_unique=True).any() for claim in self._claims)

    def wait(self, missing: np.ndarray, on_wait: Callable[[int], None]) -> np.ndarray:
        """Wait until no absent sample of ``missing`` (sorted, unique) is claimed; returns which of ``missing`` are
        still absent (a mask). ``on_wait(n)`` is told once, as the wait begins, how many samples it waits for.
        Raises when no GET lands for ``wait_s``."""
        keep = np.ones(missing.size, dtype=bool)
        waited = False
        seen, deadline = -1, 0.0
        marks = -1  # samples marked in the shared index: another process's GETs landing show there
        while True:
            wake: list[FetchClaim] = []
            with self._cv:
                keep &= self._present()[missing] == 0
                held = np.zeros(missing.size, dtype=bool)
                wait_s = 0.0
                for claim in self._claims:  # one claim per prefetcher of the cache: a few, not one per sample
                    hit = keep & np.isin(missing, claim.ids, assume_unique=True)
                    if hit.any():
                        held |= hit
                        wait_s = max(wait_s, claim.wait_s)
                        if not claim.wanted:
                            claim.wanted = True
                            wake.append(claim)
                if not held.any():
                    return keep
                if not waited:
                    on_wait(int(held.sum()))
                    waited = True
                    marks = int(np.count_nonzero(self._present()))
                if not wake:
                    now = time.monotonic()
                    if self.landed != seen:  # a GET landed: the owner is fetching, the wait starts again
                        seen, deadline = self.landed, now + wait_s
                    if now >= deadline:  # the owner may wait on another process sharing the cache that fetches
                        now_marks = int(np.count_nonzero(self._present()))  # these: its GETs mark samples
                        if now_marks != marks:
                            marks, deadline = now_marks, now + wait_s
                    if now >= deadline:
                        first = int(missing[held][0])
                        raise BucketError(f"sample {first}: waited {wait_s:g} s for the prefetcher fetching it "
                                          f"({int(held.sum())} samples) and no GET landed meanwhile", "unavailable",
                                          object=self._name_of(first))
                    self._cv.wait(deadline - now)
                    continue
            for claim in wake:  # outside the cache's lock: the owner takes its own to hear it
                claim.on_wanted()
