"""Faults of the bucket tier against a real SeaweedFS: the server killed mid-epoch and restarted, slow-downs, 5xx
and delays injected by a proxy in front of it, objects replaced or corrupt in the bucket, missing objects, buckets
and wrong keys, a corrupt cache file, and a process killed between writing a sample into the cache and marking
it."""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import obstore
import pytest

from foresight.bucket import BucketURL, RetryPolicy
from foresight.bucket.config import open_store
from foresight.bucket.dataset import local_dir_of
from foresight.bucket.upload import upload_dataset
from foresight.errors import BucketError
from foresight import open_dataset
from foresight.format import DatasetWriter
from foresight.loader import Loader
from foresight.plan import build_plan
from foresight.testing.http_faults import Fault, FaultProxy
from full_disk import full_disk, small_ext4  # noqa: F401  (fixtures)
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)

PATIENT = RetryPolicy(attempts=100, budget_s=120, base_s=0.05, max_backoff_s=0.5)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("faults") / "d"
    with DatasetWriter(str(path), align=4096, shard_bytes=120_000) as w:
        for _ in range(64):
            w.add(rng.integers(0, 256, size=int(rng.integers(100, 7000)), dtype=np.uint8).tobytes(), modality="bytes")
    return open_dataset(str(path))


def _samples(batch):
    data = batch["data"].numpy()
    return [data[o:o + n].tobytes() for o, n in zip(batch["offsets"].numpy(), batch["lengths"].numpy())]


def test_server_killed_mid_epoch_then_restarted(s3_env, tmp_path, local, caplog):
    upload_dataset(local.path, "s3://faults/restart")
    plan = build_plan([(local, 1.0)], seed=9, global_batch_size=8, num_steps=16)
    with Loader(local, plan) as loader:
        want = {b.step: _samples(b) for b in loader}
    # no gap merging: each step fetches its own samples only, so the steps after the kill still need the server
    ds = open_dataset("s3://faults/restart", cache_dir=tmp_path / "cache", retry=PATIENT, max_gap=0)
    restarted = threading.Event()
    absent_at_kill = []

    def restart_once_a_request_failed():
        for _ in range(600):  # bounded: 60 s of polls
            if ds.fetcher.stats.retries:
                break
            threading.Event().wait(0.1)
        s3_env.start()
        restarted.set()

    def on_step(info):
        if info["step"] == 3 and s3_env.proc is not None:
            s3_env.stop()  # SIGKILL, mid-epoch: later steps' samples are not cached yet
            absent_at_kill.append(int((ds.cache.present == 0).sum()))
            threading.Thread(target=restart_once_a_request_failed, daemon=True).start()

    got = {}
    try:
        with caplog.at_level(logging.WARNING, logger="foresight.bucket"), \
                Loader(ds, plan, prefetch=1, on_step=on_step) as loader:
            for b in loader:
                got[b.step] = _samples(b)
        assert absent_at_kill[0] > 0 and restarted.wait(60)
        assert got == want  # nothing repeated, lost or changed
        assert ds.fetcher.stats.retries >= 1
        assert any("retry" in r.getMessage() for r in caplog.records)
        assert not any(s3_env.secret_key in r.getMessage() for r in caplog.records)
    finally:
        if s3_env.proc is None:
            s3_env.start()
        ds.close()


def test_object_replaced_after_the_plan_was_built_is_refused(s3_env, tmp_path, local):
    url = BucketURL.parse("s3://faults/replaced")
    upload_dataset(local.path, url)
    ds = open_dataset(str(url), cache_dir=tmp_path / "cache")
    try:
        plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=8, num_steps=4)
        shard = os.path.basename(ds.shard_paths[0])
        with open(os.path.join(local.path, shard), "rb") as f:
            data = bytearray(f.read())
        data[10] ^= 0xFF
        obstore.put(open_store(url), url.key(shard), bytes(data))  # same size, new ETag
        with pytest.raises(BucketError) as e:
            with Loader(ds, plan) as loader:
                for _ in loader:
                    pass
        assert e.value.reason == "changed" and f"{url}/{shard}" in str(e.value)
        assert not ds.cache.present[:ds.manifest.shards[0].num_samples].any()  # nothing of it marked
    finally:
        ds.close()


def test_object_whose_bytes_do_not_match_the_map_is_refused(s3_env, tmp_path, local):
    """A shard uploaded with wrong bytes (same size, so the ETag is all the client sees): the map's xxh3 catches it."""
    url = BucketURL.parse("s3://faults/corrupt-object")
    upload_dataset(local.path, url)
    shard = os.path.basename(local.shard_paths[0])
    with open(local.shard_paths[0], "rb") as f:
        data = bytearray(f.read())
    ext = local.lookup(np.array([2]))
    data[int(ext.offset[0])] ^= 0x01
    obstore.put(open_store(url), url.key(shard), bytes(data))  # before the dataset is opened: its ETag is recorded
    with open_dataset(str(url), cache_dir=tmp_path / "cache") as ds:
        ds.lookup(np.array([0, 1]))  # the other samples of the object are fine
        with pytest.raises(BucketError) as e:
            ds.lookup(np.array([2, 3]))
        assert e.value.reason == "checksum" and f"{url}/{shard}" in str(e.value) and "sample 2" in str(e.value)
        assert ds.cache.present[[0, 1]].all() and not ds.cache.present[[2, 3]].any()


def test_missing_dataset_bucket_and_wrong_keys_at_open(s3_env, tmp_path, local, monkeypatch):
    upload_dataset(local.path, "s3://faults/keys")
    quick = RetryPolicy(attempts=2, budget_s=5)
    cases = [("s3://faults/nothing-here", "dataset not found", "s3://faults/nothing-here"),
             ("s3://no-bucket-of-ours/x", "bucket not found", "no-bucket-of-ours")]
    for url, what, named in cases:
        with pytest.raises(BucketError) as e:
            open_dataset(url, cache_dir=tmp_path / "cache", retry=quick)
        text = str(e.value)
        assert what in text and named in text and "\n" not in text and s3_env.secret_key not in text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-right-secret-42")
    with pytest.raises(BucketError) as e:
        open_dataset("s3://faults/keys", cache_dir=tmp_path / "cache2", retry=quick)
    text = str(e.value)
    assert e.value.reason == "denied" and "\n" not in text
    assert "not-the-right-secret-42" not in text and s3_env.secret_key not in text


def test_corrupt_cache_file_is_detected_and_refetched(s3_env, tmp_path, local):
    upload_dataset(local.path, "s3://faults/scrub")
    with open_dataset("s3://faults/scrub", cache_dir=tmp_path / "cache") as ds:
        ids = np.arange(10)
        ds.lookup(ids)
        ext = ds.lookup(np.array([4]))
        with open(ds.shard_paths[int(ext.shard[0])], "r+b") as f:  # a bad disk block, a stray write
            f.seek(int(ext.offset[0]) + 1)
            f.write(b"\x00\xff")
        assert ds.cache.scrub().tolist() == [4] and ds.cache.stats.corrupt == 1
        before = ds.cache.stats.misses
        ds.lookup(ids)
        assert ds.cache.stats.misses == before + 1
        assert all(ds.read(i) == local.read(i) for i in ids.tolist())
        assert ds.cache.scrub().size == 0


def test_a_damaged_cache_copy_is_laid_out_anew(s3_env, tmp_path, local, caplog):
    """A kept copy whose files were cut short or removed (a crash, a hand, a disk cleaner), or whose state.json
    another version wrote: the next open lays it out anew (logged), never a permanent error until the directory is
    deleted by hand, never bytes read past a cut."""
    upload_dataset(local.path, "s3://faults/damaged")
    cache = tmp_path / "cache"
    index = os.path.join(".foresight-cache")

    def shard(path):
        return os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".bin"))[0])

    def state(path):  # another version's state.json: a key of this one missing
        name = os.path.join(path, index, "state.json")
        with open(name) as f:
            doc = json.load(f)
        doc.pop("shards")
        with open(name, "w") as f:
            json.dump(doc, f)

    damages = {
        "shard cut short": lambda p: os.truncate(shard(p), os.path.getsize(shard(p)) // 2),
        "shard removed": lambda p: os.unlink(shard(p)),
        "map removed": lambda p: os.unlink(os.path.join(p, sorted(n for n in os.listdir(p) if ".map" in n)[0])),
        "manifest removed": lambda p: os.unlink(os.path.join(p, "manifest.json")),
        "index cut short": lambda p: os.truncate(os.path.join(p, index, "present"), 3),
        "index removed": lambda p: os.unlink(os.path.join(p, index, "present")),
        "state of another version": state,
    }
    for what, damage in damages.items():
        with open_dataset("s3://faults/damaged", cache_dir=cache) as ds:
            ds.lookup(np.arange(ds.num_samples))
            path = ds.path
        damage(path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="foresight.bucket"):
            with open_dataset("s3://faults/damaged", cache_dir=cache) as ds:
                assert not ds.cache.present.any(), what  # nothing kept of a damaged copy
                ds.lookup(np.arange(ds.num_samples))
                assert all(ds.read(i) == local.read(i) for i in range(ds.num_samples)), what
        assert "damaged" in caplog.text and "laid out anew" in caplog.text, what


def test_process_killed_between_write_and_mark_leaves_no_torn_entry(s3_env, tmp_path, local):
    upload_dataset(local.path, "s3://faults/torn")
    cache = tmp_path / "cache"
    # the child dies (os._exit, as a SIGKILL would leave it) once it has written samples into the sparse file,
    # before it marks them present
    code = ("import os, numpy as np\n"
            "from foresight import open_dataset\n"
            "ds = open_dataset('s3://faults/torn', cache_dir=os.environ['CACHE'])\n"
            "write = os.pwrite\n"
            "os.pwrite = lambda fd, data, offset: (write(fd, data, offset), os._exit(9))\n"
            "ds.lookup(np.arange(20))\n")
    child = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CACHE=str(cache)), timeout=120,
                           capture_output=True)
    assert child.returncode == 9, child.stderr.decode()[-2000:]
    with open_dataset("s3://faults/torn", cache_dir=cache) as ds:
        assert not ds.cache.present.any()  # written but never marked: not served
        ds.lookup(np.arange(20))  # its record locks died with it: no wait, a clean refetch
        assert ds.cache.stats.misses == 20
        assert all(ds.read(i) == local.read(i) for i in range(20))


def test_server_down_past_the_retry_budget_names_the_object(s3_env, tmp_path, local):
    upload_dataset(local.path, "s3://faults/down")
    ds = open_dataset("s3://faults/down", cache_dir=tmp_path / "cache",
                      retry=RetryPolicy(attempts=3, budget_s=30, base_s=0.01, max_backoff_s=0.05))
    try:
        s3_env.stop()
        with pytest.raises(BucketError) as e:
            ds.lookup(np.array([0]))
        text = str(e.value)
        assert e.value.reason == "unavailable" and "after 3 attempts" in text and "s3://faults/down/" in text
        assert "\n" not in text and s3_env.secret_key not in text
        assert ds.fetcher.stats.retries == 2 and not ds.cache.present.any()
    finally:
        s3_env.start()
        ds.close()


def test_full_cache_disk_fails_clearly_and_frees_what_it_wrote(s3_env, full_disk):
    rng = np.random.default_rng(8)
    path = full_disk.parent / "big"
    with DatasetWriter(str(path), align=4096, shard_bytes=1 << 20) as w:
        for _ in range(120):
            w.add(rng.integers(0, 256, size=int(rng.integers(9000, 16000)), dtype=np.uint8).tobytes(),
                  modality="bytes")
    big = open_dataset(str(path))
    upload_dataset(big.path, "s3://faults/full")
    with open_dataset("s3://faults/full", cache_dir=full_disk) as ds:  # the 1 MiB disk holds maps, not the data
        with pytest.raises(BucketError) as e:
            ds.lookup(np.arange(120))
        assert e.value.reason == "cache_full" and str(full_disk) in str(e.value)
        # each GET is checked, written and marked as it lands: those that fit stay (whole, checked); the one the
        # disk refused (or wrote short) is not marked and gave its blocks back
        marked = np.flatnonzero(ds.cache.present)
        assert marked.size < 120 and all(ds.read(int(i)) == big.read(int(i)) for i in marked)
        ds.cache.evict(marked)
        assert os.statvfs(full_disk).f_bfree * os.statvfs(full_disk).f_frsize >= int(big.sample_bytes()[:10].sum())
        ds.lookup(np.arange(10))  # nothing of the failed fetch is left: a smaller one fits
        assert all(ds.read(i) == big.read(i) for i in range(10))
    del ds, e  # the maps and the index are mapped from the small disk until collected (it is unmounted next)
    gc.collect()


@pytest.fixture
def proxy(s3_env):
    """A fault proxy in front of the server, made the endpoint of every client opened after it (uploads first)."""
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"])) as p:
        yield p


def _through(proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)


def test_slowdowns_and_5xx_are_retried_to_identical_batches(s3_env, proxy, monkeypatch, tmp_path, local, caplog):
    upload_dataset(local.path, "s3://faults/slowdown")
    plan = build_plan([(local, 1.0)], seed=4, global_batch_size=8, num_steps=16)
    with Loader(local, plan) as loader:
        want = {b.step: _samples(b) for b in loader}
    data = r"^/faults/slowdown/.*\.bin"
    proxy.faults = [Fault(503, path=data, fraction=0.3, seed=1), Fault(500, path=data, fraction=0.2, seed=2)]
    _through(proxy, monkeypatch)
    ds = open_dataset("s3://faults/slowdown", cache_dir=tmp_path / "cache", max_gap=0,
                      retry=RetryPolicy(attempts=30, budget_s=120, base_s=0.001, max_backoff_s=0.01))
    try:
        with caplog.at_level(logging.WARNING, logger="foresight.bucket"), Loader(ds, plan, prefetch=2) as loader:
            got = {b.step: _samples(b) for b in loader}
        assert got == want
        failed = proxy.seen(path=data, injected=True)
        served = proxy.seen(path=data, injected=False)
        assert {r.status for r in failed} == {503, 500} and all(r.status == 206 for r in served)
        # every failure was one retry, and every retry followed a failure: nothing else was fetched twice
        assert ds.fetcher.stats.retries == len(failed)
        assert len({(r.path, r.range) for r in served}) == len(served)
        assert {(r.path, r.range) for r in failed} <= {(r.path, r.range) for r in served}
        assert sum(r.nbytes for r in served) == ds.cache.stats.fetched_bytes
        assert sum("retry" in r.getMessage() for r in caplog.records) == len(failed)
        assert not any(s3_env.secret_key in r.getMessage() for r in caplog.records)
    finally:
        ds.close()


def test_retries_back_off_by_the_policy(s3_env, proxy, monkeypatch, tmp_path, local, caplog):
    upload_dataset(local.path, "s3://faults/backoff")
    _through(proxy, monkeypatch)
    policy = RetryPolicy(attempts=8, budget_s=60, base_s=0.004, max_backoff_s=0.02)
    with open_dataset("s3://faults/backoff", cache_dir=tmp_path / "cache", retry=policy) as ds:
        shard = os.path.basename(ds.shard_paths[0])
        proxy.faults = [Fault(503, path=f"/{shard}$", times=5)]
        with caplog.at_level(logging.WARNING, logger="foresight.bucket"):
            ds.lookup(np.array([0]))
        assert ds.read(0) == local.read(0)
    attempts = proxy.seen(path=f"/{shard}$")
    assert [r.status for r in attempts] == [503] * 5 + [206]  # 5 slow-downs, then the same range served
    assert len({r.range for r in attempts}) == 1
    waits = [r.args[3] for r in caplog.records if "retry" in r.getMessage()]
    assert [r.args[2] for r in caplog.records if "retry" in r.getMessage()] == [1, 2, 3, 4, 5]
    for k, wait in enumerate(waits):  # exponential, capped, jittered into [0.5, 1] of the step
        step = min(policy.max_backoff_s, policy.base_s * 2 ** k)
        assert 0.5 * step <= wait <= step
    assert waits[2] > policy.base_s  # it grew past the first step (the third wait is at least 2x base)


def test_slowdown_past_the_retry_budget_names_the_object(s3_env, proxy, monkeypatch, tmp_path, local, caplog):
    url = BucketURL.parse("s3://faults/slow-forever")
    upload_dataset(local.path, url)
    _through(proxy, monkeypatch)
    policy = RetryPolicy(attempts=4, budget_s=60, base_s=0.001, max_backoff_s=0.01)
    with open_dataset(str(url), cache_dir=tmp_path / "cache", retry=policy) as ds:
        shard = os.path.basename(ds.shard_paths[0])
        proxy.faults = [Fault(503, path=f"/{shard}$")]
        with caplog.at_level(logging.WARNING, logger="foresight.bucket"), pytest.raises(BucketError) as e:
            ds.lookup(np.array([0]))
        assert not ds.cache.present.any()
    text = str(e.value)
    assert e.value.reason == "unavailable" and f"{url}/{shard}" in text and "after 4 attempts" in text
    assert "HTTP 503 SlowDown: Please reduce your request rate." in text  # the server's answer, not the client's dump
    assert "\n" not in text and s3_env.secret_key not in text
    assert not any(s3_env.secret_key in r.getMessage() for r in caplog.records)
    assert proxy.count(path=f"/{shard}$", injected=True) == 4 and proxy.count(path=f"/{shard}$", injected=False) == 0


def test_a_request_slower_than_its_timeout_is_retried(s3_env, proxy, monkeypatch, tmp_path, local):
    upload_dataset(local.path, "s3://faults/delayed")
    _through(proxy, monkeypatch)
    policy = RetryPolicy(attempts=4, budget_s=60, base_s=0.001, max_backoff_s=0.01, request_timeout_s=0.5)
    with open_dataset("s3://faults/delayed", cache_dir=tmp_path / "cache", retry=policy) as ds:
        shard = os.path.basename(ds.shard_paths[0])
        proxy.faults = [Fault(0, path=f"/{shard}$", times=1, delay_s=3.0)]  # forwarded, 6 timeouts late
        ds.lookup(np.array([0, 1]))
        assert ds.read(0) == local.read(0) and ds.read(1) == local.read(1)
        assert ds.fetcher.stats.retries == 1
    # the retry was served, and the late one forwarded after its delay (to a client that had given up on it)
    assert proxy.wait_for(2, path=f"/{shard}$") == 2


def test_first_open_after_a_reboot_rehashes_the_marked_samples(s3_env, tmp_path, local):
    """Marks are made once bytes are written (not synced): a machine crash may lose bytes whose marks reached the
    disk. The cache records the boot it was used in; the first open in another boot re-hashes what is marked."""
    upload_dataset(local.path, "s3://faults/reboot")
    cache = tmp_path / "cache"
    with open_dataset("s3://faults/reboot", cache_dir=cache) as ds:
        ds.lookup(np.arange(10))
        boot = os.path.join(ds.path, ".foresight-cache", "boot_id")
        with open(boot) as f:
            recorded = f.read()
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert recorded == f.read().strip()
        ext = ds.cache.lookup(np.array([3]))
        with open(ds.shard_paths[int(ext.shard[0])], "r+b") as f:  # what a lost write leaves: zeros
            f.seek(int(ext.offset[0]))
            f.write(bytes(int(ext.length[0])))
    with open_dataset("s3://faults/reboot", cache_dir=cache) as ds:  # the same boot: nothing re-hashed
        assert ds.cache.present[:10].all() and ds.cache.stats.corrupt == 0
    with open(boot, "w") as f:
        f.write("another-boot")
    with open_dataset("s3://faults/reboot", cache_dir=cache) as ds:
        assert ds.cache.stats.corrupt == 1 and ds.cache.present.nonzero()[0].tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]
        ds.lookup(np.arange(10))
        assert all(ds.read(i) == local.read(i) for i in range(10))
    with open(boot) as f:
        assert f.read() != "another-boot"


def test_full_cache_disk_during_the_layout_names_the_cache_and_leaves_no_temp_file(s3_env, full_disk, tmp_path):
    """The maps fetched whole at open do not fit the cache disk: a one-line cache_full error naming the cache
    directory (a bare ``[Errno 28]`` named no file), no temporary file left behind; once there is room, the same
    open lays the copy out and reads it."""
    rng = np.random.default_rng(9)
    path = tmp_path / "many"
    lengths = rng.integers(1, 8, size=120_000)
    with DatasetWriter(str(path), align=0, token_dtype="uint16", shard_bytes=1 << 30) as w:
        w.add_many(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
    many = open_dataset(str(path))
    assert sum(os.path.getsize(os.path.join(many.path, n)) for n in os.listdir(many.path) if ".map" in n) > 1 << 20
    upload_dataset(many.path, "s3://faults/many-maps")
    with pytest.raises(BucketError) as e:
        open_dataset("s3://faults/many-maps", cache_dir=full_disk)
    text = str(e.value)
    assert e.value.reason == "cache_full" and str(full_disk) in text and "\n" not in text
    left = [os.path.join(d, n) for d, _, names in os.walk(full_disk) for n in names]
    assert not [p for p in left if ".tmp-" in p], left
    with open_dataset("s3://faults/many-maps", cache_dir=tmp_path / "roomy") as ds:
        assert ds.read(7) == many.read(7)
    gc.collect()


def test_a_cache_place_holding_files_it_did_not_lay_out_is_left_alone(s3_env, tmp_path, local):
    """The cache directory's ``bucket/prefix`` place already holds a local copy of a dataset with the same name (put
    there by hand): the open refuses naming it and removes none of its files; a layout of its own that was cut short
    (the index directory made first) is laid out again as before."""
    upload_dataset(local.path, "s3://faults/same-name")
    cache = tmp_path / "cache"
    place = Path(local_dir_of(BucketURL.parse("s3://faults/same-name"), cache))  # the environment's endpoint's place
    place.parent.mkdir(parents=True)
    shutil.copytree(local.path, place)
    before = sorted(os.listdir(place))
    with pytest.raises(BucketError) as e:
        open_dataset("s3://faults/same-name", cache_dir=cache)
    assert e.value.reason == "cache" and str(place) in str(e.value) and "\n" not in str(e.value)
    assert sorted(os.listdir(place)) == before
    with open_dataset("s3://faults/same-name", cache_dir=tmp_path / "other") as ds:
        path = ds.path
    os.unlink(os.path.join(path, ".foresight-cache", "state.json"))  # a layout cut short: ours, laid out again
    with open_dataset("s3://faults/same-name", cache_dir=tmp_path / "other") as ds:
        assert ds.read(5) == local.read(5)


def test_marking_a_sample_on_a_full_cache_disk_never_kills_the_process(s3_env, small_ext4, tmp_path):
    """The index of present samples is a shared mapping of its file: a mark landing on a page of it that holds no
    block yet needs one from the disk, and on a full disk the kernel answers that store with SIGBUS (the process
    dies without a word). Here a sample's bytes are already in its shard file (a process killed between writing
    and marking them) and the disk fills up; refetching it writes in place and marks it: that must work (the
    index holds its blocks from the layout on), never kill the process."""
    from seaweed_helpers import token_dataset

    many = token_dataset(tmp_path / "many", docs=12_000, max_len=4, shard_bytes=1 << 30, seed=3)
    upload_dataset(many.path, "s3://faults/marks")
    code = ("import os, numpy as np\n"
            "from foresight import open_dataset\n"
            "ds = open_dataset('s3://faults/marks', cache_dir=os.environ['CACHE'])\n"
            "i = 9000  # its mark lies on the index's third page\n"
            "ext = ds.cache.lookup(np.array([i]))  # where it lies (the local reader's lookup: no fetch)\n"
            "with open(ds.shard_paths[int(ext.shard[0])], 'r+b') as f:  # written, never marked\n"
            "    f.seek(int(ext.offset[0])); f.write(bytes.fromhex(os.environ['BYTES']))\n"
            "with open(os.path.join(os.environ['CACHE'], 'filler'), 'wb', buffering=0) as f:  # the disk fills\n"
            "    try:\n"
            "        while True: f.write(bytes(4096))\n"
            "    except OSError: pass\n"
            "ds.lookup(np.array([i]))\n"
            "assert ds.read(i) == bytes.fromhex(os.environ['BYTES'])\n"
            "print('ok')\n")
    child = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True,
                           env=dict(os.environ, CACHE=str(small_ext4), BYTES=many.read(9000).hex()))
    assert child.returncode == 0 and b"ok" in child.stdout, (child.returncode, child.stderr.decode()[-2000:])


def test_a_copy_laid_out_anew_never_shares_marks_with_a_reader_of_the_old_one(s3_env, tmp_path, local):
    """The dataset's manifest is uploaded again (here: the same dataset, the manifest's bytes changed, its shard
    objects and their ETags unchanged) while a reader (another job's loader, a node's open dataset) still has
    the old copy open, and a new open lays the copy out anew. The old reader's marks must not land in the new
    copy's index (they would say present samples whose bytes the new sparse files never got: zeros served as
    data), and the old reader, whose reads by path now reach the new files, is refused by name instead of
    serving what its old index says is there."""
    url = BucketURL.parse("s3://faults/relayout")
    upload_dataset(local.path, url)
    cache = tmp_path / "cache"
    old = open_dataset(str(url), cache_dir=cache)
    try:
        old.lookup(np.arange(3))  # present in the old copy
        index_dir = os.path.join(old.path, ".foresight-cache")
        with open(os.path.join(index_dir, "present.tmp-999999"), "wb") as f:  # what a layout killed midway leaves
            f.write(bytes(local.num_samples))
        with open(os.path.join(local.path, "manifest.json"), "rb") as f:
            raw = f.read()
        obstore.put(open_store(url), url.key("manifest.json"), raw + b"\n")  # a new ETag, the same dataset
        with open_dataset(str(url), cache_dir=cache) as new:  # laid out anew (the old reader is still open)
            for ids in (np.arange(3), np.arange(5)):  # present in its index / to be fetched
                with pytest.raises(BucketError) as e:
                    old.lookup(ids)
                assert e.value.reason == "changed" and "laid out anew" in str(e.value), str(e.value)
            assert not new.cache.present.any()  # nothing the old reader did is marked here
            assert not [n for n in os.listdir(index_dir) if ".tmp-" in n]  # the killed layout's leftovers went
            new.lookup(np.arange(8))
            assert all(new.read(i) == local.read(i) for i in range(8))
    finally:
        old.close()
