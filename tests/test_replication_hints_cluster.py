"""Replication hints on a real cluster: etcd and storage-node processes on loopback, a real DCP checkpoint.

Covers issue 12: replica counts follow the formula and the caps, reads spread over the copies, copies are reclaimed
when the hint's TTL ends (never under a read), quotas and bad hints are refused with clear errors, and a node that
dies during a read storm leaves its readers on the other copies. Issue 20: a hinted restore never holds its ranks
for placement, and the new copies join the reads.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import shutil
import socket
import threading

import pyarrow.flight as flight

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foresight.checkpoint.dcp import ForesightStorageWriter
from foresight.cluster.membership import Cluster
from foresight.replication.hint_client import (
    ReplicaReader,
    publish_checkpoint,
    release_replication_hints,
    replication_progress,
    set_replication_hints,
    wait_for_replicas,
)
from foresight.replication.hints import FileHint, derive_dcp_hints
from foresight.replication.restore_schedule import HintedRestore
from foresight.errors import NodeError
from foresight.testing.etcd import EtcdProcess
from node_helpers import NodeProc, wait_for

SAFE = 64
TOKEN = "replica-token-1"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdProcess(str(tmp_path_factory.mktemp("etcd"))) as e:
        yield e.endpoint


def _node(tmp_path_factory, etcd, name, *extra):
    root = str(tmp_path_factory.mktemp(f"root-{name}"))
    n = NodeProc(root, str(tmp_path_factory.mktemp(f"work-{name}")), "--etcd", etcd, "--ttl", "3",
                 "--cpu-threshold", "101", "--safe-readers", str(SAFE), "--replica-quota", "1M:64", *extra,
                 "--node-id", name, name=name)
    n.root = root
    return n


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, etcd):
    started = []
    try:
        for i in range(4):
            started.append(_node(tmp_path_factory, etcd, f"n{i}"))
        yield started
    finally:
        for n in started:
            n.terminate()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step"
    state = {"emb": torch.randn(256, 256), "bias": torch.zeros(4)}  # whole tensors: read by the DP group
    dcp.save(state, storage_writer=ForesightStorageWriter(path))
    return str(path)


def _place(ckpt_dir, name, holders, job):
    """The checkpoint layer's base copies: the files on ``holders``, published there."""
    for n in holders:
        dst = os.path.join(n.root, *name.split("/"))
        shutil.copytree(ckpt_dir, dst)
        publish_checkpoint(n.location, name, job=job, token=TOKEN)


def _files(ckpt_dir):
    return {f: open(os.path.join(ckpt_dir, f), "rb").read() for f in os.listdir(ckpt_dir)}


def _hinted_on(nodes, name):
    return {n.node_id: sorted(os.listdir(os.path.join(n.root, ".replicas", *name.split("/"))))
            for n in nodes if os.path.isdir(os.path.join(n.root, ".replicas", *name.split("/")))
            and os.listdir(os.path.join(n.root, ".replicas", *name.split("/")))}


def test_replica_counts_follow_the_formula_and_the_node_cap(etcd, nodes, ckpt):
    name, job = "jobA/step-1", "jobA"
    _place(ckpt, name, nodes[:2], job)
    world, replicated = 1024, 128
    plan = set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=600, checkpoint_dir=ckpt,
                                 world_size=world, replicated_readers=replicated)
    by_path = {f["path"]: f for f in plan["files"]}
    meta, data = by_path[".metadata"], next(f for p, f in by_path.items() if p != ".metadata")
    assert meta["wanted"] == math.ceil(world / SAFE) and meta["replicas"] == 4 and meta["capped_by"] == "nodes"
    assert data["wanted"] == max(3, math.ceil(replicated / SAFE)) == data["replicas"] and data["capped_by"] is None
    for f in (meta, data):  # new copies only on nodes that did not hold the file, each node once
        assert set(f["holders"]) == {"n0", "n1"} and not set(f["new_nodes"]) & set(f["holders"])
        assert len(set(f["new_nodes"])) == len(f["new_nodes"]) == f["replicas"] - 2
    assert plan["copy_bytes"] == meta["size"] * 2 + data["size"]
    done = wait_for_replicas(name, etcd=etcd, job=job, token=TOKEN, timeout=120)
    assert done["done"] == 3 and done["failed"] == 0 and done["copied_bytes"] == plan["copy_bytes"]
    assert sorted(done["files"][".metadata"]["copies"]) == ["n0", "n1", "n2", "n3"]
    assert len(done["files"][data["path"]]["copies"]) == 3
    # the copies on disk are byte-identical to the checkpoint
    want = _files(ckpt)
    for node_id, files in _hinted_on(nodes, name).items():
        n = next(x for x in nodes if x.node_id == node_id)
        for f in files:
            assert open(os.path.join(n.root, ".replicas", "jobA", "step-1", f), "rb").read() == want[f]


def _hinted(etcd, nodes, ckpt, name, job, **hint):
    """Each test's own checkpoint: base copies on n0 and n1, hinted for 1024 ranks, every copy made."""
    _place(ckpt, name, nodes[:2], job)
    set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=600, checkpoint_dir=ckpt, world_size=1024,
                          **hint)
    return wait_for_replicas(name, etcd=etcd, job=job, token=TOKEN, timeout=120)


def _stats(nodes):
    return [json.loads(list(flight.FlightClient(n.location).do_action(flight.Action("replicas.stats", b"{}")))[0]
                       .body.to_pybytes()) for n in nodes]


def test_reads_spread_over_every_copy_and_return_the_checkpoint_bytes(etcd, nodes, ckpt):
    name, job = "jobR/step-1", "jobR"
    placed = _hinted(etcd, nodes, ckpt, name, job, replicated_readers=128)
    assert sorted(placed["files"][".metadata"]["copies"]) == ["n0", "n1", "n2", "n3"]
    want = _files(ckpt)
    try:
        with ReplicaReader(etcd, job=job, token=TOKEN) as reader, cf.ThreadPoolExecutor(8) as pool:
            wait_for(lambda: (lambda loads: len(loads) >= 4 and not any(loads.values()))(
                reader.refresh_loads(force=True)), timeout=30, what="the nodes advertising no reads (copies made)")
            got = list(pool.map(lambda _: reader.read(name, ".metadata"), range(64)))
            assert all(g == want[".metadata"] for g in got)
            assert set(reader.stats["by_node"]) == {"n0", "n1", "n2", "n3"}  # the hinted copies took readers too
            assert reader.stats["verify_failures"] == 0
    finally:
        release_replication_hints(name, etcd=etcd, job=job, token=TOKEN)


def test_bad_hints_and_bad_callers_are_refused_with_the_reason(etcd, nodes, ckpt):
    name, job = "jobA/step-1", "jobA"
    files = {h.path: h for h in derive_dcp_hints(ckpt, 64)}
    data = next(h for p, h in files.items() if p != ".metadata")

    def refused(match, name="jobB/step-1", **kw):
        args = {"etcd": etcd, "job": "jobB", "token": TOKEN, "ttl_s": 60, **kw}
        with pytest.raises(flight.FlightError, match=match):
            set_replication_hints(name, **args)

    _place(ckpt, "jobB/step-1", nodes[2:], "jobB")
    refused("does not have", hints=[FileHint("nope.bin", 10, 64, 10)])
    refused("file has", hints=[FileHint(data.path, data.size + 1, 64, 1)])
    refused("reader count", hints=[FileHint(data.path, data.size, 0, 1)])
    refused("reader count", hints=[FileHint(data.path, data.size, 10**9, 1)])
    refused("TTL", hints=[files[".metadata"]], ttl_s=0)
    refused("TTL", hints=[files[".metadata"]], ttl_s=10**9)
    refused("outside the checkpoint|bad file name", hints=[FileHint("../x", 1, 1, 1)])
    refused("own checkpoints", name=name, hints=[files[".metadata"]])  # jobA's checkpoint
    refused("bad token", hints=[files[".metadata"]], token="another-token")  # jobB's token is bound
    refused("no live node has published", name="jobB/step-9", hints=[files[".metadata"]])
    set_replication_hints("jobB/step-1", etcd=etcd, job="jobB", token=TOKEN, ttl_s=60, hints=[files[".metadata"]])
    refused("hint for this checkpoint is live", hints=[files[".metadata"]])
    with ReplicaReader(etcd, job="jobB", token="another-token") as reader, pytest.raises(Exception, match="bad token"):
        reader.read("jobB/step-1", ".metadata")


def test_quota_refuses_a_hint_or_places_what_fits(etcd, nodes, tmp_path):
    name, job = "jobQ/step-1", "jobQ"
    src = tmp_path / "q"
    dcp.save({"big": torch.randn(512, 1024)}, storage_writer=ForesightStorageWriter(src))  # 2 MiB > 1 MiB quota
    _place(str(src), name, nodes[:2], job)
    with pytest.raises(flight.FlightError, match="quota has"):
        set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=60, checkpoint_dir=str(src),
                              world_size=1024)
    plan = set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=60, checkpoint_dir=str(src),
                                 world_size=1024, allow_partial=True)
    by_path = {f["path"]: f for f in plan["files"]}
    big = next(f for p, f in by_path.items() if p != ".metadata")
    assert by_path[".metadata"]["new_nodes"] and big["new_nodes"] == [] and big["capped_by"] == "quota_bytes"
    assert plan["copy_bytes"] <= 1 << 20
    done = wait_for_replicas(name, etcd=etcd, job=job, token=TOKEN, timeout=120)
    assert done["failed"] == 0 and len(done["files"][big["path"]]["copies"]) == 2


def test_copies_are_reclaimed_when_the_ttl_ends_and_reads_fall_back(etcd, nodes, ckpt):
    name, job = "jobT/step-1", "jobT"
    _place(ckpt, name, nodes[:2], job)
    set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=8, checkpoint_dir=ckpt, world_size=1024)
    placed = wait_for_replicas(name, etcd=etcd, job=job, token=TOKEN, timeout=120)
    assert placed["done"] == 4  # both files on n2 and n3
    wait_for(lambda: not _hinted_on(nodes, name), timeout=60, what="hinted copies deleted after their TTL")
    p = replication_progress(name, etcd=etcd, job=job, token=TOKEN)
    assert not p["hint_live"] and all(set(f["copies"]) == {"n0", "n1"} for f in p["files"].values())
    with pytest.raises(NodeError, match="no live hint"):  # nothing left to wait for: said at once
        wait_for_replicas(name, etcd=etcd, job=job, token=TOKEN, timeout=120)
    with ReplicaReader(etcd, job=job, token=TOKEN) as reader:
        assert reader.read(name, ".metadata") == _files(ckpt)[".metadata"]
        assert set(reader.stats["by_node"]) <= {"n0", "n1"}


def test_a_node_dying_mid_storm_leaves_its_readers_on_the_other_copies(etcd, nodes, ckpt, tmp_path_factory):
    name, job = "jobS/step-1", "jobS"
    doomed = _node(tmp_path_factory, etcd, "n4")
    try:
        _place(ckpt, name, nodes[:3], job)
        set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=600, checkpoint_dir=ckpt,
                              world_size=2048)
        done = wait_for_replicas(name, etcd=etcd, job=job, token=TOKEN, timeout=120)
        assert all("n4" in f["copies"] for f in done["files"].values())
        want = _files(ckpt)
        files = sorted(want)
        killed = threading.Event()
        kill_lock = threading.Lock()
        with ReplicaReader(etcd, job=job, token=TOKEN, refresh_s=60) as reader, cf.ThreadPoolExecutor(8) as pool:
            def rank(i):
                out = [reader.read(name, f) == want[f] for f in files]
                with kill_lock:  # mid-storm, once n4 has served: later reads routed to it must move to other copies
                    if not killed.is_set() and reader.stats["by_node"].get("n4", 0) > 0:
                        doomed.kill()
                        killed.set()
                return out

            results = list(pool.map(rank, range(256)))
            assert all(all(r) for r in results)
            assert killed.is_set(), "n4 never served a read, so the storm never lost a serving node"

            # Whether a storm read was routed to n4 after its death depends on the load n4 last advertised (a high
            # one keeps readers away until its lease ends, and the storm may be over by then). Later ranks keep
            # reading from the reader's cached copy list, which still names n4: one of them is routed there and must
            # move to another copy, with every byte right.
            def a_read_moved_off_the_dead_node() -> bool:
                assert all(reader.read(name, f) == want[f] for f in files)
                return reader.stats["retries"] >= 1

            wait_for(a_read_moved_off_the_dead_node, timeout=120, what="a read routed to the dead node, retried")
            assert reader.stats["verify_failures"] == 0
    finally:
        doomed.kill()


def test_release_ends_a_hint_at_once(etcd, nodes, ckpt):
    name, job = "jobL/step-1", "jobL"
    placed = _hinted(etcd, nodes, ckpt, name, job)
    assert placed["done"] == 4 and _hinted_on(nodes, name)  # both files copied to n2 and n3
    before = sum(s["reclaimed"] for s in _stats(nodes))
    assert release_replication_hints(name, etcd=etcd, job=job, token=TOKEN)["released"]
    wait_for(lambda: not _hinted_on(nodes, name), timeout=60, what="released copies deleted")
    stats = _stats(nodes)
    assert sum(s["reclaimed"] for s in stats) - before >= placed["done"] and all(s["inflight"] == 0 for s in stats)


def test_a_hinted_restore_reads_at_once_and_its_copies_join_the_reads(etcd, nodes, ckpt):
    """The ranks start with the hint in flight (nobody waits for the plan or a slot); every byte is the
    checkpoint's; the copies are placed (the hint says the ranks are not held), each joins the ranks' list as it
    is registered (the hot files' records re-read alone, not the whole list), and after placement each rank reads
    in its own order."""
    name, job = "jobH/step-1", "jobH"
    _place(ckpt, name, nodes[:2], job)
    hints = derive_dcp_hints(ckpt, 1024)
    files = [h.path for h in hints] + ["shard-0"]  # a cold file no hint names (read through the same reader)
    want = _files(ckpt)
    with open(os.path.join(nodes[0].root, *name.split("/"), "shard-0"), "wb") as f:
        f.write(b"cold bytes")
    publish_checkpoint(nodes[0].location, name, job=job, token=TOKEN)
    want["shard-0"] = b"cold bytes"
    try:
        with ReplicaReader(etcd, job=job, token=TOKEN, refresh_s=3600, load_refresh_s=3600) as replicas:
            replicas.copies(name)
            refreshes, calls = replicas.stats["copy_refreshes"], replicas.cluster.calls
            restore = HintedRestore(name, etcd=etcd, job=job, token=TOKEN, hints=hints, reader=replicas,
                                    cold_bytes=16 << 10, cold_reads=16, progress_s=0).start()
            with cf.ThreadPoolExecutor(16) as pool:
                got = list(pool.map(lambda r: {f: bytes(replicas.read(name, f)) for f in restore.order(files)},
                                    range(16)))
            assert all(g == want for g in got)
            restore.join()
            assert restore.error is None and restore.plan["copies_join"] is True and restore.place_s is not None
            assert restore.plan["new_replicas"] == 2 * len(hints) and restore.placed["complete"]
            assert len(restore.joined_s) == restore.plan["new_replicas"]  # each copy seen listed, once
            assert all(len(replicas.copies(name)[h.path]) == 4 for h in hints)  # the ranks were told
            assert replicas.stats["file_refreshes"] == restore.stats["polls"] >= 1
            # the copies' records came with the node's progress, one Flight call per poll: the reader asked etcd
            # for the nodes' loads once, the coordinator's pick asked for the live nodes once, and nothing else
            assert replicas.cluster.calls - calls == 2
            assert replicas.stats["copy_refreshes"] == refreshes  # the whole list was never asked for again
            assert replicas.copies(name)["shard-0"]  # the cold file's records kept
            assert restore.order(files[::-1]) == [".metadata"] + [f for f in files[::-1] if f != ".metadata"]
        # the placement's time went into the cluster's running mean; the next plan prices copies with it
        cluster = Cluster(etcd)
        measured = dict(cluster._get_prefix(cluster.key("replicas", ".placement")))
        sample = measured[cluster.key("replicas", ".placement")]
        assert sample["samples"] >= 1 and sample["place_s"] > 0
        _place(ckpt, "jobI/step-2", nodes[2:], "jobI")
        plan = set_replication_hints("jobI/step-2", etcd=etcd, job="jobI", token=TOKEN, ttl_s=600, hints=hints)
        assert plan["placement_cost_s"] == max(2 * 0.25, sample["place_s"])  # the nodes' poll_s is 0.25
        release_replication_hints("jobI/step-2", etcd=etcd, job="jobI", token=TOKEN)
    finally:
        release_replication_hints(name, etcd=etcd, job=job, token=TOKEN)


def test_while_placement_runs_every_rank_reads_its_cold_files_first_and_nobody_waits(etcd, nodes, ckpt):
    """The hint goes to a node that never answers (a listening socket nobody serves), so placement is pending:
    every rank reads its cold files first (local rank 0, which fetches for its host, too), and a rank that reaches
    the hot file reads the copies that exist at once, admitted ``depth`` per listed copy. When the node is gone the hint goes to the cluster, its
    copies are placed, and the order given comes back (the host's other ranks keep reading their own files
    while local rank 0 fetches)."""
    name, job = "jobO/step-1", "jobO"
    _place(ckpt, name, nodes[:2], job)
    hints = derive_dcp_hints(ckpt, 64)
    data = next(h.path for h in hints if h.path != ".metadata")
    want = _files(ckpt)
    silent, later = socket.socket(), socket.socket()
    for s in (silent, later):
        s.bind(("127.0.0.1", 0))
        s.listen(64)
    try:
        with ReplicaReader(etcd, job=job, token=TOKEN, refresh_s=3600) as replicas:
            replicas.copies(name)
            restore = HintedRestore(name, etcd=etcd, job=job, token=TOKEN, hints=hints, reader=replicas,
                                    ranks_per_host=2, depth=1, node=f"grpc://127.0.0.1:{silent.getsockname()[1]}")
            files = [".metadata", data, "shard-0"]
            assert restore.order(files) == files and not restore.placing  # not started: the order given
            restore.start()
            late = HintedRestore(name, etcd=etcd, job=job, token=TOKEN, hints=hints, reader=replicas,
                                 ranks_per_host=2, node=f"grpc://127.0.0.1:{later.getsockname()[1]}").start()
            cold_first = [".metadata", "shard-0", data]
            assert restore.placing and not restore.planned.is_set()
            assert [restore.order(files, local_rank=r % 2) for r in range(8)] == [cold_first] * 8
            assert restore.order(files) == cold_first
            # a rank at the hot file while the plan is out reads the base copies now (a bounded wait, not a timing)
            assert cf.ThreadPoolExecutor(1).submit(replicas.read, name, data).result(timeout=60) == want[data]
            assert restore.placing  # the read went while placement was still pending
            # admission: 2 listed copies x depth 1 hot fetches in flight; a third waits for one to end (not for
            # placement), then goes
            reader = restore.scheduled(replicas)
            restore._acquire(data)
            restore._acquire(data)
            third = cf.ThreadPoolExecutor(1).submit(reader.read, name, data)
            with pytest.raises(cf.TimeoutError):
                third.result(timeout=0.5)  # waits for a slot (a bound on a hang, not a timing figure)
            restore._release(data)
            assert third.result(timeout=60) == want[data] and restore.peak[data] == 2
            restore._release(data)
            assert reader.read(name, ".metadata") == want[".metadata"]  # never through a slot
            silent.close()  # the node is gone: the hint goes to the cluster
            restore.join()
            assert restore.error is None and restore.placed["complete"] and restore.plan["copies_join"] is True
            assert not restore.placing and len(restore.joined_s) == restore.plan["new_replicas"] > 0
            assert restore.order(files, local_rank=0) == files  # placement over: the order given
            assert restore.order(files, local_rank=1) == cold_first  # its own reads while the host's fetch runs
            later.close()
            late.join()  # its hint reached the cluster after the first one's: refused, the base copies serve
            assert late.error is not None and late.stats["failures"] == 1 and late.ready.is_set()
            assert late.order(files, local_rank=0) == files
    finally:
        silent.close()
        later.close()
        release_replication_hints(name, etcd=etcd, job=job, token=TOKEN)
