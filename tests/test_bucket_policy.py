"""Eviction by the plan's future: replays of LRU, the windowed policy and the offline optimum on real plans, and
the runtime prefetcher over a real SeaweedFS bucket under a byte budget."""
from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from foresight.bucket.policy import NEVER, Accesses, NextUse, compare_policies, plan_accesses, replay
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.bucket.upload import upload_dataset
from foresight import open_dataset
from foresight.format import DatasetWriter
from foresight.loader import Loader
from foresight.plan import build_plan
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)


def _dataset(path, n=80, seed=2):
    rng = np.random.default_rng(seed)
    with DatasetWriter(str(path), align=4096, shard_bytes=150_000) as w:
        for _ in range(n):
            w.add(rng.integers(0, 256, size=int(rng.integers(100, 6000)), dtype=np.uint8).tobytes(), modality="bytes")
    return open_dataset(str(path))


@pytest.fixture(scope="module")
def multi_epoch(tmp_path_factory):
    ds = _dataset(tmp_path_factory.mktemp("pol") / "d")
    plan = build_plan([(ds, 1.0)], seed=4, global_batch_size=8, num_steps=60)  # 6 epochs of 80 samples
    return ds, plan


def batch_samples(batch) -> list[bytes]:
    """A packed batch's samples, each as bytes."""
    return [batch["data"].numpy()[o:o + n].tobytes() for o, n in zip(batch["offsets"].numpy(),
                                                                     batch["lengths"].numpy())]


def test_next_use_is_the_first_later_step():
    acc = Accesses(np.arange(4), np.array([0, 2, 3, 5, 6]), np.array([1, 2, 2, 1, 3, 1]))
    nxt = NextUse(acc)
    assert nxt.after(np.array([1, 2, 3, 9]), 0).tolist() == [0, 0, 2, NEVER]
    assert nxt.after(np.array([1, 2, 3]), 1).tolist() == [2, 1, 2]
    assert nxt.after(np.array([1, 2, 3]), 3).tolist() == [3, NEVER, NEVER]


def test_plan_accesses_are_each_steps_distinct_samples(multi_epoch):
    ds, plan = multi_epoch
    acc = plan_accesses(plan)
    assert len(acc) == plan.num_steps
    for k in (0, 17, 59):
        start, stop = plan.rank_items(k, 0, 1)
        assert acc.of(k).tolist() == sorted(set(np.asarray(plan.pieces(start, stop).sample).tolist()))
    half = plan_accesses(plan, rank=1, world_size=2, start_step=10, step_stride=5)
    assert half.steps.tolist() == list(range(10, 60, 5)) and half.of(0).size <= 4
    keep = np.arange(ds.num_samples) % 3 == 0  # a storage node's share: only these samples are its accesses
    mine = plan_accesses(plan, keep=keep)
    assert mine.steps.tolist() == acc.steps.tolist()
    for k in range(plan.num_steps):
        assert mine.of(k).tolist() == [s for s in acc.of(k).tolist() if s % 3 == 0]


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.6])
def test_window_covering_the_plan_is_the_optimum_and_beats_lru(multi_epoch, fraction):
    ds, plan = multi_epoch
    acc = plan_accesses(plan)
    sizes = ds.sample_bytes()
    budget = int(sizes.sum() * fraction)
    res = compare_policies(acc, sizes, budget_bytes=budget, window=len(acc))
    assert dataclasses.astuple(res["window"])[1:] == dataclasses.astuple(res["optimum"])[1:]
    assert res["optimum"].hits >= res["lru"].hits
    assert res["optimum"].hits > res["lru"].hits or fraction > 0.5
    short = replay(acc, sizes, budget_bytes=budget, policy="window", window=4)
    assert res["optimum"].hits >= short.hits
    # every access is counted once; nothing is a hit on the first epoch
    assert res["lru"].accesses == res["optimum"].accesses == int(np.diff(acc.ptr).sum())
    assert res["optimum"].fetched_bytes == res["optimum"].access_bytes - res["optimum"].hit_bytes


def test_an_unlimited_budget_hits_everything_after_first_use(multi_epoch):
    ds, plan = multi_epoch
    acc = plan_accesses(plan)
    sizes = ds.sample_bytes()
    for policy in ("lru", "optimum"):
        r = replay(acc, sizes, budget_bytes=int(sizes.sum()), policy=policy)
        assert r.accesses - r.hits == np.unique(acc.ids).size


def test_prefetcher_under_a_budget_gives_the_local_batches(s3_env, tmp_path, multi_epoch):
    local, plan = multi_epoch
    upload_dataset(local.path, "s3://policy/ds")
    ds = open_dataset("s3://policy/ds", cache_dir=tmp_path / "cache")
    sizes = ds.sample_bytes()
    budget = int(sizes.sum() * 0.4)
    try:
        with Loader(local, plan) as loader:
            want = {b.step: [b["data"].numpy()[o:o + n].tobytes() for o, n in
                             zip(b["offsets"].numpy(), b["lengths"].numpy())] for b in loader}
        with PlanPrefetcher(ds, plan, lookahead=4, budget_bytes=budget) as pf, \
                Loader(ds, plan, prefetch=2, on_step=pf.on_step) as loader:
            got = {b.step: [b["data"].numpy()[o:o + n].tobytes() for o, n in
                            zip(b["offsets"].numpy(), b["lengths"].numpy())] for b in loader}
        assert got == want
        assert pf.error is None and pf.stats["prefetched_steps"] == plan.num_steps
        assert pf.stats["evicted_samples"] > 0 and ds.cache.stats.evicted == pf.stats["evicted_samples"]
        # the budget holds whenever the pinned window fits in it
        window_bytes = max(int(sizes[np.unique(pf.acc.ids[pf.acc.ptr[k]:pf.acc.ptr[min(k + 6, len(pf.acc))]])].sum())
                           for k in range(len(pf.acc)))
        assert pf.stats["max_cached_bytes"] <= max(budget, window_bytes) + int(sizes.max()) * 8
        # evicted blocks are really gone from the sparse files (fewer allocated bytes than the dataset)
        allocated = sum(os.stat(p).st_blocks * 512 for p in ds.shard_paths)
        assert allocated < sum(os.path.getsize(p) for p in local.shard_paths)
    finally:
        ds.close()


def test_prefetcher_fetches_no_more_than_lru_would(s3_env, tmp_path, multi_epoch):
    """At one budget, the runtime prefetcher (furthest next use, its lookahead window pinned) fetches at most what
    LRU's replay fetches, and at least what the offline optimum's does."""
    local, plan = multi_epoch
    upload_dataset(local.path, "s3://policy/versus")
    with open_dataset("s3://policy/versus", cache_dir=tmp_path / "cache") as ds:
        sizes = ds.sample_bytes()
        budget = int(sizes.sum() * 0.5)
        with PlanPrefetcher(ds, plan, lookahead=4, budget_bytes=budget) as pf, \
                Loader(ds, plan, prefetch=2, on_step=pf.on_step) as loader:
            for _ in loader:
                pass
        assert pf.error is None
        fetched = ds.cache.stats.misses + ds.cache.stats.gap_samples  # by the prefetcher, on demand, or as gaps
        res = compare_policies(pf.acc, sizes, budget_bytes=budget, window=len(pf.acc))
        lru_misses = res["lru"].accesses - res["lru"].hits
        best = res["optimum"].accesses - res["optimum"].hits
        assert best <= fetched <= lru_misses


def test_block_fill_makes_a_sparse_random_plan_few_requests(s3_env, tmp_path):
    """A random plan's step holds a few 16 KiB samples megabytes apart (one ranged GET each under any gap cap);
    without a budget the prefetcher fetches the blocks around them whole, their samples the plan reads later
    included: >= 10x fewer GETs than samples, for no byte the plan does not read, and the same batches."""
    rng = np.random.default_rng(5)
    with DatasetWriter(str(tmp_path / "tok"), align=4096) as w:
        for _ in range(1024):
            w.add(rng.integers(0, 256, size=16 << 10, dtype=np.uint8).tobytes(), modality="bytes")
    local = open_dataset(str(tmp_path / "tok"))
    plan = build_plan([(local, 1.0)], seed=9, global_batch_size=4, epochs=1)  # 256 steps, 2 MiB between samples
    upload_dataset(local.path, "s3://policy/fill")
    with Loader(local, plan) as loader:
        want = [batch_samples(b) for b in loader]
    with open_dataset("s3://policy/fill", cache_dir=tmp_path / "cache") as ds:
        base = ds.fetcher.stats.as_dict()
        with PlanPrefetcher(ds, plan, lookahead=4) as pf, Loader(ds, plan, prefetch=2, on_step=pf.on_step) as loader:
            got = [batch_samples(b) for b in loader]
        stats = ds.fetcher.stats.as_dict()
        assert pf.error is None and got == want
        requests = stats["requests"] - base["requests"]
        assert requests * 10 <= local.num_samples, requests
        assert stats["bytes"] - base["bytes"] <= int(local.sample_bytes().sum()) * 1.25
        assert pf.stats["filled_samples"] > 0


def _media(tmp_path, url, block: int = 512 << 10):
    """Media-like samples (a shard holds ~15 of them, a step reads 8 from as many shards) uploaded to ``url``: the
    local dataset, its plan (19 steps, 6 samples never read), the plan's accesses, the fill block (the bench's 16
    MiB blocks and transfers, scaled with the samples; a shard whole by default, smaller: blocks whose last sample
    runs past their end, as the bench's 16 MiB blocks of 64 MiB shards) and how many blocks the dataset spans."""
    rng = np.random.default_rng(11)
    with DatasetWriter(str(tmp_path / "media"), align=4096, shard_bytes=512 << 10) as w:
        for _ in range(158):
            w.add(rng.integers(0, 256, size=int(rng.integers(8 << 10, 64 << 10)), dtype=np.uint8).tobytes(),
                  modality="bytes")
    local = open_dataset(str(tmp_path / "media"))
    plan = build_plan([(local, 1.0)], seed=1, global_batch_size=8, epochs=1)
    ext = local.lookup(np.arange(local.num_samples))
    blocks = np.unique((ext.shard.astype(np.int64) << 40) | (ext.offset // block)).size
    upload_dataset(local.path, url)
    return local, plan, plan_accesses(plan), block, blocks


def _wait_for(done, what):
    """A bounded wait for an event (not a duration: the bound only keeps a broken run from hanging)."""
    for _ in range(6000):
        if done():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("block", [512 << 10, 128 << 10])
def test_media_fills_fetch_whole_blocks_not_a_get_per_sample(s3_env, tmp_path, block):
    """Past the first step, every sample the plan reads comes in a whole-block ranged GET, the step's own samples
    included (before, each own sample outside the one-block first fill was a GET of its own: 0.54 GETs per sample
    on the bench's media plan), the loader running beside the prefetcher (its lookups wait for the prefetcher's
    claimed fetches, never fetch a step themselves). At most one GET per block past step 0, bytes within 1.25x the
    plan's, the same batches; also where a block's last sample runs past its end with the fetcher's cap on a GET
    the block's size (the bench's full media preset: 151 GETs for ~104 blocks and step 0's, each spill a GET)."""
    url = f"s3://policy/media-{block >> 10}"
    local, plan, acc, block, blocks = _media(tmp_path, url, block)
    with Loader(local, plan) as loader:
        want = [batch_samples(b) for b in loader]
    with open_dataset(url, cache_dir=tmp_path / "cache", max_transfer=block) as ds:
        base = ds.fetcher.stats.as_dict()
        with PlanPrefetcher(ds, plan, lookahead=len(acc), fill_block=block) as pf, \
                Loader(ds, plan, prefetch=2, on_step=pf.on_step) as loader:
            got = [batch_samples(b) for b in loader]
        stats = {k: v - base[k] for k, v in ds.fetcher.stats.as_dict().items()}
    assert pf.error is None and got == want
    step0 = acc.of(0).size  # the first step's own samples: at most a GET each (its batch waits on nothing else)
    assert stats["requests"] <= step0 + blocks, (stats, blocks)
    needed = int(local.sample_bytes()[np.unique(acc.ids)].sum())
    assert needed <= stats["bytes"] <= needed * 1.25, (stats, needed)


def test_a_lookup_that_overtakes_the_prefetcher_waits_for_its_fetch(s3_env, tmp_path, monkeypatch):
    """A loader's lookup of a step whose group the prefetcher has planned but not yet fetched (made certain here:
    the prefetcher is held before that group's fetch until the lookup has come) waits for the prefetcher's whole-
    block GETs instead of fetching the step itself, a GET per scattered sample (before: 8 more GETs than blocks,
    and the fill fetched those bytes again). Held past ``wait_s`` with no GET landing, the lookup raises naming
    the sample."""
    from foresight.errors import BucketError

    local, plan, acc, block, blocks = _media(tmp_path, "s3://policy/overtake")
    step1 = acc.of(1)
    results = {}

    def lookup(ds):
        try:
            results["ext"] = ds.lookup(step1)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            results["error"] = e

    def overtake(pf, k):  # on the prefetch thread, before group k's fetch
        if k == 1:
            reader = threading.Thread(target=lookup, args=(pf.ds,))
            reader.start()
            _wait_for(lambda: not reader.is_alive() or pf.cache.stats.claim_waits, "the lookup to wait or end")
            results["reader"] = reader

    monkeypatch.setattr(PlanPrefetcher, "before_fetch", overtake)
    with open_dataset("s3://policy/overtake", cache_dir=tmp_path / "cache", max_transfer=block) as ds:
        base = ds.fetcher.stats.as_dict()
        with PlanPrefetcher(ds, plan, lookahead=len(acc), fill_block=block) as pf:
            _wait_for(lambda: pf.stats["prefetched_steps"] == len(acc) or pf.error is not None, "the prefetcher")
            results["reader"].join()
        stats = {k: v - base[k] for k, v in ds.fetcher.stats.as_dict().items()}
        assert pf.error is None and "error" not in results, results
        assert stats["requests"] <= acc.of(0).size + blocks, (stats, blocks)  # as the prefetcher alone
        assert ds.cache.stats.claim_waits == step1.size
        mine = local.lookup(step1)
        for i in range(step1.size):
            a, b = results["ext"], mine
            with open(ds.shard_paths[a.shard[i]], "rb") as f, open(local.shard_paths[b.shard[i]], "rb") as g:
                f.seek(int(a.offset[i]))
                g.seek(int(b.offset[i]))
                assert f.read(int(a.length[i])) == g.read(int(b.length[i]))

    # a prefetcher held there for good: the lookup gives up after wait_s with no GET landing, naming the sample
    held = threading.Event()
    monkeypatch.setattr(PlanPrefetcher, "before_fetch", lambda pf, k: k == 1 and held.wait(600))
    with open_dataset("s3://policy/overtake", cache_dir=tmp_path / "cache2", max_transfer=block) as ds:
        with PlanPrefetcher(ds, plan, lookahead=len(acc), fill_block=block, wait_s=0.5) as pf:
            _wait_for(lambda: pf.stats["prefetched_steps"] >= 1, "step 0's fetch")
            with pytest.raises(BucketError, match=r"sample \d+: waited 0.5 s for the prefetcher") as got:
                ds.lookup(step1)
            assert got.value.reason == "unavailable" and "s3://policy/overtake/" in str(got.value.context)
            held.set()


def test_the_first_step_is_fetched_alone_with_its_own_bytes_only(s3_env, tmp_path):
    """The first batch waits on the prefetcher's first fetch: it must hold step 0's samples, not the megabytes a
    1 MiB gap cap merges around them on a random plan (16x step 0's bytes on the bench's token plan), nor a fill.
    ``lookahead=1`` parks the prefetcher after that fetch (the next one waits for the consumer), so the fetcher's
    counters are that fetch's alone."""
    from foresight.bucket.prefetch import FILL_GAP

    rng = np.random.default_rng(6)
    with DatasetWriter(str(tmp_path / "tok"), align=4096) as w:
        for _ in range(1024):
            w.add(rng.integers(0, 256, size=16 << 10, dtype=np.uint8).tobytes(), modality="bytes")
    local = open_dataset(str(tmp_path / "tok"))
    plan = build_plan([(local, 1.0)], seed=2, global_batch_size=32, epochs=1)  # ~512 KiB between a step's samples
    step0 = plan_accesses(plan).of(0)
    own = int(local.sample_bytes()[step0].sum())
    upload_dataset(local.path, "s3://policy/first")
    with open_dataset("s3://policy/first", cache_dir=tmp_path / "cache") as ds:
        base = ds.fetcher.stats.as_dict()
        with PlanPrefetcher(ds, plan, lookahead=1) as pf:
            for _ in range(1200):  # an event: the first fetch landed (bounded wait, not a duration)
                if pf.stats["prefetched_steps"] or pf.error is not None:
                    break
                time.sleep(0.05)
            assert pf.error is None and pf.stats["prefetched_steps"] == 1
            got = {k: v - base[k] for k, v in ds.fetcher.stats.as_dict().items()}
            assert ds.cache.present[step0].all()
            merged = got["requests"] < step0.size  # samples closer than FILL_GAP share a GET, nothing more
            assert own <= got["bytes"] <= own + (step0.size - got["requests"]) * FILL_GAP, (got, own)
            assert merged or got["bytes"] == own
            assert pf.stats["filled_samples"] == 0


def test_a_fill_sends_its_blocks_in_the_order_the_plan_needs_them(s3_env, tmp_path):
    """The steps right after the first must not wait behind a fill of the whole dataset, nor its GETs share the
    link and land together at the end. A group's fill is one fetch of whole blocks (a GET per block, not per
    sample) whose GETs go out in the order the group's steps first need their blocks, at most ``fill_bytes`` of
    them in flight, each marked as it lands. Before, a group's blocks came in pieces (each piece's GETs all at
    once, the next piece after the last GET of the one before landed). ``lookahead`` = ``group_steps`` = 4 parks
    the prefetcher after each group; the GETs are recorded in the order they go out."""
    rng = np.random.default_rng(7)
    with DatasetWriter(str(tmp_path / "fill"), align=4096) as w:
        for _ in range(512):
            w.add(rng.integers(0, 256, size=16 << 10, dtype=np.uint8).tobytes(), modality="bytes")
    local = open_dataset(str(tmp_path / "fill"))
    plan = build_plan([(local, 1.0)], seed=3, global_batch_size=4, epochs=1)
    acc = plan_accesses(plan)
    block = 128 << 10  # 8 samples of 16 KiB: a fill of the whole 8 MiB dataset would be 64 blocks
    cap = 1 << 20  # fill_bytes: 8 blocks in flight

    upload_dataset(local.path, "s3://policy/fill")
    with open_dataset("s3://policy/fill", cache_dir=tmp_path / "cache") as ds:
        calls, gets = [], []  # fetch calls; (object, start, end) of each GET in the order it went out
        lock = threading.Lock()
        state = {"inflight": 0, "most": 0}
        fetch, get_range = ds.fetcher.fetch, ds.fetcher._get_range

        def recorded_fetch(*args, **kw):
            calls.append(kw.get("max_inflight"))
            return fetch(*args, **kw)

        def recorded_get(ref, start, end):
            with lock:
                gets.append((ref.key, start, end))
                state["inflight"] += end - start
                state["most"] = max(state["most"], state["inflight"])
            try:
                return get_range(ref, start, end)
            finally:
                with lock:
                    state["inflight"] -= end - start

        ds.fetcher.fetch, ds.fetcher._get_range = recorded_fetch, recorded_get
        with PlanPrefetcher(ds, plan, lookahead=4, group_steps=4, fill_block=block, fill_bytes=cap) as pf:
            per_group = []
            for done in (1, 5):  # step 0 alone, then steps 1-4
                for _ in range(1200):  # an event: this group's fetch landed (bounded wait, not a duration)
                    if pf.stats["prefetched_steps"] >= done or pf.error is not None:
                        break
                    time.sleep(0.05)
                assert pf.error is None and pf.stats["prefetched_steps"] == done
                per_group.append(len(gets) - sum(per_group))
                pf.on_step(done)  # lets the next group into the window
    assert calls[:2] == [None, cap], calls  # step 0's own fetch, then the group's fill: one fetch
    assert per_group[1] > 1 and pf.stats["fill_blocks"] >= per_group[1] // 2, (per_group, pf.stats)
    largest = max(end - start for _, start, end in gets)
    assert state["most"] <= max(cap, largest), (state, largest)  # fill_bytes in flight (or one larger GET alone)
    keys = [os.path.basename(p) for p in local.shard_paths]

    def first_need(get) -> int:  # the first step of the group reading a sample this GET holds
        name, start, end = get
        ext = local.lookup(np.arange(local.num_samples))
        inside = np.flatnonzero((np.array(keys)[ext.shard] == os.path.basename(name)) & (ext.offset >= start)
                                & (ext.offset + ext.length <= end))
        steps = [k for k in range(1, 5) if np.isin(acc.of(k), inside).any()]
        return min(steps) if steps else 5

    fill = [first_need(g) for g in gets[per_group[0]:per_group[0] + per_group[1]]]
    assert fill == sorted(fill), fill  # step 1's blocks first, then step 2's, ...
    assert fill[0] == 1 and len(set(fill)) > 1, fill




def test_a_lookup_queued_behind_a_fetch_waits_for_a_claim_made_meanwhile(s3_env, tmp_path):
    """A lookup of unclaimed samples that queues behind another fetch of this process (the prefetcher's, an
    eviction) looks at the claims again once that fetch ends: a prefetcher that claimed them meanwhile fetches
    them, the lookup waits for it (before: it fetched them itself, a GET per scattered sample, which the
    prefetcher's fill then found present)."""
    local, plan, acc, block, blocks = _media(tmp_path, "s3://policy/queued")
    step = acc.of(3)
    results = {}
    wanted = threading.Event()

    def lookup(ds):
        try:
            results["ext"] = ds.lookup(step)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            results["error"] = e

    with open_dataset("s3://policy/queued", cache_dir=tmp_path / "cache", max_transfer=block) as ds:
        cache = ds.cache
        reader = threading.Thread(target=lookup, args=(ds,))
        with cache._exclusive():  # another fetch of this process under way
            reader.start()
            _wait_for(lambda: len(cache._cv._waiters) == 1 or not reader.is_alive(), "the lookup to queue")
            claim = cache.claim(wanted.set, wait_s=600)
            claim.set(step)  # a prefetcher claims the step while the lookup is queued
        _wait_for(lambda: wanted.is_set() or not reader.is_alive(), "the lookup to wait on the claim or end")
        try:
            assert wanted.is_set() and cache.stats.claim_waits == step.size, results
            assert cache.ensure(step, claim=claim) == step.size  # the owner fetches every one of them
        finally:
            claim.release()
            reader.join()
        assert "error" not in results, results
        mine = local.lookup(step)
        for i in range(step.size):
            a = results["ext"]
            with open(ds.shard_paths[a.shard[i]], "rb") as f, open(local.shard_paths[mine.shard[i]], "rb") as g:
                f.seek(int(a.offset[i]))
                g.seek(int(mine.offset[i]))
                assert f.read(int(a.length[i])) == g.read(int(mine.length[i]))
