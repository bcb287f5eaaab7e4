"""Replication hints derived from a real DCP checkpoint, and the replica planner's formula, caps and placement."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foresight.checkpoint.dcp import ForesightStorageWriter
from foresight.replication.hints import FileHint, HintError, _chunk_readers, derive_dcp_hints, validate_hints
from foresight.replication.replica_plan import (cold_lead_s, finish_replicas, finish_time_s, paying_replicas,
                                                plan_replicas, wanted_replicas)
from foresight.replication.replica_requests import decode_hints


@pytest.fixture
def dcp_ckpt(tmp_path):
    state = {"emb": torch.randn(64, 8), "bias": torch.zeros(4), "extra": {"step": 7, "note": "hi"}}
    dcp.save(state, storage_writer=ForesightStorageWriter(tmp_path / "ck"))
    return tmp_path / "ck"


def test_hints_from_a_dcp_checkpoint_cover_every_file(dcp_ckpt):
    hints = {h.path: h for h in derive_dcp_hints(str(dcp_ckpt), world_size=2048)}
    files = {p.name: p.stat().st_size for p in dcp_ckpt.iterdir()}
    assert set(hints) == set(files)  # .metadata and every data file, nothing else
    assert all(h.size == files[h.path] for h in hints.values())
    assert hints[".metadata"].readers == 2048
    data = next(h for p, h in hints.items() if p != ".metadata")
    assert data.readers == 2048 and 0 < data.hot_bytes <= data.size  # whole tensors: every rank reads them
    validate_hints(hints.values(), known=files, ttl_s=600)


def test_replicated_readers_follow_the_data_parallel_group(dcp_ckpt, tmp_path):
    # whole tensors alone: a file is read by the data-parallel group, not by every rank
    tensors = tmp_path / "tensors"
    dcp.save({"emb": torch.randn(64, 8), "bias": torch.zeros(4)}, storage_writer=ForesightStorageWriter(tensors))
    hints = {h.path: h for h in derive_dcp_hints(str(tensors), world_size=64, replicated_readers=8)}
    data = next(h for p, h in hints.items() if p != ".metadata")
    assert data.readers == 8 and data.hot_bytes == (64 * 8 + 4) * 4  # every tensor byte is read by those 8
    assert hints[".metadata"].readers == 64
    # with bytes items (extra state) in the same file: every rank reads the file, but only those items' bytes are
    # hot for all 64; the tensors' bytes (read by 8) are not, as they are when all 64 ranks read the tensors too
    def mixed(replicated: int):
        hints = derive_dcp_hints(str(dcp_ckpt), world_size=64, replicated_readers=replicated)
        return next(h for h in hints if h.path != ".metadata")

    assert mixed(8).readers == mixed(64).readers == 64
    assert mixed(8).hot_bytes == mixed(64).hot_bytes - (64 * 8 + 4) * 4 > 0


@pytest.mark.parametrize("offset,length,dim0,world,expected", [
    (0, 8, 16, 2, 1), (8, 8, 16, 2, 1),      # same world size: each chunk has its owner
    (0, 8, 16, 4, 2), (0, 16, 16, 4, 4),     # loaded by more ranks: a chunk spans several slices
    (0, 8, 16, 1, 1), (4, 8, 16, 2, 2),      # fewer ranks; a chunk straddling a slice boundary
])
def test_sharded_chunk_readers(offset, length, dim0, world, expected):
    assert _chunk_readers(offset, length, dim0, world) == expected


def test_missing_metadata_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match=r"\.metadata"):
        derive_dcp_hints(str(tmp_path), world_size=4)


def _hint(path, size, readers, hot=None):
    return FileHint(path, size, readers, size if hot is None else hot)


def test_replica_count_follows_the_formula_and_the_caps():
    nodes = {f"n{i}": 0.0 for i in range(10)}
    hints = [_hint("meta", 1 << 10, 2048), _hint("rep", 1 << 20, 300), _hint("shard", 1 << 30, 1)]
    plan = {f.path: f for f in plan_replicas(hints, nodes, safe_readers=64, base_replicas=3).files}
    assert plan["rep"].wanted == math.ceil(300 / 64) == 5 and plan["rep"].replicas == 5
    assert plan["shard"].wanted == 3 and plan["shard"].replicas == 3  # never below the base replication
    assert plan["meta"].wanted == 32 and plan["meta"].replicas == 10 and plan["meta"].capped_by == "nodes"
    capped = {f.path: f for f in plan_replicas(hints, nodes, safe_readers=64, max_per_file=4).files}
    assert capped["meta"].replicas == 4 and capped["meta"].capped_by == "per_file"
    assert wanted_replicas(1, 64, 3) == 3 and wanted_replicas(6400, 64, 3) == 100


def test_quota_goes_to_hot_and_small_files_first():
    nodes = {f"n{i}": 0.0 for i in range(8)}
    hints = [_hint("big-hot", 100, 512), _hint("small-hot", 10, 512), _hint("cold", 10, 1)]
    plan = plan_replicas(hints, nodes, safe_readers=64, base_replicas=1, quota_bytes=8 * 10 + 2 * 100)
    by = {f.path: f for f in plan.files}
    assert [f.path for f in plan.files] == ["small-hot", "big-hot", "cold"]
    assert len(by["small-hot"].new_nodes) == 8 and by["small-hot"].capped_by is None
    assert len(by["big-hot"].new_nodes) == 2 and by["big-hot"].capped_by == "quota_bytes"
    assert plan.copy_bytes <= 8 * 10 + 2 * 100
    by_count = {f.path: f for f in plan_replicas(hints, nodes, safe_readers=64, base_replicas=1,
                                                  quota_replicas=3).files}
    assert sum(len(f.new_nodes) for f in by_count.values()) == 3 and by_count["big-hot"].capped_by == "quota_replicas"


def test_copies_go_to_distinct_least_loaded_nodes():
    nodes = {"busy": 50.0, "idle": 0.0, "mid": 10.0, "held": 0.0}
    plan = plan_replicas([_hint("f", 1, 128)], nodes, holders={"f": ["held"]}, safe_readers=64, base_replicas=1)
    f = plan.files[0]
    assert f.replicas == 2 and f.holders == ["held"] and f.new_nodes == ["idle"]
    plan = plan_replicas([_hint("f", 1, 64 * 3)], nodes, holders={"f": ["held"]}, safe_readers=64, base_replicas=1)
    assert plan.files[0].new_nodes == ["idle", "mid"] and len(set(plan.files[0].new_nodes + ["held"])) == 3
    # the projected load moves the next file's copies elsewhere
    plan = plan_replicas([_hint("a", 1, 128), _hint("b", 2, 128)], {"x": 0.0, "y": 1.0, "z": 2.0},
                         safe_readers=64, base_replicas=1)
    assert plan.files[0].new_nodes == ["x", "y"] and plan.files[1].new_nodes == ["z", "x"]


def test_files_packing_a_hot_tensor_with_cold_ones_are_reported():
    plan = plan_replicas([_hint("mixed", 1000, 512, hot=10), _hint("pure", 10, 512)], {f"n{i}": 0 for i in range(4)},
                         safe_readers=64, base_replicas=1)
    wasteful = plan.wasteful()
    assert [f.path for f in wasteful] == ["mixed"] and wasteful[0].granularity_waste == 990


@pytest.mark.parametrize("bad,match", [
    (_hint("../etc/passwd", 1, 1), "outside"),
    (_hint("/abs", 1, 1), "outside"),
    (_hint("f", 1, 0), "reader count"),
    (_hint("f", 1, 10**9), "reader count"),
    (_hint("nope", 1, 1), "does not have"),
    (_hint("f", 2, 1), "the file has"),
])
def test_bad_hints_are_refused_clearly(bad, match):
    with pytest.raises(HintError, match=match):
        validate_hints([bad], known={"f": 1})


def test_bad_ttl_and_unknown_holders_are_refused():
    with pytest.raises(HintError, match="TTL"):
        validate_hints([_hint("f", 1, 1)], ttl_s=0)
    with pytest.raises(HintError, match="not available"):
        plan_replicas([_hint("f", 1, 1)], {"a": 0}, holders={"f": ["ghost"]})


NODES8 = {f"n{i}": 0.0 for i in range(8)}
BASE = {f: ["n0", "n1", "n2"] for f in ("hot", "meta")}
RATE = dict(node_bytes_per_s=4 << 20, node_requests_per_s=200, placement_cost_s=0.5)


def test_a_copy_is_placed_only_when_it_saves_more_than_its_placement_costs():
    # the restart bench's fsdp7b file: 256 KiB, 0.0625 s per read at 4 MiB/s; 512 ranks or, shared, 64 hosts
    hot = 256 << 10
    per_rank = plan_replicas([_hint("hot", hot, 512)], NODES8, holders=BASE, safe_readers=16, **RATE)
    assert per_rank.files[0].replicas == 8 and per_rank.files[0].capped_by == "nodes"  # every copy pays
    # one reader per host: a 4th copy saves 64 x 0.0625 x (1/3 - 1/4) = 0.33 s, it costs 0.5 + 0.0625 s
    per_host = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, **RATE)
    f = per_host.files[0]
    assert f.wanted == 4 and f.replicas == 3 and f.new_nodes == [] and f.capped_by == "placement_cost"
    assert per_host.copy_bytes == 0
    # cheaper placement: the same copy pays
    cheap = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16,
                          **dict(RATE, placement_cost_s=0.1))
    assert cheap.files[0].replicas == 4 and cheap.files[0].capped_by is None
    # a small file: the request rate sets its read time (5 ms), too short for any copy to pay
    meta = plan_replicas([_hint("meta", 4096, 512)], NODES8, holders=BASE, safe_readers=16, **RATE)
    assert meta.files[0].replicas == 3 and meta.files[0].capped_by == "placement_cost"


def test_the_cost_rule_stops_at_the_last_copy_that_pays_and_spares_the_base():
    # 512 readers of 128 KiB (1/32 s per read): copy c+1 saves 16 x (1/c - 1/(c+1)); pays up to 6 copies at 0.53 s
    n = paying_replicas(512, 128 << 10, 3, 8, node_bytes_per_s=4 << 20, placement_cost_s=0.5)
    saving = [512 / 32 * (1 / c - 1 / (c + 1)) for c in range(3, 8)]
    assert n == 3 + sum(1 for s in saving if s > 0.5 + 1 / 32) == 6
    assert paying_replicas(512, 128 << 10, 3, 8, node_bytes_per_s=None, placement_cost_s=0.5) == 8  # rule off
    # a file short of the base replication is topped up whatever the rule says
    plan = plan_replicas([_hint("hot", 4096, 2)], NODES8, holders={"hot": ["n0"]}, safe_readers=16, **RATE)
    assert plan.files[0].replicas == 3 and plan.files[0].capped_by is None


def test_a_cold_first_schedule_hides_placement_so_per_host_copies_pay():
    # the bench's fsdp7b restart at 512 ranks on 8 nodes: the shards (512 x 32 KiB) take 0.5 s of the nodes' time
    lead = cold_lead_s(512 * (32 << 10), 512, 8, node_bytes_per_s=4 << 20, node_requests_per_s=200)
    assert lead == pytest.approx(0.5)
    assert cold_lead_s(0, 1600, 8, node_bytes_per_s=4 << 20, node_requests_per_s=200) == pytest.approx(1.0)
    assert cold_lead_s(1 << 30, 10, 8, node_bytes_per_s=None) == 0.0  # no known rate: nothing hidden
    # one reader per host: the 4th copy saved 0.33 s against 0.5 + 0.0625 s; placed during the shards it costs
    # only its source read, so the formula's 4 copies are placed
    hot = 256 << 10
    hidden = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, lead_s=lead, **RATE)
    f = hidden.files[0]
    assert f.wanted == 4 and f.replicas == 4 and len(f.new_nodes) == 1 and f.capped_by is None
    # a head start shorter than the placement hides part of it: 0.3 s left + 0.0625 > 0.33 s saved
    part = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, lead_s=0.2, **RATE)
    assert part.files[0].replicas == 3 and part.files[0].capped_by == "placement_cost"
    with pytest.raises(HintError, match="cold bytes"):
        cold_lead_s(-1, 0, 8, node_bytes_per_s=1)


def test_the_hint_request_carries_the_cold_reads_checked():
    req = {"job": "run-7", "checkpoint": "run-7/step-1", "ttl_s": 60,
           "files": [{"path": "f", "size": 1, "readers": 2, "hot_bytes": 1}]}
    assert decode_hints(req)["cold_bytes"] == 0 and decode_hints(req)["cold_reads"] == 0
    got = decode_hints(dict(req, cold_bytes=1 << 24, cold_reads=512))
    assert (got["cold_bytes"], got["cold_reads"]) == (1 << 24, 512)
    for bad in (-1, 1.5, True, "9"):
        with pytest.raises(HintError, match="cold_bytes must be an integer"):
            decode_hints(dict(req, cold_bytes=bad))


def test_copies_that_join_a_running_restart_pay_while_the_base_copies_are_still_busy():
    hot = 256 << 10  # 0.0625 s per read at 4 MiB/s; 64 host readers keep 3 base copies busy 64 x 0.0625 / 3 s
    held = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, **RATE)
    assert held.files[0].replicas == 3  # readers held for the copies: the 4th costs more than it saves
    joined = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, join=True, **RATE)
    f = joined.files[0]  # not held: copies land from 0.56 s while the base copies have 1.33 s of reads
    assert f.wanted == 4 and f.sized_by == "finish" and f.capped_by == "nodes"  # 0.91 s on 8 copies, 1.33 on 3
    assert f.replicas == finish_replicas(64, hot / (4 << 20), 3, 8, land_s=0.5) == 8 and len(f.new_nodes) == 5
    # few readers: the base copies are done (6 x 0.0625 / 3 = 0.125 s) before any copy could land
    few = plan_replicas([_hint("hot", hot, 6)], NODES8, holders=BASE, safe_readers=1, join=True, **RATE)
    assert few.files[0].wanted == 6 and few.files[0].replicas == 3 and few.files[0].capped_by == "placement_cost"
    assert paying_replicas(64, hot, 3, 8, node_bytes_per_s=4 << 20, placement_cost_s=0.5, join=True) == 8
    # landing at 1.2 s: 6 copies end the reads soonest (1.329 s; 1.333 on 3, 1.344 on 8)
    assert paying_replicas(64, hot, 3, 8, node_bytes_per_s=4 << 20, placement_cost_s=1.2, join=True) == 6
    assert paying_replicas(64, hot, 3, 8, node_bytes_per_s=4 << 20, placement_cost_s=2.0, join=True) == 3
    got = decode_hints({"job": "run-7", "checkpoint": "run-7/step-1", "ttl_s": 60, "copies_join": True,
                        "files": [{"path": "f", "size": 1, "readers": 2, "hot_bytes": 1}]})
    assert got["copies_join"] is True
    with pytest.raises(HintError, match="copies_join must be true or false"):
        decode_hints({"job": "run-7", "checkpoint": "run-7/step-1", "ttl_s": 60, "copies_join": 1,
                      "files": [{"path": "f", "size": 1, "readers": 2, "hot_bytes": 1}]})


def test_copies_for_readers_not_held_are_sized_by_the_files_finish_beyond_the_formula():
    """Readers not held for the copies: the count is the one that ends the file's reads soonest, each copy serving
    from when it lands (source reads queued at the holders), up to the node cap and past the safe-readers formula."""
    hot, t = 256 << 10, 0.0625  # the bench's fsdp7b hot file at 4 MiB/s: 64 host readers, 1.33 s on 3 copies
    assert finish_time_s(64, t, 3, 3, land_s=0.0) == pytest.approx(64 * t / 3)
    # 8 copies: 5 source reads (2 rounds at 3 holders) land at t, t, t, 2t, 2t and take 5 t of holder time
    assert finish_time_s(64, t, 3, 8, land_s=0.0) == pytest.approx((64 * t + 5 * t + 7 * t) / 8)
    assert finish_time_s(4, t, 3, 8, land_s=0.0) == math.inf  # the last copy lands after the reads are over
    # placement hidden behind the cold reads (lead >= placement cost): every node gets a copy, 4 more than the formula
    lead = cold_lead_s(512 * (32 << 10), 512, 8, node_bytes_per_s=4 << 20, node_requests_per_s=200)
    plan = plan_replicas([_hint("hot", hot, 64), _hint("meta", 4096, 64)], NODES8, holders=BASE, safe_readers=16,
                         join=True, lead_s=lead, **RATE)
    by = {f.path: f for f in plan.files}
    assert by["hot"].wanted == 4 and by["hot"].replicas == 8 and by["hot"].capped_by == "nodes"
    assert by["hot"].sized_by == "finish" and sorted(by["hot"].new_nodes) == ["n3", "n4", "n5", "n6", "n7"]
    assert by["meta"].replicas == 8 and plan.copy_bytes == 5 * (hot + 4096)  # 64 x 5 ms of requests: it pays too
    # no head start: the small file's reads (0.11 s on 3 copies) end before a copy lands (0.5 s)
    bare = plan_replicas([_hint("hot", hot, 64), _hint("meta", 4096, 64)], NODES8, holders=BASE, safe_readers=16,
                         join=True, **RATE)
    assert {f.path: f.replicas for f in bare.files} == {"hot": 8, "meta": 3}
    # a per-file cap bounds it, and is named
    capped = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, join=True, lead_s=lead,
                           max_per_file=5, **RATE)
    assert capped.files[0].replicas == 5 and capped.files[0].capped_by == "per_file"
    # placement slower than the base copies' work: none; without a known rate the formula sizes it
    assert finish_replicas(64, t, 3, 8, land_s=1.5) == 3
    formula = plan_replicas([_hint("hot", hot, 64)], NODES8, holders=BASE, safe_readers=16, join=True)
    assert formula.files[0].replicas == 4 and formula.files[0].sized_by == "formula"
