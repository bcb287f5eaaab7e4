"""The plan's future as a cache policy: which samples each step uses, when each is next used, and replays of a
byte-budgeted cache under three policies to compare hit rates.

- ``"lru"``: evict the least recently used sample (what a cache that does not know the future does);
- ``"window"``: foresight's runtime policy: evict the sample whose next use is furthest, seeing only the next
  ``window`` steps (a sample not used within them counts as never used again; ties go least recently used);
- ``"optimum"``: furthest next use over the whole plan, computed offline (Belady's MIN). With a window that covers
  the plan, ``"window"`` is exactly this.

A step's accesses are its distinct samples; an access is a hit when the sample is cached before the step (from
an earlier step's fetch), else a miss (fetched for this step, then cached). Samples of the current step are never
evicted while it is served (the loader reads them). Variable sizes make furthest-next-use a heuristic rather than
the proven optimum; it is the standard reference figure.

Example::

    acc = plan_accesses(plan, dataset=0)                      # distinct samples per step, for rank 0 of 1
    sizes = ds.sample_bytes()
    for policy in ("lru", "window", "optimum"):
        print(policy, replay(acc, sizes, budget_bytes=sizes.sum() // 10, policy=policy, window=8).hit_rate)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Accesses", "plan_accesses", "NextUse", "eviction_order", "replay", "ReplayResult", "compare_policies",
           "NEVER"]

NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Accesses:
    """Distinct samples per step: step ``k`` (global step ``steps[k]``) uses ``ids[ptr[k]:ptr[k + 1]]``."""

    steps: np.ndarray  # int64, global step numbers in visiting order
    ptr: np.ndarray  # int64, len(steps) + 1
    ids: np.ndarray  # int64 sample ids (sorted within a step)

    def of(self, k: int) -> np.ndarray:
        return self.ids[self.ptr[k]:self.ptr[k + 1]]

    def __len__(self) -> int:
        return len(self.steps)


def plan_accesses(plan: Any, dataset: int = 0, *, rank: int = 0, world_size: int = 1, start_step: int = 0,
                  end_step: int | None = None, step_stride: int = 1, keep: np.ndarray | None = None) -> Accesses:
    """The distinct samples of dataset ``dataset`` that each of this rank's steps uses, in the loader's order
    (the same ``start_step``/``end_step``/``step_stride`` as :class:`~foresight.loader.Loader`). ``keep`` (bool per
    sample of the dataset): only those samples count (a storage node's: the shards it serves, the modalities it
    decodes)."""
    end = plan.num_steps if end_step is None else min(int(end_step), plan.num_steps)
    steps = np.arange(int(start_step), end, int(step_stride), dtype=np.int64)
    parts, counts = [], []
    for step in steps.tolist():  # one plan slice per step (a mmapped O(1) lookup), never a loop over samples
        start, stop = plan.rank_items(step, rank, world_size)
        pieces = plan.pieces(start, stop)
        sample = np.asarray(pieces.sample, dtype=np.int64)[np.asarray(pieces.dataset) == dataset]
        if keep is not None:
            sample = sample[keep[sample]]
        ids = np.unique(sample)
        parts.append(ids)
        counts.append(ids.size)
    ptr = np.zeros(len(steps) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return Accesses(steps, ptr, ids)


class NextUse:
    """For any sample and position ``k`` (an index into the access steps): the first position ``>= k`` that uses
    it, vectorized (one sorted key array and a searchsorted)."""

    def __init__(self, acc: Accesses) -> None:
        pos = np.repeat(np.arange(len(acc), dtype=np.int64), np.diff(acc.ptr))
        self._span = len(acc) + 1
        self._keys = np.sort(acc.ids * self._span + pos)

    def after(self, ids: np.ndarray, k: int) -> np.ndarray:
        """The next position ``>= k`` using each of ``ids`` (:data:`NEVER` when none)."""
        ids = np.asarray(ids, dtype=np.int64)
        q = ids * self._span + int(k)
        at = np.searchsorted(self._keys, q)
        found = np.full(ids.shape, NEVER, dtype=np.int64)
        ok = at < self._keys.size
        hit = np.zeros(ids.shape, dtype=bool)
        hit[ok] = self._keys[at[ok]] // self._span == ids[ok]
        found[hit] = self._keys[at[hit]] % self._span
        return found


@dataclass(frozen=True)
class ReplayResult:
    """Counts of one replay: accesses (distinct samples per step, summed), hits, and their bytes."""

    policy: str
    accesses: int
    hits: int
    access_bytes: int
    hit_bytes: int
    fetched_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 1.0

    @property
    def byte_hit_rate(self) -> float:
        return self.hit_bytes / self.access_bytes if self.access_bytes else 1.0


def eviction_order(candidates: np.ndarray, k: int, next_use: NextUse, *, horizon: int | None,
                   last_use: np.ndarray) -> np.ndarray:
    """``candidates`` in the order to evict them at position ``k``: furthest next use first (a next use more than
    ``horizon`` positions ahead counts as never; None = LRU, no future at all), ties least recently used first."""
    recency = last_use[candidates]
    if horizon is None:
        return candidates[np.argsort(recency, kind="stable")]
    n = next_use.after(candidates, k)
    far = (n == NEVER) | (n - k > horizon)
    key = np.where(far, NEVER, n)
    return candidates[np.lexsort((recency, -key))]


def replay(acc: Accesses, sizes: np.ndarray, *, budget_bytes: int, policy: str = "optimum",
           window: int | None = None) -> ReplayResult:
    """Replay ``acc`` through a cache of ``budget_bytes`` under ``policy`` (see the module doc); ``sizes[id]`` is
    each sample's bytes. A step whose own samples exceed the budget still runs (they are all kept while it is
    served, then evicted down to the budget). Vectorized per step (one ranking of the cached samples per step that
    overflows the budget)."""
    if policy not in ("lru", "window", "optimum"):
        raise ValueError(f"policy must be 'lru', 'window' or 'optimum', got {policy!r}")
    if policy == "window" and (window is None or window < 1):
        raise ValueError("policy 'window' needs window >= 1 (steps of the plan it sees ahead)")
    sizes = np.asarray(sizes, dtype=np.int64)
    nxt = NextUse(acc)
    horizon = {"lru": None, "window": window, "optimum": len(acc)}[policy]
    in_cache = np.zeros(sizes.size, dtype=bool)
    last_use = np.full(sizes.size, -1, dtype=np.int64)
    used = hits = hit_bytes = access_bytes = fetched = accesses = 0
    for k in range(len(acc)):
        ids = acc.of(k)
        sz = sizes[ids]
        here = in_cache[ids]
        accesses += ids.size
        hits += int(here.sum())
        hit_bytes += int(sz[here].sum())
        access_bytes += int(sz.sum())
        fetched += int(sz[~here].sum())
        used += int(sz[~here].sum())
        in_cache[ids] = True
        last_use[ids] = k
        if used > budget_bytes:
            in_cache[ids] = False  # the step's own samples are pinned while it is served
            order = eviction_order(np.flatnonzero(in_cache), k + 1, nxt, horizon=horizon, last_use=last_use)
            in_cache[ids] = True
            freed = np.cumsum(sizes[order])
            n_out = min(int(np.searchsorted(freed, used - budget_bytes)) + 1, order.size)
            in_cache[order[:n_out]] = False
            used -= int(freed[n_out - 1]) if n_out else 0
    return ReplayResult(policy, accesses, hits, access_bytes, hit_bytes, fetched)


def compare_policies(acc: Accesses, sizes: np.ndarray, *, budget_bytes: int, window: int) -> dict[str, ReplayResult]:
    """``{"window": ..., "lru": ..., "optimum": ...}`` at the same budget: the figure the issue asks to report."""
    return {p: replay(acc, sizes, budget_bytes=budget_bytes, policy=p, window=window)
            for p in ("window", "lru", "optimum")}
