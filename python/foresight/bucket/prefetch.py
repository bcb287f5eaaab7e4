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
are ~1 sample per ranged GET however many steps are grouped; 8 media samples of ~1 MiB from as many objects are 8).
Knowing the whole plan, a group's fetch takes every ``fill_block``-aligned block of an object that holds one of its
absent samples whole: the block's absent samples the plan still reads, the group's own among them. Those bytes are
the plan's future, not waste, so a block is one ranged GET, once, and the samples of later steps are already there.
The runs may cross bytes the plan does not read (a sample it never reads, a present one, padding) up to
``FILL_SLACK`` of the fill's own bytes. A group's fill is one fetch whose GETs go out in the order the group's
steps first need their blocks, at most ``fill_bytes`` of them in flight (the next as one lands): the blocks land
one after another at the link's rate, each GET's samples marked as it lands, so the steps right after the first
wait on their own blocks, never behind a fill of the whole dataset (sent all at once, the GETs would share the link
and land together at the end).
The first step is fetched alone, without fill and without merged gaps: the first batch waits on that fetch (the
loader hands out a step it has read before it waits on the lookup of a later one), so it waits on its own samples'
bytes only. The fills from the next group on take their blocks whole, present samples included (a present sample
inside a fill run is fetched, but neither re-hashed nor written again: cutting runs at every present sample
would make the fill one GET per sample again). Under a budget there is no fill: a filled sample could be evicted before
its use.

The consumer's position comes from the loader's ``on_step`` hook (called when a batch is handed out: its reads are
done). The prefetcher claims (:mod:`foresight.bucket.claims`) the samples of the group it is fetching (its fill
included) and of the next group: a lookup that overtakes it (the loader reaching those steps before their fetch
landed) waits for that fetch, and tells the prefetcher to start it at once if it was holding back for its window,
instead of fetching the step itself (one GET per scattered sample, the block fill fetching the same bytes again).
A wait with no GET landing for ``wait_s`` raises, naming the sample. Anything outside the claims (a prefetcher
stopped by an error or closed) the loader's own ``lookup`` fetches (a demand miss); the budget is a target the
demand path may pass until the next eviction.

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
from typing import Any, Callable

import numpy as np

from foresight._closing import Closing

from .dataset import BucketDataset
from .policy import NextUse, eviction_order, plan_accesses

log = logging.getLogger("foresight.bucket")

__all__ = ["PlanPrefetcher", "FILL_BLOCK", "FILL_BYTES"]

FILL_BLOCK = 16 << 20  # a block is fetched whole (its samples the plan still reads): one GET per block, not per sample
FILL_GAP = 64 << 10  # a gap a run may always cross (alignment padding; the first step's own fetch takes no more)
FILL_BYTES = 64 << 20  # at most this much of a fill in flight (a few block GETs: they land one after another)
FILL_SLACK = 0.10  # bytes a fill's runs may carry between its samples, as a share of the samples' own bytes


class PlanPrefetcher(Closing):
    """Fetch ``lookahead`` steps ahead of the consumer; evict furthest-next-use under ``budget_bytes`` (None: no
    eviction). ``horizon`` limits how far ahead the policy looks (None: the whole plan, Belady's choice).
    ``group_steps`` (``lookahead // 2``) steps are fetched together, once all of them are inside the window: more
    samples per coalesced fetch, so more of them share a GET. ``max_gap`` is the coalescer's gap for these fetches
    (None: 0 under a budget, where gap bytes would mostly be evicted unused; the fetcher's own otherwise).
    ``fill_block``/``fill_bytes``: the block fill of the module doc (0: off; only without a budget; ``fill_bytes``
    bounds a fill's bytes in flight). ``keep`` (bool
    per sample): only those samples of the plan are fetched and pinned (a storage node's share of them).
    ``wait_s``: how long a lookup of a claimed sample waits with no GET landing before it raises (None: the
    fetcher's retry budget plus one request's timeout, by when a stuck GET has failed)."""

    # Tests only: called as ``before_fetch(prefetcher, k)`` on the prefetch thread once the group at position
    # ``k`` is claimed, before its fetch (to let a lookup overtake the prefetcher deterministically).
    before_fetch: Callable[["PlanPrefetcher", int], None] | None = None

    def __init__(self, ds: BucketDataset, plan: Any, *, dataset: int = 0, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, end_step: int | None = None, step_stride: int = 1, lookahead: int = 8,
                 budget_bytes: int | None = None, horizon: int | None = None,
                 group_steps: int | None = None, max_gap: int | None = None, fill_block: int = FILL_BLOCK,
                 fill_bytes: int = FILL_BYTES, keep: np.ndarray | None = None,
                 wait_s: float | None = None) -> None:
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
        if self.fill_block:
            self._init_fill()
        self._last_use = np.full(ds.num_samples, -1, dtype=np.int64)
        self._consumed = -1  # position (index into acc.steps) of the last step handed to the consumer
        self._cv = threading.Condition()
        self._stop = False
        self._pins = self.cache.pins()  # the window, pinned for every process sharing the cache
        self._pins.hold(self._window(-1))
        self.error: BaseException | None = None
        self.stats = {"prefetched_steps": 0, "fetched_samples": 0, "filled_samples": 0, "fill_blocks": 0,
                      "evicted_samples": 0, "evicted_bytes": 0, "over_budget": 0, "max_cached_bytes": 0}
        retry = ds.fetcher.retry
        self._claim = self.cache.claim(self._wake, retry.budget_s + retry.request_timeout_s
                                       if wait_s is None else float(wait_s))
        self._group_list = self._groups()
        self._claim.set(self._group_uses(0, 2))  # before the loader's first lookup: it waits, never fetches
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

    def _wake(self) -> None:
        """A lookup waits on a claimed sample (:mod:`foresight.bucket.claims`): fetch it without waiting for the
        window."""
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        thread = self.__dict__.get("_thread")
        if thread is None:
            claim = self.__dict__.get("_claim")
            if claim is not None:
                claim.release()
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

    def _group_uses(self, i: int, n: int) -> np.ndarray:
        """The samples groups ``i`` to ``i + n - 1`` read (what the claim holds)."""
        groups = self._group_list[i:i + n]
        if not groups:
            return np.zeros(0, dtype=np.int64)
        return self.acc.ids[self.acc.ptr[groups[0][0]]:self.acc.ptr[groups[-1][1]]]

    def _run(self) -> None:
        try:
            self._prefetch()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer by on_step; the loader's own fetch goes on
            log.warning("bucket prefetch stopped: %s (the loader fetches on demand from here)", e)
            self.error = e
        finally:
            self._claim.release()  # waiters on what was claimed fetch it themselves

    def _prefetch(self) -> None:
        acc = self.acc
        for i, (k, end) in enumerate(self._group_list):
            # this group and the next: a lookup of either waits for this thread (and wakes it: see _wake)
            claimed = self._group_uses(i, 2)
            self._claim.set(claimed)
            with self._cv:  # the whole group inside the window (the consumer at end - 1 - lookahead or later),
                # or a lookup waiting on the claim
                while not self._stop and not self._claim.wanted and end - 1 > self._consumed + self.lookahead:
                    self._cv.wait()
                if self._stop:
                    return
                consumed = self._consumed
            uses = acc.ids[acc.ptr[k]:acc.ptr[end]]
            ids = np.unique(uses)
            if self.budget_bytes is not None:
                self._make_room(k, consumed, ids)
            order, cap = None, None
            if self.fill_block and k == 0:  # the first batch waits on this fetch: its own bytes only
                gap, span = FILL_GAP, False
            elif self.fill_block:
                # the group's blocks whole, their GETs sent in the order the plan first needs them (a present
                # sample inside a fill run is fetched but not written again: a run cut at every present sample
                # would be one GET per sample again)
                ids, order, gap = self._fill(k, uses)
                cap = self._fill_cap
                self._claim.set(np.concatenate((claimed, ids)))  # the fill's samples too
                self.stats["filled_samples"] += int(np.count_nonzero(~np.isin(ids, uses)))
                self.stats["fill_blocks"] += int(np.unique(order).size)
                span = True
            else:
                gap, span = self.max_gap, False
            if self.before_fetch is not None:
                self.before_fetch(k)
            fetched = self.cache.ensure(ids, max_gap=gap, span_present=span, order=order,
                                        max_inflight=self.fill_bytes, claim=self._claim, max_transfer=cap)
            self._last_use[uses] = np.repeat(np.arange(k, end), np.diff(acc.ptr[k:end + 1]))
            self.stats["prefetched_steps"] += end - k
            self.stats["fetched_samples"] += fetched
            if self.budget_bytes is not None:
                used = self.cache.cached_bytes()
                self.stats["max_cached_bytes"] = max(self.stats["max_cached_bytes"], used)

    # -- block fill ----------------------------------------------------------------------------------------------
    def _init_fill(self) -> None:
        """Each sample's block (object, offset // fill_block), the samples sorted by block, and the last position
        of the plan that reads each sample (-1: never)."""
        n = self.ds.num_samples
        ext = self.cache.lookup(np.arange(n, dtype=np.int64))  # the maps only: no fetch
        self._shard, self._offset = ext.shard.astype(np.int64), ext.offset.astype(np.int64)
        self._block = (ext.shard.astype(np.int64) << 40) | (ext.offset // self.fill_block)
        self._by_block = np.argsort(self._block, kind="stable")
        self._sorted_blocks = self._block[self._by_block]
        self._last_pos = np.full(n, -1, dtype=np.int64)
        # one GET per block: a block's samples start inside it and the last may run past its end by up to a
        # sample (capped at the fetcher's own cap, a block fetched whole was two GETs, 16 MiB and the spill)
        widest = int(self._sizes.max()) if n else 0
        self._fill_cap = max(self.cache.fetcher.max_transfer, self.fill_block + widest)
        np.maximum.at(self._last_pos, self.acc.ids, np.repeat(np.arange(len(self.acc)), np.diff(self.acc.ptr)))

    def _fill(self, k: int, uses: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The fill of the group at position ``k`` reading ``uses``: every block holding an absent sample of
        ``uses``, whole (its absent samples the plan reads at ``k`` or later). Returns those samples, the rank of
        each one's block in the order the group's steps first need the blocks (its GETs go out in that order, at
        most ``fill_bytes`` in flight: they land one after another, so step ``k + 1`` waits on its own blocks only),
        and the coalescer's gap for them: the widest that keeps the bytes between the samples (samples the plan
        never reads, present ones a run crosses) within ``FILL_SLACK`` of the samples' own (at least
        ``FILL_GAP``)."""
        present = self.cache.present
        at_use = np.flatnonzero(present[uses] == 0)
        if not at_use.size:
            return at_use, np.zeros(0, np.int64), FILL_GAP
        wanted = uses[at_use]
        keys = self._block[wanted]
        _, first = np.unique(keys, return_index=True)
        first = np.sort(first)
        blocks = keys[first]
        lo = np.searchsorted(self._sorted_blocks, blocks, side="left")
        hi = np.searchsorted(self._sorted_blocks, blocks, side="right")
        counts = hi - lo
        at = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        cand = self._by_block[at]
        block_of = np.repeat(np.arange(blocks.size), counts)
        keep = (present[cand] == 0) & (self._last_pos[cand] >= k)
        cand, block_of = cand[keep], block_of[keep]
        return cand, block_of, self._fill_gap(cand)

    def _fill_gap(self, ids: np.ndarray) -> int:
        """The largest gap between neighbours (same object) whose gaps up to it sum to at most ``FILL_SLACK`` of
        the fill's bytes: bytes bounded to (1 + FILL_SLACK)x, runs as long as that allows."""
        if ids.size < 2:
            return FILL_GAP
        ids = np.sort(ids)
        end = self._offset[ids] + self._sizes[ids]
        same = self._shard[ids[1:]] == self._shard[ids[:-1]]
        gaps = np.sort((self._offset[ids[1:]] - end[:-1])[same])
        fits = np.cumsum(gaps) <= FILL_SLACK * float(self._sizes[ids].sum())
        widest = int(gaps[fits][-1]) if fits.any() else 0
        return max(FILL_GAP, min(widest, self.cache.fetcher.max_transfer))

    def _window(self, consumed: int) -> np.ndarray:
        """Samples of the steps the loader may be reading while the consumer is at ``consumed``: the next
        ``lookahead`` steps (at least the loader's read-ahead, ``prefetch + 2``, where callers keep lookahead so)."""
        lo = self.acc.ptr[consumed + 1]
        hi = self.acc.ptr[min(consumed + 1 + self.lookahead, len(self.acc))]
        return self.acc.ids[lo:hi]

    def _make_room(self, k: int, consumed: int, ids: np.ndarray) -> None:
        present = self.cache.present.copy()  # a snapshot: other processes mark the shared index meanwhile
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
