"""A storage node over a bucket: ``foresight node serve --root s3://... --cache-dir DIR`` as a real process against
a real SeaweedFS. Its batches equal a local Loader's over the same plan, it fetches the plan's bytes ahead in few
requests, and a bad root stops it at start with one line naming the bucket."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import obstore
import obstore.exceptions
import pyarrow.flight as flight
import pytest

from foresight.bucket import BucketURL
from foresight.bucket.config import open_store
from foresight.bucket.dataset import local_dir_of
from foresight.bucket.upload import upload_dataset
from foresight.cluster.auth import call_options, connect
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.node.plans import upload_plan
from foresight.plan import build_plan
from node_helpers import (SPECS, TOKEN, NodeProc, flight_action, host_reference, job_request, make_root, run_source,
                          wait_for)
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The media dataset (several shards) and a plan of 2 epochs, packed here, and a token dataset beside it."""
    r = make_root(str(tmp_path_factory.mktemp("local")), samples=24, steps=12, batch=4)
    r["reference"] = host_reference(r["dataset"], r["plan"])
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=300)
    with DatasetWriter(os.path.join(r["root"], "tokens"), align=0, token_dtype="uint16", shard_bytes=40_000) as w:
        w.add_many(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
    r["tokens"] = open_dataset(os.path.join(r["root"], "tokens"))
    return r


def _status(node: NodeProc) -> dict:
    client = connect(node.location)
    try:
        return flight_action(client, "status", {})
    finally:
        client.close()


def _health(node: NodeProc) -> dict:
    client = connect(node.location)
    try:
        return flight_action(client, "health", {})
    finally:
        client.close()


def _put_plan(plan_dir: str, url: str) -> None:
    """A plan directory into the bucket, plan.json last (as a dataset's manifest)."""
    url = BucketURL.parse(url)
    store = open_store(url)
    for name in sorted(os.listdir(plan_dir), key=lambda n: n == "plan.json"):
        obstore.put(store, url.key(name), os.path.join(plan_dir, name))


def _serves(url: str) -> bool:
    """Whether the server answers a GET of ``url`` (a restarted SeaweedFS answers 500 for a few seconds)."""
    url = BucketURL.parse(url)
    try:
        obstore.get(open_store(url), url.prefix).bytes()
        return True
    except obstore.exceptions.BaseError:
        return False


def test_node_over_a_bucket_serves_the_local_loaders_tensors_in_few_requests(s3_env, local, tmp_path):
    upload_dataset(os.path.join(local["root"], "media"), "s3://nodes/root/media")
    upload_dataset(os.path.join(local["root"], "tokens"), "s3://nodes/root/text/tokens")
    _put_plan(os.path.join(local["root"], "plans", "p1"), "s3://nodes/root/plans/p1")
    node = NodeProc("s3://nodes/root", str(tmp_path / "node"), "--cache-dir", str(tmp_path / "cache"),
                    "--cpu-threshold", "101", name="bucket")
    try:
        # both datasets found in the bucket, under the fingerprints of the local copies (clients match on them)
        health = _health(node)
        assert health["datasets"]["media"]["fingerprint"] == str(local["dataset"].fingerprint)
        assert health["datasets"]["text/tokens"]["fingerprint"] == str(local["tokens"].fingerprint)
        plan = local["plan"]
        assert health["plans"] == {plan.digest: "plans/p1"}  # the bucket's plan, copied to the cache directory
        stage = MediaDecodeStage([local["dataset"]], SPECS, seed=9, threads=2)
        source = NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job="bucket")
        try:
            got = run_source(local["dataset"], plan, source)
            status = _status(node)  # while the job is registered
            wait_for(lambda: _status(node)["jobs"]["bucket.0"]["prefetch"]["prefetched_steps"] == plan.num_steps,
                     what="the prefetcher to reach the plan's end")  # it walked the whole plan
        finally:
            source.close()
            stage.close()
        assert got == local["reference"]  # decoded next to the cache: the host's tensors, step by step
        assert source.stats["plans_uploaded"] == 0  # the node had it from the bucket
        assert source.stats["samples_local"] == 0 and source.stats["samples_remote"] == plan.num_steps * 4
        assert status["root"] == "s3://nodes/root"
        media = status["bucket"]["s3://nodes/root/media"]
        used = np.unique(np.asarray(plan.pieces(0, plan.num_items).sample))
        # the plan's samples fetched once each (block fill: in few large GETs), nothing of the token dataset
        assert media["misses"] + media["gap_samples"] == used.size
        assert media["fetched_bytes"] <= sum(os.path.getsize(p) for p in local["dataset"].shard_paths)
        assert media["requests"] < plan.num_items, media  # every request (listing, maps, data): < 1 per sample
        assert "s3://nodes/root/text/tokens" not in status["bucket"]
        assert status["jobs"]["bucket.0"]["prefetch"]["stopped"] == 0
        # the token dataset is the client's to read (a Loader over the same bucket): a node decodes media, and a
        # token plan's job is refused by name
        tokens = build_plan([(local["tokens"], 1.0)], seed=7, global_batch_size=8, seq_len=32, num_steps=4)
        tokens.save(str(tmp_path / "token-plan"))
        client = connect(node.location)
        try:
            upload_plan(client, str(tmp_path / "token-plan"), tokens.digest, call_options("tok", TOKEN, timeout=60))
            req = job_request({"plan": tokens}, job="tok", datasets=["text/tokens"],
                              plan=_health(node)["plans"][tokens.digest])
            with pytest.raises(flight.FlightServerError, match="media"):
                flight_action(client, "register_job", req, job="tok", token=TOKEN)
        finally:
            client.close()
    finally:
        node.terminate()
    # the cache directory is the bucket root's local side: each dataset's cache, the plans
    mirror = Path(local_dir_of(BucketURL.parse("s3://nodes/root"), tmp_path / "cache"))  # the endpoint's place
    assert (mirror / "media" / "manifest.json").is_file() and (mirror / "plans" / "p1" / "plan.json").is_file()


def test_restarted_node_serves_from_its_cache_without_fetching_again(s3_env, local, tmp_path):
    upload_dataset(os.path.join(local["root"], "media"), "s3://nodes/again/media")
    plan = local["plan"]
    for run in range(2):
        node = NodeProc("s3://nodes/again", str(tmp_path / "node"), "--cache-dir", str(tmp_path / "cache"),
                        "--cpu-threshold", "101", name=f"again{run}")
        try:
            stage = MediaDecodeStage([local["dataset"]], SPECS, seed=9, threads=2)
            source = NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job=f"again{run}")
            try:
                assert run_source(local["dataset"], plan, source) == local["reference"]
            finally:
                source.close()
                stage.close()
            media = _status(node)["bucket"]["s3://nodes/again/media"]
        finally:
            node.terminate()
        # the plan uploaded once; the cache and the plan kept across the restart: every sample a hit
        assert source.stats["plans_uploaded"] == 1 - run
        if run == 1:
            assert media["misses"] == 0 and media["fetched_bytes"] == 0


def _serve_fails(tmp_path, root: str, env: dict, *extra: str) -> str:
    path = os.pathsep.join([os.path.abspath("python"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "foresight", "node", "serve", "--root", root,
                           "--ready-file", str(tmp_path / "ready.json"), *extra],
                          env=dict(env, PYTHONPATH=path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not (tmp_path / "ready.json").exists()  # it never served
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, proc.stderr
    return proc.stdout + proc.stderr


def test_bad_bucket_root_fails_at_start_with_one_line_naming_the_bucket(s3_env, local, tmp_path):
    upload_dataset(os.path.join(local["root"], "media"), "s3://nodes/keys/media")
    env = dict(os.environ)
    cache = str(tmp_path / "cache")
    out = _serve_fails(tmp_path, "s3://no-bucket-of-ours/root", env, "--cache-dir", cache)
    assert "bucket not found" in out and "no-bucket-of-ours" in out and s3_env.secret_key not in out
    wrong = dict(env, AWS_SECRET_ACCESS_KEY="not-the-right-secret-42")
    out = _serve_fails(tmp_path, "s3://nodes/keys", wrong, "--cache-dir", cache)
    assert "access denied" in out and "s3://nodes/keys" in out
    assert "not-the-right-secret-42" not in out and s3_env.secret_key not in out
    out = _serve_fails(tmp_path, "s3://nodes/keys", {k: v for k, v in env.items() if k != "FORESIGHT_BUCKET_CACHE"})
    assert "--cache-dir" in out and "s3://nodes/keys" in out
    out = _serve_fails(tmp_path, str(tmp_path), env, "--cache-dir", cache)  # a local root has no cache tier
    assert "s3:// root only" in out


def test_a_bucket_dataset_added_after_start_is_found_when_a_job_names_it(s3_env, local, tmp_path):
    node = NodeProc("s3://nodes/later", str(tmp_path / "node"), "--cache-dir", str(tmp_path / "cache"),
                    "--cpu-threshold", "101", "--rescan-s", "0", name="later")
    try:
        assert _health(node)["datasets"] == {}
        upload_dataset(os.path.join(local["root"], "media"), "s3://nodes/later/media")
        plan = local["plan"]
        stage = MediaDecodeStage([local["dataset"]], SPECS, seed=9, threads=2)
        client = connect(node.location)
        try:
            req = job_request({"plan": plan}, job="later")
            with pytest.raises(flight.FlightServerError, match="plan"):  # the plan is not there yet: named
                flight_action(client, "register_job", req, job="later", token=TOKEN)
            # the registration rescanned the bucket: the dataset is listed now
            assert _health(node)["datasets"]["media"]["fingerprint"] == str(local["dataset"].fingerprint)
        finally:
            client.close()
            stage.close()
    finally:
        node.terminate()


def test_node_under_a_cache_budget_evicts_by_the_plan_and_serves_the_same_tensors(s3_env, local, tmp_path):
    """A budget of half the dataset's sample bytes: the job's prefetcher evicts what its plan needs furthest ahead,
    never a sample of the steps the node may be reading (none fails its checksum, none is decoded on the host)."""
    upload_dataset(os.path.join(local["root"], "media"), "s3://nodes/budget/media")
    ds = local["dataset"]
    plan = build_plan([(ds, 1.0)], seed=6, global_batch_size=2, num_steps=24)  # 2 epochs, 2 samples a step
    plan.save(str(tmp_path / "plan"))
    reference = host_reference(ds, plan)
    budget = int(ds.sample_bytes().sum()) // 2
    node = NodeProc("s3://nodes/budget", str(tmp_path / "node"), "--cache-dir", str(tmp_path / "cache"),
                    "--cpu-threshold", "101", "--cache-budget", str(budget), "--cache-lookahead", "4", name="budget")
    try:
        stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
        source = NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job="budget")
        try:
            assert run_source(ds, plan, source) == reference
            prefetch = _status(node)["jobs"]["budget.0"]["prefetch"]
        finally:
            source.close()
            stage.close()
        assert source.stats["samples_local"] == 0 and source.stats["samples_corrupt"] == 0
        assert prefetch["evicted_samples"] > 0 and prefetch["stopped"] == 0
        media = _status(node)["bucket"]["s3://nodes/budget/media"]
        assert media["cached_bytes"] < int(ds.sample_bytes().sum())  # the demand path may pass the target a little
    finally:
        node.terminate()


def test_bucket_down_at_a_rescan_keeps_the_last_listing_and_the_node_serves_on(s3_env, local, tmp_path):
    upload_dataset(os.path.join(local["root"], "media"), "s3://nodes/down/media")
    node = NodeProc("s3://nodes/down", str(tmp_path / "node"), "--cache-dir", str(tmp_path / "cache"),
                    "--cpu-threshold", "101", "--rescan-s", "1", name="down")
    try:
        try:
            s3_env.stop()  # SIGKILL: the periodic rescan's listing fails past its retry budget
            wait_for(lambda: _status(node)["failed_scans"] >= 1, timeout=180, what="a failed rescan")
            assert "media" in _health(node)["datasets"]  # the last listing stays
        finally:
            if s3_env.proc is None:
                s3_env.start()
        wait_for(lambda: _serves("s3://nodes/down/media/manifest.json"), what="the restarted server to serve GETs")
        assert "not rescanned" in node.log() and s3_env.secret_key not in node.log()
        stage = MediaDecodeStage([local["dataset"]], SPECS, seed=9, threads=2)
        source = NodeSource(stage, local["plan"], nodes=[node.location], token=TOKEN, job="down")
        try:
            assert run_source(local["dataset"], local["plan"], source) == local["reference"]
        finally:
            source.close()
            stage.close()
        assert source.stats["samples_local"] == 0, node.log()[-6000:]
    finally:
        node.terminate()


def test_node_fetches_only_the_samples_it_decodes(s3_env, tmp_path):
    """Images in the first shards, videos in the last ones, a job decoding images only: the node (its prefetch and
    its reads) fetches no sample of a video-only shard; the client reads the videos itself."""
    from test_loader_media import _clip, _jpeg

    from foresight.media import probe_media

    with DatasetWriter(str(tmp_path / "mixed"), shard_bytes=20000) as w:
        for i in range(8):
            w.add(_jpeg(i), modality="image", meta=probe_media(_jpeg(i), "image"))
        for i in range(8):
            w.add(_clip(i), modality="video", meta=probe_media(_clip(i), "video"))
    ds = open_dataset(str(tmp_path / "mixed"))
    plan = build_plan([(ds, 1.0)], seed=4, global_batch_size=4, num_steps=8)
    plan.save(str(tmp_path / "plan"))
    images = {"image": SPECS["image"]}
    stage = MediaDecodeStage([ds], images, seed=9, threads=2)
    try:
        reference = run_source(ds, plan, stage)
    finally:
        stage.close()
    upload_dataset(str(tmp_path / "mixed"), "s3://nodes/mixed/media")
    node = NodeProc("s3://nodes/mixed", str(tmp_path / "node"), "--cache-dir", str(tmp_path / "cache"),
                    "--cpu-threshold", "101", name="mixed")
    try:
        stage = MediaDecodeStage([ds], images, seed=9, threads=2)
        source = NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job="mixed")
        try:
            assert run_source(ds, plan, source) == reference
            wait_for(lambda: _status(node)["jobs"]["mixed.0"]["prefetch"]["prefetched_steps"] == plan.num_steps,
                     what="the prefetcher to reach the plan's end")
        finally:
            source.close()
            stage.close()
        assert source.stats["samples_remote"] > 0 and source.stats["samples_local"] == 0
    finally:
        node.terminate()
    ext = ds.lookup(np.arange(ds.num_samples))
    codes = np.asarray(ds.modality_codes())
    video_only = [s for s in np.unique(ext.shard) if (codes[ext.shard == s] == codes[8]).all()]
    assert video_only  # the layout this test needs: shards holding videos alone
    present = np.fromfile(os.path.join(local_dir_of(BucketURL.parse("s3://nodes/mixed/media"), tmp_path / "cache"),
                                     ".foresight-cache", "present"),
                          dtype=np.uint8)
    assert present[codes != codes[8]].any()  # the images were fetched
    assert not present[np.isin(ext.shard, video_only)].any()  # nothing of the video-only shards
