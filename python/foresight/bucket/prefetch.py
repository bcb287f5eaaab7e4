"""Plan-driven prefetch into a bucket dataset's cache, ``lookahead`` steps ahead, evicting by the plan's future.

A background thread walks the plan's steps (this rank's share, in the loader's order) and makes each step's
samples present up to ``lookahead`` steps before the loader gets there (one coalesced fetch per ``group_steps``
steps). Under a byte
budget it first evicts the cached samples whose next use in the plan is furthest (never used again first;
:func:`~foresight.bucket.policy.eviction_order`, the same ranking the replays use), never one used by a step from
the consumer's position up to ``lookahead`` steps past it: the loader's in-flight steps are among those, so a read
never meets a punched hole. ``lookahead`` must therefore be at least the loader's ``prefetch + 2``. Those samples
are pinned for every process sharing the cache (:mod:`foresight.bucket.pins`), so another rank's prefetcher skips
them too; the pins move with the consumer (:meth:`PlanPrefetcher.on_step`: the next window pinned before the last
one is let go) and vanish with the process.

Block fill (no budget): a random plan's steps are sparse in the objects (64 samples of 16 KiB out of thousands
are ~1 sample per ranged GET however many steps are grouped). Knowing the whole plan, a fetch also takes every
absent sample the plan still reads that lies in the same ``fill_block``-aligned block of an object as a sample it
fetches: those bytes are the plan's future, not waste, so the block is fetched in one run, once, and the samples
of later steps are already there (blocks in the order the group first needs them). The fills grow: the first takes
one block's worth, each next one twice the last, up to ``fill_bytes`` per fetch, so the steps right after the
first never wait behind a fill of the whole dataset (a fill's samples are marked as its chunks land, in object
order, not plan order).
The first step is fetched alone, without fill and without merged gaps: the first batch waits on that fetch (the
loader hands out a step it has read before it waits on the lookup of a later one), so it waits on its own samples'
bytes only. The fills from the next group on take their blocks whole, present samples included (a present sample
inside a fill run is fetched, checked and written again, identical: cutting runs at every present sample would
make the fill one GET per sample again). Under a budget there is no fill: a filled sample could be evicted before
its use.

The consumer's position comes from the loader's ``on_step`` hook (called when a batch is handed out: its reads are
done). The loader's own ``lookup`` still fetches anything the prefetcher has not (a demand miss), so a slow
prefetcher costs time, never bytes; the budget is a target the demand path may pass until the next eviction.

Example::

    ds = open_dataset("s3://data/wiki", cache_dir="/nvme/cache")
    with PlanPrefetcher(ds, plan, lookahead=8, budget_bytes=50 << 30) as pf, \\
         Loader(plan, datasets=ds, prefetch=2, on_step=pf.on_step) as loader:
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

__all__ = ["PlanPrefetcher", "FILL_BLOCK", "FILL_BYTES"]

FILL_BLOCK = 16 << 20  # a block is fetched whole (its samples the plan still reads): one GET per block, not per sample
FILL_GAP = 64 << 10  # bytes the plan does not read that a fill run may carry (alignment padding, a stray sample)
FILL_BYTES = 256 << 20  # at most this much fill per fetch (what one fetch holds in memory; the first batch's wait)


class PlanPrefetcher(Closing):
    """Fetch ``lookahead`` steps ahead of the consumer; evict furthest-next-use under ``budget_bytes`` (None: no
    eviction). ``horizon`` limits how far ahead the policy looks (None: the whole plan, Belady's choice).
    ``group_steps`` (``lookahead // 2``) steps are fetched together, once all of them are inside the window: more
    samples per coalesced fetch, so more of them share a GET. ``max_gap`` is the coalescer's gap for these fetches
    (None: 0 under a budget, where gap bytes would mostly be evicted unused; the fetcher's own otherwise).
    ``fill_block``/``fill_bytes``: the block fill of the module doc (0: off; only without a budget). ``keep`` (bool
    per sample): only those samples of the plan are fetched and pinned (a storage node's share of them)."""

    def __init__(self, ds: BucketDataset, plan: Any, *, dataset: int = 0, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, end_step: int | None = None, step_stride: int = 1, lookahead: int = 8,
                 budget_bytes: int | None = None, horizon: int | None = None,
                 group_steps: int | None = None, max_gap: int | None = None, fill_block: int = FILL_BLOCK,
                 fill_bytes: int = FILL_BYTES, keep: np.ndarray | None = None) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        group_steps = max(1, lookahead // 2) if group_steps is None else int(group_steps)
        if not 1 <= group_steps <= lookahead:
            raise ValueError(f"group_steps must be in [1, lookahead={lookahead}], got {group_steps}")
        self.group_steps = group_steps
        # Under a budget, bytes fetched as a gap are samples the plan may not reach before they are evicted
        # (measured: 2.1x the plan's bytes at a 10% budget with 1 MiB gaps, 0.95x with none, the optimum 0.93x).
        self.max_gap = (0 if budget_bytes is not None else None) if max_gap is None else int(max_gap)
        self._demand_gap = ds.cache.max_gap
        ds.cache.max_gap = self.max_gap  # the loader's own (demand) fetches follow the same rule while this runs
        self.ds = ds
        self.cache = ds.cache
        self.acc = plan_accesses(plan, dataset, rank=rank, world_size=world_size, start_step=start_step,
                                 end_step=end_step, step_stride=step_stride, keep=keep)
        self.next_use = NextUse(self.acc)
        self.lookahead = int(lookahead)
        self.budget_bytes = budget_bytes
        self.horizon = len(self.acc) if horizon is None else int(horizon)
        self._sizes = ds.sample_bytes()
        self.fill_block = int(fill_block) if budget_bytes is None else 0
        self.fill_bytes = int(fill_bytes)
        self._fill_limit = min(self.fill_bytes, self.fill_block)  # doubles with each fill, up to fill_bytes
        if self.fill_block:
            self._init_fill()
        self._last_use = np.full(ds.num_samples, -1, dtype=np.int64)
        self._consumed = -1  # position (index into acc.steps) of the last step handed to the consumer
        self._cv = threading.Condition()
        self._stop = False
        self._pins = self.cache.pins()  # the window, pinned for every process sharing the cache
        self._pins.hold(self._window(-1))
        self.error: BaseException | None = None
        self.stats = {"prefetched_steps": 0, "fetched_samples": 0, "filled_samples": 0, "evicted_samples": 0,
                      "evicted_bytes": 0, "over_budget": 0, "max_cached_bytes": 0}
        self._thread = threading.Thread(target=self._run, name="foresight-bucket-prefetch", daemon=True)
        self._thread.start()

    # -- the consumer side ---------------------------------------------------------------------------------------
    @property
    def pinned(self) -> np.ndarray:
        """The samples this prefetcher pins now (its window; no process sharing the cache evicts them)."""
        return self._pins.ids

    def on_step(self, info: dict | int) -> None:
        """The loader's ``on_step`` hook (or call it with a step number): steps up to this one are read."""
        self.advance(int(info["step"] if isinstance(info, dict) else info))
        if self.error is not None:
            raise self.error

    def advance(self, step: int) -> None:
        """Steps up to ``step`` are read: the position alone (a stopped prefetcher's error stays in :attr:`error`,
        for a consumer that goes on fetching on demand, such as a storage node)."""
        pos = int(np.searchsorted(self.acc.steps, step, side="right")) - 1
        with self._cv:
            if pos > self._consumed:
                if not self._stop:  # (closed: its pins are gone, and nothing is evicted for it any more)
                    self._pins.hold(self._window(pos))  # before the loader looks up the steps entering the window
                self._consumed = pos
                self._cv.notify_all()

    def close(self) -> None:
        thread = self.__dict__.get("_thread")
        if thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        thread.join()
        self._pins.close()
        self.cache.max_gap = self._demand_gap

    # -- the prefetch thread --------------------------------------------------------------------------------------
    def _groups(self) -> list[tuple[int, int]]:
        """The fetches' step ranges: ``group_steps`` at a time, the first step alone when filling (its fetch is
        what the first batch waits for, so it holds that step's samples only)."""
        n, g = len(self.acc), self.group_steps
        first = min(1, n) if self.fill_block else 0
        return ([(0, first)] if first else []) + [(k, min(k + g, n)) for k in range(first, n, g)]

    def _run(self) -> None:
        acc = self.acc
        try:
            for k, end in self._groups():
                with self._cv:  # the whole group inside the window: the consumer is at end - 1 - lookahead or later
                    while not self._stop and end - 1 > self._consumed + self.lookahead:
                        self._cv.wait()
                    if self._stop:
                        return
                    consumed = self._consumed
                uses = acc.ids[acc.ptr[k]:acc.ptr[end]]
                ids = np.unique(uses)
                if self.budget_bytes is not None:
                    self._make_room(k, consumed, ids)
                gap, span = self.max_gap, False
                if self.fill_block and k == 0:  # the first batch waits on this fetch: its own bytes only
                    gap = FILL_GAP
                elif self.fill_block:
                    filled = self._fill(k, uses)
                    self.stats["filled_samples"] += filled.size
                    ids = np.union1d(ids, filled)
                    # a fill run takes its block whole, the first step's samples in it again (a few percent):
                    # cut at every present sample, it would be one GET per sample again
                    gap, span = FILL_GAP, True
                fetched = self.cache.ensure(ids, max_gap=gap, span_present=span)  # one coalesced fetch per group
                self._last_use[uses] = np.repeat(np.arange(k, end), np.diff(acc.ptr[k:end + 1]))
                self.stats["prefetched_steps"] += end - k
                self.stats["fetched_samples"] += fetched
                if self.budget_bytes is not None:
                    used = self.cache.cached_bytes()
                    self.stats["max_cached_bytes"] = max(self.stats["max_cached_bytes"], used)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer by on_step; the loader's own fetch goes on
            log.warning("bucket prefetch stopped: %s (the loader fetches on demand from here)", e)
            self.error = e

    # -- block fill ----------------------------------------------------------------------------------------------
    def _init_fill(self) -> None:
        """Each sample's block (object, offset // fill_block), the samples sorted by block, and the last position
        of the plan that reads each sample (-1: never)."""
        n = self.ds.num_samples
        ext = self.cache.lookup(np.arange(n, dtype=np.int64))  # the maps only: no fetch
        self._block = (ext.shard.astype(np.int64) << 40) | (ext.offset // self.fill_block)
        self._by_block = np.argsort(self._block, kind="stable")
        self._sorted_blocks = self._block[self._by_block]
        self._last_pos = np.full(n, -1, dtype=np.int64)
        np.maximum.at(self._last_pos, self.acc.ids, np.repeat(np.arange(len(self.acc)), np.diff(self.acc.ptr)))

    def _fill(self, k: int, uses: np.ndarray) -> np.ndarray:
        """The absent samples the plan reads at position ``k`` or later that share a block with an absent sample of
        ``uses`` (blocks in the order ``uses`` first needs them, at most the current fill limit in all: one block's
        worth for the first fill, doubling with each one up to ``fill_bytes``)."""
        present = self.cache.present
        wanted = uses[present[uses] == 0]
        if not wanted.size:
            return wanted
        keys = self._block[wanted]
        _, first = np.unique(keys, return_index=True)
        blocks = keys[np.sort(first)]
        lo = np.searchsorted(self._sorted_blocks, blocks, side="left")
        hi = np.searchsorted(self._sorted_blocks, blocks, side="right")
        counts = hi - lo
        at = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        cand = self._by_block[at]
        block_of = np.repeat(np.arange(blocks.size), counts)
        keep = (present[cand] == 0) & (self._last_pos[cand] >= k)
        cand, block_of = cand[keep], block_of[keep]
        per_block = np.bincount(block_of, weights=self._sizes[cand], minlength=blocks.size)
        n_blocks = max(1, int(np.searchsorted(np.cumsum(per_block), self._fill_limit, side="right")))
        self._fill_limit = min(self.fill_bytes, 2 * self._fill_limit)
        return cand[block_of < n_blocks]

    def _window(self, consumed: int) -> np.ndarray:
        """Samples of the steps the loader may be reading while the consumer is at ``consumed``: the next
        ``lookahead`` steps (at least the loader's read-ahead, ``prefetch + 2``, where callers keep lookahead so)."""
        lo = self.acc.ptr[consumed + 1]
        hi = self.acc.ptr[min(consumed + 1 + self.lookahead, len(self.acc))]
        return self.acc.ids[lo:hi]

    def _make_room(self, k: int, consumed: int, ids: np.ndarray) -> None:
        present = self.cache.present
        need = int(self._sizes[ids[present[ids] == 0]].sum())
        cached = np.flatnonzero(present)
        used = int(self._sizes[cached].sum())
        if used + need <= self.budget_bytes:
            return
        pinned = np.union1d(self._window(consumed), ids)  # the loader may be reading these: never punched
        candidates = cached[~np.isin(cached, pinned)]
        order = eviction_order(candidates, k, self.next_use, horizon=self.horizon, last_use=self._last_use)
        freed = np.cumsum(self._sizes[order])
        over = used + need - self.budget_bytes
        evicted, done = 0, 0
        before = self.cache.stats.evicted
        # The window is taken again once the cache is ours, with the consumer held still (on_step waits on _cv): a
        # fetch the eviction waited for may have let the loader move on to samples chosen above. Samples another
        # process pins are skipped: the next candidates in the order make up for them.
        with self._cv:
            while evicted < over and done < order.size:
                target = (freed[done - 1] if done else 0) + over - evicted
                end = min(int(np.searchsorted(freed, target)) + 1, order.size)
                evicted += self.cache.evict(order[done:end],
                                            keep=lambda: np.union1d(self._window(self._consumed), ids))
                done = end
        self.stats["evicted_bytes"] += evicted
        self.stats["evicted_samples"] += self.cache.stats.evicted - before
        if evicted < over:
            if not self.stats["over_budget"]:
                log.warning("bucket cache over its budget (%d bytes): the steps from the consumer to %d ahead need "
                            "more; further ones are counted in stats['over_budget']", self.budget_bytes,
                            self.lookahead)
            self.stats["over_budget"] += 1
