"""Plan-driven prefetch into a bucket dataset's cache, ``lookahead`` steps ahead, evicting by the plan's future.

A background thread walks the plan's steps (this rank's share, in the loader's order) and makes each step's
samples present ``lookahead`` steps before the loader gets there (one coalesced fetch per step). Under a byte
budget it first evicts the cached samples whose next use in the plan is furthest (never used again first;
:func:`~foresight.bucket.policy.eviction_order`, the same ranking the replays use), never one used by a step from
the consumer's position up to ``lookahead`` steps past it: the loader's in-flight steps are among those, so a read
never meets a punched hole. ``lookahead`` must therefore be at least the loader's ``prefetch + 2``.

The consumer's position comes from the loader's ``on_step`` hook (called when a batch is handed out: its reads are
done). The loader's own ``lookup`` still fetches anything the prefetcher has not (a demand miss), so a slow
prefetcher costs time, never bytes; the budget is a target the demand path may pass until the next eviction.

Example::

    ds = open_dataset("s3://data/wiki", cache_dir="/nvme/cache")
    with PlanPrefetcher(ds, plan, lookahead=8, budget_bytes=50 << 30) as pf, \\
         Loader(ds, plan, prefetch=2, on_step=pf.on_step) as loader:
        for batch in loader:
            ...
    pf.stats   # {"prefetched_steps", "fetched_samples", "evicted_samples", "evicted_bytes", "over_budget", ...}
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from foresight._closing import Closing

from .dataset import BucketDataset
from .policy import NextUse, eviction_order, plan_accesses

log = logging.getLogger("foresight.bucket")

__all__ = ["PlanPrefetcher"]


class PlanPrefetcher(Closing):
    """Fetch ``lookahead`` steps ahead of the consumer; evict furthest-next-use under ``budget_bytes`` (None: no
    eviction). ``horizon`` limits how far ahead the policy looks (None: the whole plan, Belady's choice)."""

    def __init__(self, ds: BucketDataset, plan: Any, *, dataset: int = 0, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, end_step: int | None = None, step_stride: int = 1, lookahead: int = 8,
                 budget_bytes: int | None = None, horizon: int | None = None) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.ds = ds
        self.cache = ds.cache
        self.acc = plan_accesses(plan, dataset, rank=rank, world_size=world_size, start_step=start_step,
                                 end_step=end_step, step_stride=step_stride)
        self.next_use = NextUse(self.acc)
        self.lookahead = int(lookahead)
        self.budget_bytes = budget_bytes
        self.horizon = len(self.acc) if horizon is None else int(horizon)
        self._sizes = ds.sample_bytes()
        self._last_use = np.full(ds.num_samples, -1, dtype=np.int64)
        self._consumed = -1  # position (index into acc.steps) of the last step handed to the consumer
        self._cv = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None
        self.stats = {"prefetched_steps": 0, "fetched_samples": 0, "evicted_samples": 0, "evicted_bytes": 0,
                      "over_budget": 0, "max_cached_bytes": 0}
        self._thread = threading.Thread(target=self._run, name="foresight-bucket-prefetch", daemon=True)
        self._thread.start()

    # -- the consumer side ---------------------------------------------------------------------------------------
    def on_step(self, info: dict | int) -> None:
        """The loader's ``on_step`` hook (or call it with a step number): steps up to this one are read."""
        step = int(info["step"] if isinstance(info, dict) else info)
        pos = int(np.searchsorted(self.acc.steps, step, side="right")) - 1
        with self._cv:
            if pos > self._consumed:
                self._consumed = pos
                self._cv.notify_all()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        thread = self.__dict__.get("_thread")
        if thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        thread.join()

    # -- the prefetch thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for k in range(len(self.acc)):
                with self._cv:
                    while not self._stop and k > self._consumed + self.lookahead:
                        self._cv.wait()
                    if self._stop:
                        return
                    consumed = self._consumed
                ids = self.acc.of(k)
                if self.budget_bytes is not None:
                    self._make_room(k, consumed, ids)
                fetched = self.cache.ensure(ids)
                self._last_use[ids] = k
                self.stats["prefetched_steps"] += 1
                self.stats["fetched_samples"] += fetched
                if self.budget_bytes is not None:
                    used = self.cache.cached_bytes()
                    self.stats["max_cached_bytes"] = max(self.stats["max_cached_bytes"], used)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer by on_step; the loader's own fetch goes on
            log.warning("bucket prefetch stopped: %s (the loader fetches on demand from here)", e)
            self.error = e

    def _make_room(self, k: int, consumed: int, ids: np.ndarray) -> None:
        present = self.cache.present
        need = int(self._sizes[ids[present[ids] == 0]].sum())
        cached = np.flatnonzero(present)
        used = int(self._sizes[cached].sum())
        if used + need <= self.budget_bytes:
            return
        lo = self.acc.ptr[consumed + 1]
        hi = self.acc.ptr[min(consumed + 1 + self.lookahead, len(self.acc))]
        pinned = np.union1d(self.acc.ids[lo:hi], ids)  # the loader may be reading these: never punched
        candidates = cached[~np.isin(cached, pinned)]
        order = eviction_order(candidates, k, self.next_use, horizon=self.horizon, last_use=self._last_use)
        freed = np.cumsum(self._sizes[order])
        over = used + need - self.budget_bytes
        n_out = min(int(np.searchsorted(freed, over)) + 1, order.size)
        if n_out:
            self.stats["evicted_bytes"] += self.cache.evict(order[:n_out])
            self.stats["evicted_samples"] += n_out
        if not n_out or freed[n_out - 1] < over:
            if not self.stats["over_budget"]:
                log.warning("bucket cache over its budget (%d bytes): the steps from the consumer to %d ahead need "
                            "more; further ones are counted in stats['over_budget']", self.budget_bytes,
                            self.lookahead)
            self.stats["over_budget"] += 1
