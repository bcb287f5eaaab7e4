"""``s3://bucket/prefix`` wherever a path is accepted, against a real SeaweedFS: ``foresight plan`` over bucket
datasets with the plan written to a bucket and read back by ``Loader("s3://...")``, ``foresight pack ... s3://``,
a Megatron ``.idx``/``.bin`` pair read in place from a bucket, ``foresight inspect s3://...``; and the one-line
errors of a missing prefix, a prefix that holds no dataset or plan, an upload over an existing one."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import threading

import numpy as np
import obstore
import pytest

from foresight import open_dataset
from foresight.bucket import BucketDataset, BucketURL
from foresight.bucket.config import open_store
from foresight.bucket.dataset import BucketMegatronDataset, local_dir_of
from foresight.bucket.fetch import RangedFetcher
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.bucket.upload import upload_dataset, upload_dir
from foresight.errors import BucketError, FormatError
from foresight.format import DatasetWriter, write_megatron_dataset
from foresight.loader import Loader
from foresight.plan import build_plan, load_plan
from cli_helpers import run_cli
from seaweed_helpers import s3_env, seaweed, token_dataset  # noqa: F401  (fixtures)

PLAN_ARGS = ["--seed", "5", "--global-batch-size", "8", "--seq-len", "24", "--steps", "10"]


def _token_dataset(path, *, seed=0):
    return token_dataset(path, docs=200, max_len=120, shard_bytes=20_000, seed=seed)


def _megatron_pair(folder, *, docs=150, seed=1):
    """``folder/wiki.idx``/``.bin`` of uint16 tokens; returns the prefix."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(str(folder), "wiki")
    write_megatron_dataset(prefix, [rng.integers(0, 60000, size=int(rng.integers(1, 100))) for _ in range(docs)],
                           np.uint16)
    return prefix


def _upload_pair(prefix, url):
    """The ``.bin`` first, the ``.idx`` last (the pair's marker), under ``url``'s folder."""
    folder, name = os.path.split(prefix)
    upload_dir(folder, url.rsplit("/", 1)[0], marker=name + ".idx", names=[name + ".bin", name + ".idx"])


def _batches(loader):
    with loader:
        return {b.step: b["tokens"].numpy().copy() for b in loader}


def _one_line(res):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    return lines[0]


def test_megatron_pair_is_read_in_place_from_a_bucket(s3_env, tmp_path):
    prefix = _megatron_pair(tmp_path / "mg")
    local = open_dataset(prefix)
    _upload_pair(prefix, "s3://paths/mg/wiki")
    cache = tmp_path / "cache"
    with open_dataset("s3://paths/mg/wiki", cache_dir=cache) as ds:
        assert isinstance(ds, BucketMegatronDataset) and ds.kind == "megatron"
        assert ds.fingerprint == local.fingerprint and ds.num_samples == local.num_samples
        assert not ds.cache.present.any()  # the .idx is here, no byte of the .bin yet
        assert os.path.getsize(ds.idx_path) == os.path.getsize(prefix + ".idx")
        plan = build_plan([(local, 1.0)], seed=2, global_batch_size=8, seq_len=24, num_steps=12)
        want = _batches(Loader(local, plan, prefetch=2))
        got = _batches(Loader(ds, plan, prefetch=2))
        assert sorted(got) == list(range(12)) and all(np.array_equal(got[s], want[s]) for s in want)
        fetched = int(ds.cache.present.sum())
        assert fetched and ds.cache.stats.fetched_bytes <= os.path.getsize(prefix + ".bin")
        assert ds.fetcher.stats.requests < fetched  # ranged, coalesced GETs: fewer than the samples they brought
        for i in (0, 7, ds.num_samples - 1):
            assert ds.read(i) == local.read(i)
        fetched = int(ds.cache.present.sum())
    # the plan-driven prefetcher over a pair in a bucket, on a fresh cache: the same batches, nothing fetched twice
    with open_dataset("s3://paths/mg/wiki", cache_dir=tmp_path / "cache-pf") as ds:
        with PlanPrefetcher(ds, plan, lookahead=4) as pf:
            got = _batches(Loader(ds, plan, prefetch=2, on_step=pf.on_step))
        assert all(np.array_equal(got[s], want[s]) for s in want)
        assert ds.cache.stats.fetched_bytes <= os.path.getsize(prefix + ".bin")
    with open_dataset("s3://paths/mg/wiki", cache_dir=cache) as ds:  # a DataLoader worker's copy: same cache
        clone = pickle.loads(pickle.dumps(ds))
        assert isinstance(clone, BucketMegatronDataset) and int(clone.cache.present.sum()) == fetched
        clone.close()
    # reopened: the cached .idx is kept (one HEAD of it, no byte fetched), the samples already fetched too
    with open_dataset("s3://paths/mg/wiki", cache_dir=cache) as again:
        assert again.fetcher.stats.bytes == 0 and int(again.cache.present.sum()) == fetched
        # a plan's recorded location (the cached prefix) reopens through the bucket, never the sparse .bin alone
        with open_dataset(again.path) as by_path:
            assert isinstance(by_path, BucketMegatronDataset) and by_path.url == again.url


def test_megatron_pair_forgets_its_marks_on_the_first_open_after_a_reboot(s3_env, tmp_path):
    """Marks are made once bytes are written (not synced); a pair has no per-sample checksums to re-hash against,
    so the first open in another boot than the recorded one forgets them and reads fetch again."""
    prefix = _megatron_pair(tmp_path / "mg")
    local = open_dataset(prefix)
    _upload_pair(prefix, "s3://paths/reboot/wiki")
    cache = tmp_path / "cache"
    with open_dataset("s3://paths/reboot/wiki", cache_dir=cache) as ds:
        ds.lookup(np.arange(10))
        boot = os.path.join(local_dir_of(BucketURL.parse("s3://paths/reboot/wiki"), cache), ".foresight-cache", "boot_id")
    with open_dataset("s3://paths/reboot/wiki", cache_dir=cache) as ds:  # the same boot: kept
        assert int(ds.cache.present.sum()) == 10
    with open(boot, "w") as f:
        f.write("another-boot")
    with open_dataset("s3://paths/reboot/wiki", cache_dir=cache) as ds:
        assert not ds.cache.present.any()
        assert all(ds.read(i) == local.read(i) for i in range(10))


def test_megatron_bad_input_fails_in_one_line(s3_env, tmp_path):
    prefix = _megatron_pair(tmp_path / "mg")
    folder = str(tmp_path / "mg")
    upload_dir(folder, "s3://paths/half", marker="wiki.idx", names=["wiki.idx"])  # no .bin
    with pytest.raises(BucketError) as e:
        open_dataset("s3://paths/half/wiki", cache_dir=tmp_path / "cache")
    assert e.value.reason == "not_found" and "s3://paths/half/wiki.bin" in str(e.value)
    with pytest.raises(BucketError) as e:
        open_dataset("s3://paths/half/other", cache_dir=tmp_path / "cache")
    text = str(e.value)
    assert "dataset not found" in text and "s3://paths/half/other" in text and "\n" not in text
    other = _megatron_pair(tmp_path / "other", docs=40, seed=9)  # an .idx beside another pair's .bin
    upload_dir(folder, "s3://paths/mixed", marker="wiki.idx", names=["wiki.idx"])
    upload_dir(os.path.dirname(other), "s3://paths/mixed", marker="wiki.bin", names=["wiki.bin"])
    with pytest.raises(FormatError) as e:
        open_dataset("s3://paths/mixed/wiki", cache_dir=tmp_path / "cache")
    assert "s3://paths/mixed/wiki.idx/.bin does not check" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError) as e:  # a local file missing: refused before any object is written
        upload_dir(folder, "s3://paths/partial", marker="wiki.idx", names=["wiki.bin", "gone.bin", "wiki.idx"])
    assert e.value.filename == os.path.join(folder, "gone.bin")
    with pytest.raises(BucketError, match="dataset not found"):
        open_dataset("s3://paths/partial/wiki", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="fingerprint='index'"):
        _upload_pair(prefix, "s3://paths/content/wiki")
        open_dataset("s3://paths/content/wiki", cache_dir=tmp_path / "cache", fingerprint="content")


def test_plan_over_bucket_datasets_to_a_bucket_and_back(s3_env, tmp_path, monkeypatch):
    """``foresight plan`` over a foresight dataset and a Megatron pair in a bucket, written to a bucket; a fresh
    host (another cache directory) runs ``Loader("s3://.../plan")``: the same batches as the local plan's."""
    local = _token_dataset(tmp_path / "tok")
    prefix = _megatron_pair(tmp_path / "mg")
    upload_dataset(local.path, "s3://paths/tok")
    _upload_pair(prefix, "s3://paths/mgp/wiki")
    res = run_cli("plan", "s3://paths/tok", "s3://paths/mgp/wiki", *PLAN_ARGS, "--out", "s3://paths/plans/p1",
                  FORESIGHT_BUCKET_CACHE=str(tmp_path / "cache-a"))
    assert res.returncode == 0, res.stderr
    local_plan = build_plan([(local, 1.0), (open_dataset(prefix), 1.0)], seed=5, global_batch_size=8, seq_len=24,
                            num_steps=10)
    assert json.loads(res.stdout)["digest"] == local_plan.digest
    want = _batches(Loader([local, open_dataset(prefix)], local_plan, prefetch=2))

    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "cache-b"))  # a host that has cached nothing
    got = _batches(Loader("s3://paths/plans/p1", prefetch=2))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[s], want[s]) for s in want)
    # the plan was fetched once into the cache and is kept: a second open heads plan.json and reuses the copy
    plan = load_plan("s3://paths/plans/p1")
    plan_json = os.path.join(plan.path, "plan.json")
    assert plan.path.startswith(str(tmp_path / "cache-b")) and plan.digest == local_plan.digest
    inode = os.stat(plan_json).st_ino
    assert load_plan("s3://paths/plans/p1").path == plan.path and os.stat(plan_json).st_ino == inode

    # the writer's own copy is recorded as the bucket's: opening it there fetches nothing
    written = os.path.join(local_dir_of(BucketURL.parse("s3://paths/plans/p1"), tmp_path / "cache-a"), "plan.json")
    written_inode = os.stat(written).st_ino
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "cache-a"))
    assert load_plan("s3://paths/plans/p1").path == os.path.dirname(written)
    assert os.stat(written).st_ino == written_inode
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "cache-b"))

    # an existing plan is not replaced without --overwrite ; with it, it is
    res = run_cli("plan", "s3://paths/tok", *PLAN_ARGS, "--out", "s3://paths/plans/p1",
                  FORESIGHT_BUCKET_CACHE=str(tmp_path / "cache-a"))
    assert "already holds a plan" in _one_line(res) and "s3://paths/plans/p1" in res.stderr
    res = run_cli("plan", "s3://paths/tok", *PLAN_ARGS, "--out", "s3://paths/plans/p1", "--overwrite",
                  FORESIGHT_BUCKET_CACHE=str(tmp_path / "cache-a"))
    assert res.returncode == 0, res.stderr
    replaced = load_plan("s3://paths/plans/p1")
    assert replaced.digest == json.loads(res.stdout)["digest"] != local_plan.digest
    assert os.stat(plan_json).st_ino != inode  # fetched again: plan.json's ETag changed


def test_plan_bad_bucket_paths_fail_in_one_line(s3_env, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    res = run_cli("plan", "s3://paths/no-such-dataset", *PLAN_ARGS, "--out", str(tmp_path / "p"),
                  FORESIGHT_BUCKET_CACHE=cache)
    assert "dataset not found" in _one_line(res) and "s3://paths/no-such-dataset" in res.stderr
    local = _token_dataset(tmp_path / "tok")
    res = run_cli("plan", local.path, *PLAN_ARGS, "--out", "s3://paths/plans/nocache", FORESIGHT_BUCKET_CACHE="")
    assert "FORESIGHT_BUCKET_CACHE" in _one_line(res)
    upload_dataset(local.path, "s3://paths/not-a-plan")
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", cache)
    for url in ("s3://paths/not-a-plan", "s3://paths/nothing/here"):
        with pytest.raises(BucketError) as e:
            Loader(url)
        assert "no plan.json under it: not a plan" in str(e.value) and url in str(e.value)
    with pytest.raises(BucketError, match="bucket not found"):
        load_plan("s3://no-bucket-of-ours/p")


def test_pack_to_a_bucket_uploads_the_manifest_last(s3_env, tmp_path):
    src = tmp_path / "text.jsonl"
    rng = np.random.default_rng(3)
    src.write_text("".join(json.dumps({"text": "w" * int(n)}) + "\n" for n in rng.integers(1, 3000, size=300)))
    staging = tmp_path / "staging"  # not made: created as the bucket cache is wherever it is named
    res = run_cli("pack", "jsonl", str(src), "s3://paths/packed", "--column", "text", "--shard-bytes", "100K",
                  "--no-progress", FORESIGHT_BUCKET_CACHE=str(staging))
    assert res.returncode == 0, res.stderr
    assert "at s3://paths/packed" in res.stdout and "manifest.json last" in res.stdout
    assert os.listdir(staging) == []  # the staging directory is gone
    res = run_cli("pack", "jsonl", str(src), str(tmp_path / "local"), "--column", "text", "--shard-bytes", "100K",
                  "--no-progress")
    assert res.returncode == 0, res.stderr
    local = open_dataset(str(tmp_path / "local"))
    with open_dataset("s3://paths/packed", cache_dir=tmp_path / "cache") as ds:
        assert isinstance(ds, BucketDataset) and ds.fingerprint == local.fingerprint and len(ds.shard_paths) > 1
        assert all(ds.read(i) == local.read(i) for i in range(0, ds.num_samples, 37))
    # an existing dataset is refused before packing; --overwrite replaces it
    res = run_cli("pack", "jsonl", str(src), "s3://paths/packed", "--column", "text", "--no-progress")
    assert "already holds a dataset" in _one_line(res) and "--overwrite" in res.stderr
    res = run_cli("pack", "jsonl", str(src), "s3://paths/packed", "--column", "text", "--no-progress",
                  "--overwrite")
    assert res.returncode == 0, res.stderr
    with open_dataset("s3://paths/packed", cache_dir=tmp_path / "cache") as ds:  # re-laid out: the manifest changed
        assert len(ds.shard_paths) == 1 and all(ds.read(i) == local.read(i) for i in range(0, ds.num_samples, 37))


def test_inspect_a_bucket_dataset_plan_and_megatron_pair(s3_env, tmp_path):
    local = _token_dataset(tmp_path / "tok")
    prefix = _megatron_pair(tmp_path / "mg")
    upload_dataset(local.path, "s3://paths/insp")
    _upload_pair(prefix, "s3://paths/insp-mg/wiki")
    cache = str(tmp_path / "cache")
    res = run_cli("inspect", "s3://paths/insp", FORESIGHT_BUCKET_CACHE=cache)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads(run_cli("inspect", local.path).stdout)  # its manifest, as local
    res = run_cli("inspect", "s3://paths/insp-mg/wiki", FORESIGHT_BUCKET_CACHE=cache)
    info = json.loads(res.stdout)
    assert info["kind"] == "megatron" and info["url"] == "s3://paths/insp-mg/wiki"
    assert info["fingerprint"] == open_dataset(prefix).fingerprint
    res = run_cli("plan", "s3://paths/insp", *PLAN_ARGS, "--out", "s3://paths/insp-plan", FORESIGHT_BUCKET_CACHE=cache)
    assert res.returncode == 0, res.stderr
    digest = json.loads(res.stdout)["digest"]
    res = run_cli("inspect", "s3://paths/insp-plan", FORESIGHT_BUCKET_CACHE=str(tmp_path / "cache-2"))
    assert res.returncode == 0 and json.loads(res.stdout)["digest"] == digest, res.stderr
    res = run_cli("inspect", "s3://paths/insp-plan", "--step", "3", FORESIGHT_BUCKET_CACHE=cache)
    assert res.returncode == 0 and json.loads(res.stdout)["step"] == 3, res.stderr
    # bad input: nothing there, no bucket, no cache directory
    res = run_cli("inspect", "s3://paths/nothing", FORESIGHT_BUCKET_CACHE=cache)
    assert "dataset not found" in _one_line(res) and "s3://paths/nothing" in res.stderr
    res = run_cli("inspect", "s3://no-bucket-of-ours/x", FORESIGHT_BUCKET_CACHE=cache)
    assert "bucket not found" in _one_line(res)
    res = run_cli("inspect", "s3://paths/insp", FORESIGHT_BUCKET_CACHE="")
    assert "FORESIGHT_BUCKET_CACHE" in _one_line(res)


def test_bucket_root_and_nested_prefixes_keep_each_others_cache(s3_env, tmp_path, monkeypatch):
    """``s3://bucket`` with no prefix as a dataset and as a plan, and URLs nested in one another (a plan under its
    dataset's prefix, a dataset under a plan's): each one's local copy lives inside another's directory, and laying
    out or refreshing one must never remove the other's files (nor crash on the root's empty prefix)."""
    local = _token_dataset(tmp_path / "tok")
    upload_dataset(local.path, "s3://rootds")
    upload_dataset(local.path, "s3://nestplan/data")
    plan = build_plan([(local, 1.0)], seed=5, global_batch_size=8, seq_len=24, num_steps=10)
    want = _batches(Loader(local, plan, prefetch=2))
    writer = tmp_path / "writer-cache"
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(writer))
    for url in ("s3://rootplan", "s3://rootds/plans/p1", "s3://nestplan"):
        plan.save(url)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(cache))
    # a plan at a bucket's root, on a host that has cached nothing
    got = _batches(Loader("s3://rootplan", datasets=open_dataset("s3://rootds"), prefetch=2))
    assert all(np.array_equal(got[s], want[s]) for s in want)
    # the plan under the (root) dataset's prefix is mirrored first, then the dataset is laid out around it
    got = _batches(Loader("s3://rootds/plans/p1", datasets=open_dataset("s3://rootds"), prefetch=2))
    assert all(np.array_equal(got[s], want[s]) for s in want)
    shutil.rmtree(cache)
    first = load_plan("s3://rootds/plans/p1")
    plan_json = os.path.join(first.path, "plan.json")
    with open_dataset("s3://rootds") as ds:  # a first layout of the dataset, around the plan's copy
        assert ds.read(3) == local.read(3)
    assert os.path.isfile(plan_json)
    inode = os.stat(plan_json).st_ino
    stale = os.path.join(os.path.dirname(first.path), ".p1.tmp-killed")  # a mirror killed mid-fetch left it
    os.makedirs(stale)
    assert load_plan("s3://rootds/plans/p1").path == first.path and os.stat(plan_json).st_ino == inode  # kept
    assert not os.path.exists(stale)
    # a dataset under a plan's prefix: cached first, then the plan is mirrored (and mirrored again once replaced)
    with open_dataset("s3://nestplan/data") as ds:
        ds.lookup(np.arange(ds.num_samples))
        cached = int(ds.cache.present.sum())
        ds_path = ds.path
    assert load_plan("s3://nestplan").digest == plan.digest
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(writer))
    build_plan([(local, 1.0)], seed=6, global_batch_size=8, seq_len=24, num_steps=10).save("s3://nestplan",
                                                                                         overwrite=True)
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(cache))
    assert load_plan("s3://nestplan").digest != plan.digest
    with open_dataset("s3://nestplan/data") as ds:
        assert ds.path == ds_path and int(ds.cache.present.sum()) == cached  # nothing to fetch again


def test_megatron_bin_replaced_after_the_plan_was_built_is_refused_on_a_fresh_host(s3_env, tmp_path, monkeypatch):
    """A pair's ``.bin`` replaced by other bytes of the same size after the plan was built keeps the index
    fingerprint (``.idx`` unchanged) and has no per-sample checksums: a host that opens it afresh must refuse it by
    name (the plan records each object's ETag), never serve the other bytes."""
    prefix = _megatron_pair(tmp_path / "mg")
    _upload_pair(prefix, "s3://paths/replaced-mg/wiki")
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "cache-a"))
    with open_dataset("s3://paths/replaced-mg/wiki") as ds:
        build_plan([(ds, 1.0)], seed=2, global_batch_size=8, seq_len=24, num_steps=4).save(
            "s3://paths/replaced-mg/plan")
    assert _batches(Loader("s3://paths/replaced-mg/plan"))  # as built: served
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    store = open_store(BucketURL.parse("s3://paths"))
    obstore.put(store, "replaced-mg/wiki.bin", bytes(255 - b for b in data))
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "cache-b"))  # a host that has cached nothing
    shutil.rmtree(tmp_path / "cache-a")  # nor has the writer's copy
    with pytest.raises(BucketError) as e:
        Loader("s3://paths/replaced-mg/plan")
    assert e.value.reason == "changed" and "replaced since the plan was built" in str(e.value)
    assert "s3://paths/replaced-mg/wiki.bin" in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_plan_copy_in_the_cache_is_fetched_again(s3_env, tmp_path, monkeypatch):
    """A plan's kept copy with an array cut short or removed (a crash, a disk cleaner) is fetched again on the next
    open instead of failing every load until the cache is deleted by hand."""
    local = _token_dataset(tmp_path / "tok")
    plan = build_plan([(local, 1.0)], seed=5, global_batch_size=8, seq_len=24, num_steps=10)
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "writer"))
    plan.save("s3://paths/plans/damaged")
    monkeypatch.setenv("FORESIGHT_BUCKET_CACHE", str(tmp_path / "cache"))
    copy = load_plan("s3://paths/plans/damaged").path
    arrays = sorted(n for n in os.listdir(copy) if n.endswith(".npy"))
    for damage in (lambda p: os.truncate(p, 50), os.unlink, lambda p: os.truncate(p, 0)):
        damage(os.path.join(copy, arrays[0]))
        again = load_plan("s3://paths/plans/damaged")
        assert again.path == copy and again.digest == plan.digest
        assert np.array_equal(np.load(os.path.join(copy, arrays[0])), np.asarray(plan.arrays[arrays[0][:-4]]))


def test_upload_puts_at_most_concurrency_objects_at_a_time(s3_env, tmp_path, monkeypatch):
    """``concurrency`` bounds the objects in flight (a bench's set-up uploads GiBs into a loaded server 4 at a time:
    all at once, SeaweedFS answered 500s); the dataset reads back the same."""
    local = _token_dataset(tmp_path / "tok")
    assert len(local.shard_paths) >= 2  # shards and maps: 4 objects before the manifest
    lock, in_flight, most = threading.Lock(), [0], [0]
    real_put = RangedFetcher.put

    def counted_put(self, *args, **kwargs):  # the real put, its calls in flight counted
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            return real_put(self, *args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(RangedFetcher, "put", counted_put)
    upload_dataset(local.path, "s3://paths/one-by-one", concurrency=1)
    assert most[0] == 1
    with open_dataset("s3://paths/one-by-one", cache_dir=tmp_path / "cache") as ds:
        assert ds.fingerprint == local.fingerprint
        assert all(ds.read(i) == local.read(i) for i in range(0, ds.num_samples, 17))
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        upload_dir(tmp_path / "tok", "s3://paths/none", marker="manifest.json", concurrency=0)


def test_a_replaced_bin_behind_a_store_ignoring_if_match_is_refused_not_read(s3_env, tmp_path, monkeypatch):
    """Every GET carries If-Match with the ETag the copy recorded at open, but not every S3-compatible store
    honours it on GET (gateways, older versions answer 206 with the current object). A Megatron ``.bin`` has no
    per-sample checksums: the ETag is its only guard. Replaced (same size) behind such a store, its GETs must be
    refused by the ETag the answer carries, never read as the samples of the copy's ``.idx``."""
    from foresight.bucket import RetryPolicy
    from foresight.testing.http_faults import Fault, FaultProxy

    prefix = _megatron_pair(tmp_path / "mg")
    local = open_dataset(prefix)
    _upload_pair(prefix, "s3://paths/ignores/wiki")
    url = BucketURL.parse("s3://paths/ignores/wiki.bin")
    env = s3_env.env()
    ignore = Fault(status=0, method="GET", path=r"\.bin$", drop_headers=("If-Match",))
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"]), [ignore],
                    keys=(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], "us-east-1")) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with open_dataset("s3://paths/ignores/wiki", cache_dir=tmp_path / "cache",
                          retry=RetryPolicy(attempts=2, budget_s=5)) as ds:
            ds.lookup(np.array([0]))
            assert ds.read(0) == local.read(0)
            with open(prefix + ".bin", "rb") as f:
                data = bytearray(f.read())
            data[:] = bytes(255 - b for b in data)  # every byte differs, same size: a new ETag
            obstore.put(open_store(url), url.prefix, bytes(data))
            with pytest.raises(BucketError) as e:
                ds.lookup(np.array([5, 6]))
            assert e.value.reason == "changed" and "wiki.bin" in str(e.value), str(e.value)
            assert not ds.cache.present[[5, 6]].any()
        assert ignore.fired >= 2  # the GETs went without If-Match


def test_two_endpoints_with_the_same_bucket_and_key_are_cached_apart(s3_env, tmp_path):
    """Two S3 servers hold a Megatron pair under the same bucket/key with the same ``.idx`` (so the same ETag) and
    different ``.bin`` bytes: read through one cache root, each endpoint's dataset gives its own bytes (the cache
    place is keyed by the endpoint), and reopening an endpoint's dataset finds its own copy again."""
    from foresight.testing.seaweed import SeaweedServer

    other = SeaweedServer(str(tmp_path / "seaweed-2"))
    other.start()
    try:
        a, b = _megatron_pair(tmp_path / "a", seed=3), _megatron_pair(tmp_path / "b", seed=3)
        with open(b + ".bin", "r+b") as f:  # same lengths (same .idx), other tokens
            data = bytearray(f.read())
            f.seek(0)
            f.write(bytes(x ^ 0x5A for x in data))
        assert open(a + ".idx", "rb").read() == open(b + ".idx", "rb").read()
        keys_b = {"endpoint": other.endpoint, "access_key_id": other.env()["AWS_ACCESS_KEY_ID"],
                  "secret_access_key": other.secret_key}
        _upload_pair(a, "s3://twin/mg/wiki")  # the session server, from the environment
        folder, name = os.path.split(b)
        upload_dir(folder, "s3://twin/mg", marker=name + ".idx", names=[name + ".bin", name + ".idx"],
                   options=keys_b)
        local_a, local_b = open_dataset(a), open_dataset(b)
        cache = tmp_path / "cache"
        n = local_a.num_samples
        with open_dataset("s3://twin/mg/wiki", cache_dir=cache) as ds_a, \
                open_dataset("s3://twin/mg/wiki", cache_dir=cache, options=keys_b) as ds_b:
            assert [ds_a.read(i) for i in range(n)] == [local_a.read(i) for i in range(n)]
            assert [ds_b.read(i) for i in range(n)] == [local_b.read(i) for i in range(n)]
            assert [ds_a.read(i) for i in range(n)] == [local_a.read(i) for i in range(n)]  # A's copy untouched
            assert ds_a.path != ds_b.path
            path_a, path_b = ds_a.path, ds_b.path
        # the same endpoints again (a restart): the same places, every sample already there
        with open_dataset("s3://twin/mg/wiki", cache_dir=cache) as ds_a, \
                open_dataset("s3://twin/mg/wiki", cache_dir=cache, options=keys_b) as ds_b:
            assert (ds_a.path, ds_b.path) == (path_a, path_b)
            assert ds_a.fetcher.stats.bytes == 0 == ds_b.fetcher.stats.bytes
            assert ds_b.read(n - 1) == local_b.read(n - 1) and ds_a.read(n - 1) == local_a.read(n - 1)
            # a plan's recorded location (the cached prefix) reopens through its own endpoint (the keys: the caller's)
            with open_dataset(path_b, options={k: v for k, v in keys_b.items() if k != "endpoint"}) as by_path:
                assert by_path.read(0) == local_b.read(0)
    finally:
        other.stop()


def test_a_copy_laid_out_before_endpoint_places_still_reopens_by_its_path(s3_env, tmp_path):
    """A cache laid out before copies were kept under their endpoint's place: ``cache/bucket/prefix`` with no
    endpoint in its state, the endpoint set in the environment. A plan's recorded location (that directory) still
    opens its dataset, through the endpoint the caller reads from now (its copy at that endpoint's place), instead
    of being refused as 'not where it is cached under any root'."""
    local = _token_dataset(tmp_path / "tok", seed=4)
    upload_dataset(local.path, "s3://legacy/tok")
    cache = tmp_path / "cache"
    with open_dataset("s3://legacy/tok", cache_dir=cache) as ds:
        ds.read(0)
        new_place = ds.path
    old_place = str(cache / "legacy" / "tok")  # where the previous version laid it out
    assert new_place != old_place
    shutil.move(new_place, old_place)
    state_path = os.path.join(old_place, ".foresight-cache", "state.json")
    with open(state_path) as f:
        state = json.load(f)
    state.pop("endpoint")  # the previous version recorded none
    with open(state_path, "w") as f:
        json.dump(state, f)
    with open_dataset(old_place) as ds:
        assert [ds.read(i) for i in range(local.num_samples)] == [local.read(i) for i in range(local.num_samples)]
        assert ds.path == new_place


def test_a_plans_dataset_is_found_by_search_under_a_cache_root_with_endpoint_places(s3_env, tmp_path):
    """A plan whose recorded location is gone finds its dataset under ``search=[cache_dir]``: the endpoint's place
    (``cache_dir/_endpoint-.../``) is one more directory level, which the bounded search depth must not count (a
    dataset at ``s3://bucket/a/b/name`` was found under the cache before endpoints had places, and then was not)."""
    local = _token_dataset(tmp_path / "tok", seed=6)
    upload_dataset(local.path, "s3://search/a/b/tok")
    cache = tmp_path / "cache"
    with open_dataset("s3://search/a/b/tok", cache_dir=cache) as ds:
        plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=8, seq_len=24, num_steps=4)
        plan.save(str(tmp_path / "plan"))
    sources_path = tmp_path / "plan" / "sources.json"
    doc = json.loads(sources_path.read_text())
    for s in doc["sources"]:  # the recorded location and bucket gone: only the search can find it
        for key in ("path", "relative", "url"):
            s.pop(key, None)
    sources_path.write_text(json.dumps(doc))
    from foresight.plan import open_plan_datasets

    found = open_plan_datasets(load_plan(str(tmp_path / "plan")), search=[str(cache)])
    try:
        assert found[0].read(0) == local.read(0)
    finally:
        for d in found:
            d.close()
