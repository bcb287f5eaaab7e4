"""The remote-merge bench still runs end to end (``--smoke``: small checkpoint, 100 ms link, both urgent runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from installed import require

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
BENCH = os.path.join(BENCH_DIR, "remote_merge.py")


def test_remote_merge_bench_smoke(tmp_path):
    require("etcd")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--out", str(out), "--dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "merge latency reduction" in proc.stdout and "urgent evaluation" in proc.stdout
    data = json.loads((out / "remote_merge_smoke.json").read_text())
    m = data["merge"]
    assert m["outputs_match_saved_state"]
    assert set(m["tensors_checked"]) == {"foresight", "baseline", "coalesced"}
    assert set(m["tensors_checked"].values()) == {data["checkpoint"]["tensors"]}
    assert m["baseline"]["round_trips"] > data["checkpoint"]["tensors"]  # one per chunk, split ones twice
    assert m["coalesced_remote"]["round_trips"] <= 4  # .metadata, a probe, one read per data file
    assert data["checkpoint"]["under_16KiB"] > 0.6 and data["checkpoint"]["bytes_in_large"] > 0.5
    assert data["replication"]["bytes"] > 0 and data["wan"]["rtt_ms_measured"] >= data["wan"]["rtt_ms"] - 2
    assert [r["lane"] for r in data["urgent"]] == ["fifo", "priority"]
    # merging as units arrive: a save as fast as the disk and one paced to last longer than the transfer
    arrival = data["arrival"]
    assert [r["write_MBps_per_rank"] for r in arrival] == ["disk", 2.0] and arrival[1]["save_longer_than_transfer"]
    for r in arrival:
        assert r["outputs_match_saved_state"] and r["relayouts"] == 0
        assert r["filled_at_commit_MiB"] == 0  # every unit merged as it arrived, none left for the commit
        assert r["commit_to_merged_arrival_s"] > 0 and r["commit_to_merged_coalesced_remote_s"] > 0
        assert r["commit_to_merged_bulk_copy_s"] > 0
    # the bulk-copy alternative: one stream and two, each copy merged and checked against the saved state
    assert [b["streams"] for b in data["bulk"]] == [1, 2]
    assert all(b["tensors_checked"] == data["checkpoint"]["tensors"] for b in data["bulk"])
    # 1 and 2 jobs at once over the one link: each job merged on arrival and bulk-copied, both checked
    assert [j["jobs"] for j in data["jobs"]] == [1, 2]
    for j in data["jobs"]:
        assert j["outputs_match_saved_state"] and j["bulk_streams_per_job"] == 2
        assert len(j["commit_to_merged_arrival_s"]) == len(j["commit_to_merged_bulk_copy_s"]) == j["jobs"]
        assert len(j["save_s"]) == j["jobs"] and min(j["save_s"]) > 0  # timed, not assumed instantaneous
        assert j["transfer_s_at_link_rate"] > 0 and isinstance(j["save_longer_than_transfer"], bool)
    # the targets table: the save longer than the transfer, the instantaneous ones, the merge latency
    cases = [(t["target"], t["case"]) for t in data["targets"]]
    assert len(cases) == 2 + 2 + 1 and all(isinstance(t["met"], bool) for t in data["targets"])
    assert "issue 20 targets" in proc.stdout
    assert (out / "remote_merge_smoke.png").stat().st_size > 0
    assert not (tmp_path / "work").exists()  # scratch files cleaned up


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("remote_merge_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_merges_are_checked_against_the_saved_state_and_a_reversed_shard_fails(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    from foresight.checkpoint import ForesightStorageWriter
    from foresight.replication.merge import merge_checkpoint
    from foresight.replication.source import LocalSource

    bench = _bench()
    state = bench.paper_shaped(12, 3, 64 << 10)
    dcp.save(state, storage_writer=ForesightStorageWriter(str(tmp_path / "ckpt")), no_dist=True)
    groups = {"vision.": "vision", "text.": "text"}
    written = merge_checkpoint(LocalSource(str(tmp_path / "ckpt")), str(tmp_path / "out"), groups=groups)
    assert bench.check_merged(written, state) == len(state)
    # a merge that put one rank's shard (the first half of the rows) in reverse row order
    path = written["text"][0]
    tensors = load_file(path)
    name = next(k for k, v in tensors.items() if v.dim() == 2)
    half = tensors[name].shape[0] // 2
    tensors[name] = torch.cat([tensors[name][:half].flip(0), tensors[name][half:]])
    save_file(tensors, path)
    with pytest.raises(SystemExit, match=f"merged tensor '{name}' in .* differs from the saved state"):
        bench.check_merged(written, state)


def test_replication_overlap_bench_smoke(tmp_path):
    result = os.path.join(BENCH_DIR, "results", "replication_overlap_smoke.json")
    if os.path.exists(result):
        os.unlink(result)  # only this run's file counts
    proc = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "replication_overlap.py"), "--smoke", "--dir",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "send while saving" in proc.stdout
    (row,) = json.loads(open(result).read())["rows"]
    assert 0 <= row["MiB_left_at_commit"] <= row["MiB"] and row["commit_to_ready_s"] > 0
    assert not (tmp_path / "work").exists()
