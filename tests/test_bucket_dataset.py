"""A dataset packed here, uploaded to a real SeaweedFS, opened as s3:// through a local cache, read by the Loader:
every batch equal to the local copy's; the cache's index, restarts and cross-process use."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

from foresight.bucket import BucketDataset
from foresight.bucket.upload import upload_dataset
from foresight import open_dataset
from foresight.format import DatasetWriter
from foresight.loader import Loader
from foresight.plan import build_plan
from seaweed_helpers import s3_env, seaweed, token_dataset  # noqa: F401  (fixtures)


def _bytes_dataset(path, *, n=120, seed=1, shard_bytes=200_000):
    rng = np.random.default_rng(seed)
    with DatasetWriter(str(path), align=4096, shard_bytes=shard_bytes) as w:
        for _ in range(n):
            w.add(rng.integers(0, 256, size=int(rng.integers(1, 9000)), dtype=np.uint8).tobytes(), modality="bytes")
    return open_dataset(str(path))


def _token_dataset(path, *, seed=0):
    return token_dataset(path, docs=300, max_len=200, shard_bytes=40_000, seed=seed)


def _batches(ds, plan, key):
    with Loader(ds, plan, prefetch=2) as loader:
        return {b.step: _copy(b, key) for b in loader}


def _copy(batch, key):
    if key == "tokens":
        return batch["tokens"].numpy().copy()
    data = batch["data"].numpy()
    return [data[o:o + n].tobytes() for o, n in zip(batch["offsets"].numpy(), batch["lengths"].numpy())]


@pytest.mark.parametrize("kind", ["bytes", "tokens"])
def test_loader_reads_the_bucket_dataset_like_the_local_one(s3_env, tmp_path, kind):
    if kind == "bytes":
        local = _bytes_dataset(tmp_path / "local")
        plan = build_plan([(local, 1.0)], seed=3, global_batch_size=10, num_steps=15)
    else:
        local = _token_dataset(tmp_path / "local")
        plan = build_plan([(local, 1.0)], seed=7, global_batch_size=8, seq_len=32, num_steps=12)
    assert len(local.shard_paths) > 1
    url = f"s3://loader/{kind}"
    upload_dataset(local.path, url)
    ds = open_dataset(url, cache_dir=tmp_path / "cache")
    try:
        assert isinstance(ds, BucketDataset) and ds.fingerprint == local.fingerprint
        assert not ds.cache.present.any()  # nothing fetched before the plan asks
        want = _batches(local, plan, kind)
        got = _batches(ds, plan, kind)
        assert sorted(got) == sorted(want) == list(range(plan.num_steps))
        for step in want:
            assert np.array_equal(got[step], want[step]) if kind == "tokens" else got[step] == want[step]
        st = ds.cache.stats
        used = np.unique(np.asarray(plan.pieces(0, plan.num_steps * plan.global_batch_size).sample))
        assert ds.cache.present[used].all()
        assert st.misses + st.gap_samples == int(ds.cache.present.sum())  # gaps fetched whole are kept
        assert st.fetched_bytes <= sum(os.path.getsize(p) for p in local.shard_paths)  # no byte fetched twice
        assert ds.fetcher.stats.requests < st.misses + st.gap_samples  # coalesced: fewer GETs than samples
        # a second pass is all hits: no request
        before = ds.fetcher.stats.requests
        assert _batches(ds, plan, kind).keys() == want.keys()
        assert ds.fetcher.stats.requests == before
    finally:
        ds.close()


def test_cache_is_kept_across_restarts_and_shared_by_processes(s3_env, tmp_path):
    local = _bytes_dataset(tmp_path / "local", n=60)
    upload_dataset(local.path, "s3://loader/shared")
    cache = tmp_path / "cache"
    with open_dataset("s3://loader/shared", cache_dir=cache) as ds:
        ds.lookup(np.arange(0, 30))
        assert int(ds.cache.present.sum()) == 30
    # another process (what a DataLoader worker or a second rank is) sees the same index: it fetches only the rest
    code = ("import pickle, sys, numpy as np\n"
            "ds = pickle.loads(sys.stdin.buffer.read())\n"
            "ds.lookup(np.arange(60))\n"
            "print(ds.cache.stats.misses, ds.cache.stats.hits, type(ds).__name__)\n")
    with open_dataset("s3://loader/shared", cache_dir=cache) as ds:
        blob = pickle.dumps(ds)
        out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True, timeout=120)
        assert out.stdout.split() == [b"30", b"30", b"BucketDataset"]
        assert int(ds.cache.present.sum()) == 60
        for i in range(60):
            assert ds.read(i) == local.read(i)


def test_open_dataset_needs_a_cache_dir(monkeypatch):
    monkeypatch.delenv("FORESIGHT_BUCKET_CACHE", raising=False)
    with pytest.raises(ValueError, match="FORESIGHT_BUCKET_CACHE"):
        open_dataset("s3://loader/x")
    with pytest.raises(TypeError):
        open_dataset(os.getcwd(), cache_dir="/tmp")


def test_two_processes_wanting_the_same_samples_fetch_them_once(s3_env, tmp_path):
    """A holds the record locks of samples 0-39 mid-fetch; B, wanting 20-59, waits on them (its debug line says
    so: the wait tries the lock without blocking, so /proc/locks shows no blocked waiter), then finds 20-39 present
    once A marks them, and fetches only 40-59."""
    local = _bytes_dataset(tmp_path / "local", n=60)
    upload_dataset(local.path, "s3://loader/once")
    cache = tmp_path / "cache"
    open_dataset("s3://loader/once", cache_dir=cache).close()  # laid out once, before the race
    hold = ("import os, time, numpy as np\n"
            "from foresight import open_dataset\n"
            "ds = open_dataset('s3://loader/once', cache_dir=os.environ['CACHE'])\n"
            "write = os.pwrite\n"
            "def held(fd, data, offset):\n"
            "    open(os.environ['HOLDING'], 'w').close()\n"
            "    for _ in range(1200):\n"
            "        if os.path.exists(os.environ['GO']): break\n"
            "        time.sleep(0.05)\n"
            "    return write(fd, data, offset)\n"
            "os.pwrite = held\n"
            "print(ds.cache.ensure(np.arange(int(os.environ['LO']), int(os.environ['HI']))))\n")
    env = dict(os.environ, CACHE=str(cache), HOLDING=str(tmp_path / "holding"), GO=str(tmp_path / "go"))
    a = subprocess.Popen([sys.executable, "-c", hold], env=dict(env, LO="0", HI="40"), stdout=subprocess.PIPE)
    b = None
    try:
        for _ in range(1200):
            if (tmp_path / "holding").exists() or a.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "holding").exists()
        plain = hold.replace("os.pwrite = held\n", "").replace(
            "import os, time, numpy as np\n", "import logging, os, sys, time, numpy as np\n"
            "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
            "logging.getLogger('foresight.bucket').setLevel(logging.DEBUG)\n")
        b = subprocess.Popen([sys.executable, "-c", plain], env=dict(env, LO="20", HI="60"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        waiting = None
        for line in b.stderr:  # B's lock request waits behind A's (until B ends, if it never waits)
            if line.startswith("waiting for samples 20-59"):  # one run: its lock waits on A's 20-39
                waiting = line
                break
        assert waiting is not None and b.poll() is None, "B finished while A held the locks"
        (tmp_path / "go").touch()
        out_a, _ = a.communicate(timeout=120)
        out_b, _ = b.communicate(timeout=120)
        assert (a.returncode, b.returncode) == (0, 0)
        assert (int(out_a), int(out_b)) == (40, 20)  # 20-39 fetched once, by A
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    with open_dataset("s3://loader/once", cache_dir=cache) as ds:
        assert ds.cache.present.all() and all(ds.read(i) == local.read(i) for i in range(60))


def test_large_fetches_are_cut_into_chunks(s3_env, tmp_path, monkeypatch):
    import foresight.bucket.cache as cache_module

    local = _bytes_dataset(tmp_path / "local", n=40)
    upload_dataset(local.path, "s3://loader/chunks")
    monkeypatch.setattr(cache_module, "FETCH_CHUNK", 20_000)
    with open_dataset("s3://loader/chunks", cache_dir=tmp_path / "cache") as ds:
        assert ds.cache.ensure(np.arange(40)) == 40
        assert ds.fetcher.stats.requests >= int(local.sample_bytes().sum()) // 20_000
        assert all(ds.read(i) == local.read(i) for i in range(40))


def test_a_plan_over_a_bucket_dataset_reopens_it_through_the_bucket(s3_env, tmp_path):
    """sources.json records the cache directory; opening it again must go through the bucket (the sparse files
    alone would read unfetched bytes as zeros)."""
    local = _bytes_dataset(tmp_path / "local", n=50)
    upload_dataset(local.path, "s3://loader/planned")
    with open_dataset("s3://loader/planned", cache_dir=tmp_path / "cache") as ds:
        plan = build_plan([(ds, 1.0)], seed=2, global_batch_size=5, num_steps=6)
        plan.save(str(tmp_path / "plan"))
        assert not ds.cache.present.any()
        again = open_dataset(ds.path)
        assert isinstance(again, BucketDataset) and str(again.url) == "s3://loader/planned"
        again.close()
    with Loader(str(tmp_path / "plan")) as loader:
        assert isinstance(loader.datasets[0], BucketDataset)
        got = {b.step: _copy(b, "bytes") for b in loader}
    assert got == _batches(local, plan, "bytes")


def test_gaps_never_refetch_present_samples_and_keep_absent_ones(s3_env, tmp_path):
    local = _bytes_dataset(tmp_path / "local", n=20, shard_bytes=1 << 30)  # one shard
    upload_dataset(local.path, "s3://loader/gaps")
    with open_dataset("s3://loader/gaps", cache_dir=tmp_path / "cache") as ds:
        req = ds.fetcher.stats.requests
        ds.cache.ensure(np.array([5]))
        ds.cache.ensure(np.array([0, 10]))  # 5 lies between and is present: two GETs, no gap kept
        assert ds.fetcher.stats.requests - req == 3 and ds.cache.stats.gap_samples == 0
        assert ds.cache.present.nonzero()[0].tolist() == [0, 5, 10]
        ds.cache.ensure(np.array([11, 15]))  # one GET; 12-14 came whole inside it: checked and kept
        assert ds.fetcher.stats.requests - req == 4 and ds.cache.stats.gap_samples == 3
        assert ds.cache.present.nonzero()[0].tolist() == [0, 5, 10, 11, 12, 13, 14, 15]
        assert all(ds.read(i) == local.read(i) for i in (0, 5, 10, 11, 12, 13, 14, 15))


def test_a_waiting_lookup_returns_when_its_samples_land_not_when_the_whole_fetch_ends(s3_env, tmp_path,
                                                                                       monkeypatch):
    """A prefetcher's long fetch (many chunks) must not hold up a lookup whose samples an early chunk brought: the
    loader's next step would wait for the whole window otherwise (the first batch behind a fill of the dataset)."""
    import threading

    from foresight.bucket import cache as cache_module
    from foresight.testing.wan import WanLink

    local = _bytes_dataset(tmp_path / "local", n=60, shard_bytes=1 << 30)
    upload_dataset(local.path, "s3://wait/ds")
    monkeypatch.setattr(cache_module, "FETCH_CHUNK", 1)  # one chunk (one fetch, marked on landing) per sample
    with WanLink(("127.0.0.1", s3_env.ports["s3.port"]), rtt_ms=20) as link, \
            open_dataset("s3://wait/ds", cache_dir=tmp_path / "cache",
                         options={"endpoint": f"http://127.0.0.1:{link.port}"}) as ds:
        cache = ds.cache
        whole = threading.Thread(target=cache.ensure, args=(np.arange(60),))
        whole.start()
        deadline = time.monotonic() + 60
        while not cache.present[0] and time.monotonic() < deadline:  # the long fetch is landing its chunks
            time.sleep(0.001)
        assert cache.present[0] and not cache.present[30]
        cache.ensure(np.array([30]))  # waits for sample 30's chunk: 29 round trips are still to go after it
        assert cache.present[30] and whole.is_alive() and not cache.present[59]
        whole.join(60)
        assert cache.present.all()


def test_each_get_of_a_fetch_is_marked_as_it_lands(s3_env, tmp_path):
    """One fetch of many GETs (a block fill's): each GET's samples are checked, written and marked as it lands, so
    a lookup of a sample an early GET brought returns while the fetch's later GETs are still to come (before, the
    whole fetch was marked once its last GET landed). One GET at a time here, 20 ms apart."""
    import threading

    from foresight.testing.wan import WanLink

    local = _bytes_dataset(tmp_path / "local", n=60, shard_bytes=1 << 30)
    upload_dataset(local.path, "s3://wait/gets")
    with WanLink(("127.0.0.1", s3_env.ports["s3.port"]), rtt_ms=20) as link, \
            open_dataset("s3://wait/gets", cache_dir=tmp_path / "cache", concurrency=1,
                         options={"endpoint": f"http://127.0.0.1:{link.port}"}) as ds:
        cache = ds.cache
        every_other = np.arange(0, 60, 2)  # never neighbours: one GET each with no gap merged
        whole = threading.Thread(target=cache.ensure, args=(every_other,), kwargs={"max_gap": 0})
        whole.start()
        deadline = time.monotonic() + 60
        while not cache.present[0] and time.monotonic() < deadline:  # the fetch's first GET landed
            time.sleep(0.001)
        assert cache.present[0] and not cache.present[58]
        cache.ensure(np.array([30]))  # waits for sample 30's GET: 14 more are still to go after it
        assert cache.present[30] and whole.is_alive() and not cache.present[58]
        whole.join(60)
        assert cache.present[every_other].all() and not cache.present[1::2].any()
        assert all(ds.read(int(i)) == local.read(int(i)) for i in every_other)


def test_the_loader_hands_out_a_read_step_before_waiting_on_the_next_steps_fetch(s3_env, tmp_path):
    """The loader looks up the steps it prefetches before it hands out the one it has read; over a bucket a lookup
    waits on a fetch, so batch 0 waited on steps 1..prefetch's fetches too (the first batch behind 30 MB of other
    steps' GETs on the object-store bench). Here another process holds the cache's record locks of step 1's samples
    (as a rank fetching them would): batch 0, whose samples are present, must come out while they are held."""
    import threading

    local = _bytes_dataset(tmp_path / "local", n=60)
    plan = build_plan([(local, 1.0)], seed=4, global_batch_size=6, num_steps=6)
    want = _batches(local, plan, "bytes")
    upload_dataset(local.path, "s3://loader/first")
    cache = tmp_path / "cache"
    with open_dataset("s3://loader/first", cache_dir=cache) as ds:
        step = [np.unique(np.asarray(plan.pieces(*plan.rank_items(k, 0, 1)).sample)) for k in range(2)]
        step1 = np.setdiff1d(step[1], step[0])
        ds.cache.ensure(step[0])
        assert step1.size and ds.lookup_would_wait(step1) and not ds.lookup_would_wait(step[0])
        hold = ("import fcntl, os, sys, time\n"
                "fd = os.open(os.environ['INDEX'], os.O_RDWR)\n"
                "for i in map(int, sys.argv[1:]):\n"
                "    fcntl.lockf(fd, fcntl.LOCK_EX, 1, i, os.SEEK_SET)\n"
                "open(os.environ['HOLDING'], 'w').close()\n"
                "while not os.path.exists(os.environ['GO']):\n"
                "    time.sleep(0.02)\n")
        env = dict(os.environ, INDEX=os.path.join(ds.path, ".foresight-cache", "present"),
                   HOLDING=str(tmp_path / "holding"), GO=str(tmp_path / "go"))
        holder = subprocess.Popen([sys.executable, "-c", hold, *map(str, step1.tolist())], env=env)
        try:
            for _ in range(1200):
                if (tmp_path / "holding").exists() or holder.poll() is not None:
                    break
                time.sleep(0.05)
            assert (tmp_path / "holding").exists()
            with Loader(ds, plan, prefetch=2) as loader:
                it = iter(loader)
                first: list = []
                taker = threading.Thread(target=lambda: first.append(_copy(next(it), "bytes")), daemon=True)
                taker.start()
                taker.join(60)  # an event, not a duration: before the fix it never comes while the locks are held
                came, still_held = len(first) == 1, holder.poll() is None  # step 1 was not fetched meanwhile
                (tmp_path / "go").touch()  # before any assert: the loader's close joins a thread blocked on them
                taker.join(120)
                assert came and still_held, "batch 0 waited on step 1's fetch"
                assert first == [want[0]]
                rest = {b.step: _copy(b, "bytes") for b in it}
            assert rest == {k: v for k, v in want.items() if k > 0}
        finally:
            (tmp_path / "go").touch()
            holder.wait(60)


def test_large_gets_are_written_past_the_page_cache_and_read_back_right(s3_env, tmp_path):
    """With direct writes on, a GET of at least DIRECT_MIN bytes is written O_DIRECT (its 4 KiB-aligned middle, through an aligned
    bounce buffer; the unaligned head and tail buffered): samples packed without alignment put the heads and tails
    mid-page and neighbours on shared pages. Every sample reads back as the local one (the loader's batches, the
    cache files byte for byte, scrub finds nothing)."""
    from foresight.io.direct_write import DIRECT_MIN

    rng = np.random.default_rng(5)
    with DatasetWriter(str(tmp_path / "local"), align=1, shard_bytes=6 << 20) as w:
        for _ in range(40):
            w.add(rng.integers(0, 256, size=int(rng.integers(100_000, 700_001)), dtype=np.uint8).tobytes(),
                  modality="bytes")
    local = open_dataset(str(tmp_path / "local"))
    plan = build_plan([(local, 1.0)], seed=2, global_batch_size=4, epochs=1)
    upload_dataset(local.path, "s3://loader/direct")
    with open_dataset("s3://loader/direct", cache_dir=tmp_path / "cache") as ds:
        ds.cache.writer.direct = True  # buffered by default (read back soon): the direct path is an option
        got = _batches(ds, plan, "bytes")  # each step's lookup: its samples coalesced (1 MiB gaps) into large GETs
        ds.cache.ensure(np.arange(ds.num_samples))  # the rest, in GETs of up to 16 MiB
        stats = ds.cache.writer.stats
        assert stats["direct_bytes"] >= DIRECT_MIN and stats["buffered_bytes"] > 0 and not stats["fallbacks"]
        assert got == _batches(local, plan, "bytes")
        assert ds.cache.scrub().size == 0
        ext, mine = ds.lookup(np.arange(ds.num_samples)), local.lookup(np.arange(local.num_samples))
        for path, theirs in zip(ds.shard_paths, local.shard_paths):
            with open(path, "rb") as f, open(theirs, "rb") as g:
                assert f.read() == g.read()  # every byte: all samples present, padding-free
        assert np.array_equal(ext.offset, mine.offset)


def test_a_fill_writes_around_the_present_samples_it_crosses(s3_env, tmp_path):
    """A block fill's run crosses samples already present (the first step's, fetched alone): their bytes come with
    the GET but are neither re-hashed nor written again (they are in place, and a reader may be reading them); the
    GET's other bytes are written around them. Before, every byte of the GET was hashed and written again. Sample
    5's cached bytes are overwritten by hand while it stays marked: still so after the fill, so nothing wrote it."""
    local = _bytes_dataset(tmp_path / "local", n=16, shard_bytes=1 << 30)
    upload_dataset(local.path, "s3://around/fill")
    with open_dataset("s3://around/fill", cache_dir=tmp_path / "cache") as ds:
        cache = ds.cache
        cache.ensure(np.array([5, 9]), max_gap=0)  # their own bytes only
        ext = local.lookup(np.array([5, 9]))
        marker = b"\xa5" * int(ext.length[0])
        os.pwrite(cache._fds[int(ext.shard[0])], marker, int(ext.offset[0]))
        written = dict(cache.writer.stats)
        before = cache.stats.fetched_bytes
        rest = np.setdiff1d(np.arange(16), [5, 9])
        cache.ensure(rest, max_gap=1 << 20, span_present=True)  # one run over all 16, crossing 5 and 9
        fetched = cache.stats.fetched_bytes - before
        rewritten = sum(cache.writer.stats[k] - written[k] for k in ("direct_bytes", "buffered_bytes"))
        assert cache.stats.skipped_bytes == int(ext.length.sum())
        assert rewritten == fetched - int(ext.length.sum())
        assert cache.present.all()
        assert os.pread(cache._fds[int(ext.shard[0])], len(marker), int(ext.offset[0])) == marker
        assert all(ds.read(int(i)) == local.read(int(i)) for i in rest.tolist() + [9])
