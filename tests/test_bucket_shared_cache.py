"""A budgeted bucket cache shared by several processes (the ranks of one host) against a real SeaweedFS: no process
evicts a sample another one is about to read or is reading (eviction pins shared through the cache directory), and
a killed process's pins do not block eviction."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from foresight import open_dataset
from foresight.bucket.cache import INDEX_DIR
from foresight.bucket.pins import SamplePins
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.bucket.upload import upload_dataset
from foresight.format import DatasetWriter
from foresight.plan import build_plan
from foresight.testing.http_faults import Fault, FaultProxy
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)

CHILD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("shared") / "d"
    with DatasetWriter(str(path), align=4096, shard_bytes=400_000) as w:
        for _ in range(400):
            w.add(rng.integers(0, 256, size=int(rng.integers(1000, 9000)), dtype=np.uint8).tobytes(),
                  modality="bytes")
    return open_dataset(str(path))


# A rank of one host: its PlanPrefetcher (budget on the shared cache) and Loader with verify=True over the plan,
# every sample also compared with the local copy's bytes; prints its counters as one JSON line.
RANK = """
import json, os, sys
import numpy as np
from foresight import open_dataset
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.loader import Loader
from foresight.plan import build_plan

rank, budget = int(sys.argv[1]), int(sys.argv[2])
local = open_dataset(os.environ["LOCAL"])
ds = open_dataset(os.environ["URL"], cache_dir=os.environ["CACHE"])
plan = build_plan([(local, 1.0)], seed=3, global_batch_size=16, num_steps=int(os.environ["STEPS"]))
checked = 0
with PlanPrefetcher(ds, plan, rank=rank, world_size=2, lookahead=4, budget_bytes=budget) as pf, \\
        Loader(ds, plan, rank=rank, world_size=2, prefetch=2, verify=True, on_step=pf.on_step) as loader:
    for batch in loader:
        data = batch["data"].numpy()
        for i, o, n in zip(np.asarray(batch["sample_ids"]), batch["offsets"].numpy(), batch["lengths"].numpy()):
            assert data[o:o + n].tobytes() == local.read(int(i)), (batch.step, int(i))
            checked += 1
print(json.dumps({"checked": checked, "evicted": pf.stats["evicted_samples"],
                  "pinned_skips": ds.cache.stats.pinned_skips, "error": repr(pf.error)}), flush=True)
"""

# Pins a PlanPrefetcher's first window on the shared cache, prints the pinned ids, then waits to be killed.
PINNER = """
import json, os, sys
from foresight import open_dataset
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.plan import build_plan

ds = open_dataset(os.environ["URL"], cache_dir=os.environ["CACHE"])
plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=8, num_steps=10)
pf = PlanPrefetcher(ds, plan, lookahead=3)
print(json.dumps(pf.pinned.tolist()), flush=True)
sys.stdin.read()
"""


def _env(url, cache, **more):
    return dict(os.environ, URL=url, CACHE=str(cache), **{k: str(v) for k, v in more.items()})


def test_a_budgeted_cache_shared_by_two_ranks_serves_every_byte_right(s3_env, tmp_path, local):
    url = "s3://shared/ranks"
    upload_dataset(local.path, url)
    budget = int(local.sample_bytes().sum()) // 5  # 20% of the dataset for both ranks together
    env = _env(url, tmp_path / "cache", LOCAL=local.path, STEPS=60)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(budget)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results = []
    for p in ranks:
        out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["checked"] for r in results] == [60 * 8, 60 * 8]
    assert all(r["error"] == "None" and r["evicted"] > 0 for r in results)
    # each rank's eviction order puts the other's samples first (never used again by its own share of the plan):
    # the other's window was there to be taken, and was left alone
    assert sum(r["pinned_skips"] for r in results) > 0


def test_a_sample_another_process_pins_is_never_evicted_until_it_dies(s3_env, tmp_path, local):
    url = "s3://shared/pinned"
    upload_dataset(local.path, url)
    cache = tmp_path / "cache"
    with open_dataset(url, cache_dir=cache) as ds:
        everything = np.arange(ds.num_samples)
        ds.lookup(everything)
        pinner = subprocess.Popen([sys.executable, "-c", PINNER], env=_env(url, cache), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = pinner.stdout.readline()
            assert line, pinner.stderr.read()[-3000:]
            pinned = np.array(json.loads(line), dtype=np.int64)
            assert pinned.size > 0
            ds.cache.evict(everything)  # a budgeted rank of this host wanting the whole cache back
            assert np.flatnonzero(ds.cache.present).tolist() == pinned.tolist()
            assert ds.cache.stats.pinned_skips == pinned.size
            ext = ds.lookup(pinned)  # present: no fetch, and the bytes the other process reads are intact
            assert ds.cache.stats.misses == ds.num_samples
            for i in pinned.tolist():
                assert ds.read(i) == local.read(i)
            del ext
        finally:
            pinner.send_signal(signal.SIGKILL)
            pinner.wait(60)
            pinner.stdout.close()
            pinner.stderr.close()
            pinner.stdin.close()
        # its pins died with it: nothing is left that eviction must skip
        assert ds.cache.evict(everything) > 0
        assert not ds.cache.present.any() and ds.cache.stats.pinned_skips == pinned.size


def test_pins_of_one_process_hold_against_its_own_evictor_and_move_without_a_gap(s3_env, tmp_path, local):
    url = "s3://shared/own"
    upload_dataset(local.path, url)
    with open_dataset(url, cache_dir=tmp_path / "cache") as ds:
        ds.lookup(np.arange(40))
        pins = ds.cache.pins()
        try:
            pins.hold(np.arange(0, 10))
            pins.hold(np.arange(5, 15))  # 5..9 stay pinned throughout; 0..4 let go
            assert ds.cache.evict(np.arange(40)) > 0
            assert np.flatnonzero(ds.cache.present).tolist() == list(range(5, 15))
            other = SamplePins(os.path.join(ds.path, ".foresight-cache"))
            other.hold(np.arange(12, 20))  # shared pins do not exclude each other
            pins.hold(np.zeros(0, np.int64))
            ds.cache.evict(np.arange(40))
            assert np.flatnonzero(ds.cache.present).tolist() == [12, 13, 14]
            other.close()
            ds.cache.evict(np.arange(40))
            assert not ds.cache.present.any()
        finally:
            pins.close()


def test_the_prefetcher_pins_its_window_and_lets_go_as_the_consumer_moves(s3_env, tmp_path, local):
    url = "s3://shared/window"
    upload_dataset(local.path, url)
    with open_dataset(url, cache_dir=tmp_path / "cache") as ds:
        plan = build_plan([(ds, 1.0)], seed=2, global_batch_size=8, num_steps=12)
        with PlanPrefetcher(ds, plan, lookahead=3) as pf:
            assert pf.pinned.tolist() == np.unique(pf.acc.ids[:pf.acc.ptr[3]]).tolist()
            pf.on_step(4)
            assert pf.pinned.tolist() == np.unique(pf.acc.ids[pf.acc.ptr[5]:pf.acc.ptr[8]]).tolist()
        assert pf.pinned.size == 0
        pf.on_step(6)  # a loader's last hook after the prefetcher closed: nothing to pin, no error



# A process sharing the cache that fetches the given samples itself, one GET at a time (each delayed by the test's
# proxy): it holds their locks while its GETs land one after another.
FETCH_ALONE = """
import os, sys
import numpy as np
from foresight import open_dataset

ids = np.array([int(a) for a in sys.argv[1:]], dtype=np.int64)
ds = open_dataset(os.environ["URL"], cache_dir=os.environ["CACHE"], concurrency=1, max_gap=0)
ds.lookup(ids)
print("fetched", ds.cache.stats.misses, flush=True)
"""


@contextlib.contextmanager
def _fetched_by_another_process(s3_env, local, tmp_path, monkeypatch, url):
    """``(ds, ids, other)``: this process's dataset over ``url`` and a process sharing its cache that is fetching
    ``ids`` (16 samples, a GET each, every GET delayed 0.25 s by a proxy): it holds their locks from now on."""
    upload_dataset(local.path, url)
    ids = np.arange(0, 64, 4, dtype=np.int64)  # holes between them: a GET each at max_gap 0
    cache = str(tmp_path / "cache")
    bucket = url.split("/")[2]
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"]),
                    [Fault(status=0, path=rf"^/{bucket}/.*\.bin", delay_s=0.25)]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with open_dataset(url, cache_dir=cache) as ds:
            env = dict(os.environ, URL=url, CACHE=cache)
            other = subprocess.Popen([sys.executable, "-c", FETCH_ALONE, *map(str, ids.tolist())], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                index = os.open(os.path.join(ds.cache.local_dir, INDEX_DIR, "present"), os.O_RDWR)
                try:
                    for _ in range(6000):  # until the other process holds the first sample's lock
                        try:
                            fcntl.lockf(index, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(ids[0]), os.SEEK_SET)
                        except OSError:
                            break
                        fcntl.lockf(index, fcntl.LOCK_UN, 1, int(ids[0]), os.SEEK_SET)
                        assert other.poll() is None, other.communicate()
                        threading.Event().wait(0.01)
                finally:
                    os.close(index)
                yield ds, ids, other
            finally:
                if other.poll() is None:
                    other.kill()
                    other.wait()


def _same_bytes(ds, local, ids, ext) -> None:
    for i, s in enumerate(ids.tolist()):
        with open(ds.shard_paths[int(ext.shard[i])], "rb") as f:
            f.seek(int(ext.offset[i]))
            assert f.read(int(ext.length[i])) == local.read(s)


def test_a_lookup_behind_another_process_fetch_of_its_samples_finds_them(s3_env, local, tmp_path, monkeypatch):
    """A lookup of samples another process sharing the cache is fetching waits on their locks, then finds every
    one present and returns them (before: the fetch it then made of nothing raised IndexError)."""
    with _fetched_by_another_process(s3_env, local, tmp_path, monkeypatch, "s3://shared/behind") as (ds, ids, other):
        ext = ds.lookup(ids)
        out, err = other.communicate(timeout=CHILD_TIMEOUT_S)
        assert other.returncode == 0, err
        assert out.split() == ["fetched", str(ids.size)] and ds.cache.stats.misses == 0
        _same_bytes(ds, local, ids, ext)


def test_a_claimed_lookup_waits_while_another_process_fetches_those_samples(s3_env, local, tmp_path, monkeypatch):
    """The claim's owner (a prefetcher) waits on the locks of samples another process sharing the cache is
    fetching, GET after GET: the lookup waiting on the claim sees no GET of its own process land, but that
    process's marks in the shared index, and waits on until the samples are there (before: it raised after
    ``wait_s`` with no GET landing here, while the other process's GETs landed every quarter of that wait)."""
    with _fetched_by_another_process(s3_env, local, tmp_path, monkeypatch, "s3://shared/claimwait") as \
            (ds, ids, other):
        claim = ds.cache.claim(lambda: None, wait_s=1.0)
        claim.set(ids)
        owned = {}
        owner = threading.Thread(target=lambda: owned.update(n=ds.cache.ensure(ids, claim=claim)))
        owner.start()  # waits on the other process's locks
        try:
            ext = ds.lookup(ids)  # waits on the claim
        finally:
            owner.join(CHILD_TIMEOUT_S)
            claim.release()
        out, err = other.communicate(timeout=CHILD_TIMEOUT_S)
        assert other.returncode == 0, err
        assert out.split() == ["fetched", str(ids.size)] and owned == {"n": 0}
        assert ds.cache.stats.claim_waits == ids.size
        _same_bytes(ds, local, ids, ext)
