"""Hints and batched writes over etcd's request limits, on a real etcd and real node processes on loopback.

A restart of thousands of ranks hints thousands of per-rank shards: its hint record, its copy tasks and the copy
records are over etcd's ``--max-request-bytes`` (1.5 MiB) and ``--max-txn-ops`` (128) in one request. Every batched
write is cut by both (``cluster/etcd_txn.py``), and a hint written in several transactions is all or nothing as a
reader sees it: a failure part way leaves no hint and no task, and a retry succeeds.
"""
from __future__ import annotations

import json
import os
import threading

import pytest

from foresight.cluster.etcd_txn import TXN_BYTES
from foresight.cluster.membership import Cluster
from foresight.errors import NodeError
from foresight.replication.hint_client import (
    publish_checkpoint,
    release_replication_hints,
    replication_progress,
    set_replication_hints,
)
from foresight.replication.hints import FileHint
from foresight.replication.replica_etcd import ReplicaEtcd
from node_helpers import NodeProc, wait_for
from replication_helpers import Etcd

TOKEN = "large-hint-token"
RANKS = 10_240  # a DCP save of 10,240 ranks: __<rank>_0.distcp each, and .metadata


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with Etcd(str(tmp_path_factory.mktemp("etcd"))) as e:
        yield e.endpoint


def test_put_many_and_get_many_respect_etcds_request_and_txn_limits(etcd):
    cluster = Cluster(etcd, prefix="/limits")
    # 300 values of 20 KB: 100 per transaction would be 2 MB, over etcd's 1.5 MiB
    big = {cluster.key("big", f"{i:04d}"): json.dumps("x" * 20_000) for i in range(300)}
    assert cluster.put_many(big) > 3
    # 1,000 small ones: by operations (etcd refuses over 128 in one transaction)
    small = {cluster.key("small", f"{i:04d}"): json.dumps(i) for i in range(1000)}
    assert cluster.put_many(small) >= 10
    (got_big, got_small), _ = cluster.get_many([cluster.key("big") + "/", cluster.key("small") + "/"])
    assert len(got_big) == 300 and [v for _, v in got_small] == list(range(1000))
    _, values = cluster.get_many((), list(small))  # 1,000 single-key reads: cut by operations too
    assert values == list(range(1000))
    with pytest.raises(NodeError, match="over the .*request budget") as e:  # one value etcd would refuse: named
        cluster.put_many({cluster.key("huge"): "y" * (TXN_BYTES + 1)})
    assert "/limits/huge" in str(e.value)
    assignment = cluster.place("fp-large", num_shards=5000, nodes=["a", "b"])
    assert cluster.placement("fp-large") == assignment


class _Writer(ReplicaEtcd):
    """The replica manager's etcd side alone (its state: a cluster, a lease TTL)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.lease_ttl, self._bindings, self.node_id = cluster, 60, {}, "writer"


def test_a_key_written_in_parts_is_all_or_nothing_and_a_retry_succeeds(tmp_path):
    # an etcd whose request limit is under the writer's budget: the transaction carrying the big value is
    # refused by etcd itself, after the first ones were accepted
    with Etcd(str(tmp_path / "etcd"), args=["--max-request-bytes", str(64 << 10)]) as e:
        cluster = Cluster(e.endpoint, prefix="/parts")
        w = _Writer(cluster)
        key, extras_prefix = cluster.key("hint"), cluster.key("tasks") + "/"
        small = {f"{extras_prefix}{i:04d}": {"i": i, "state": "pending"} for i in range(300)}
        extras = dict(list(small.items())[:150])
        extras[f"{extras_prefix}0150-big"] = {"blob": "z" * (100 << 10)}  # in the second transaction
        extras.update(list(small.items())[150:])
        seen, stop = [], threading.Event()

        def reader():  # what a reader sees, head and extras at one revision, while the writes go on
            reader_cluster = Cluster(e.endpoint, prefix="/parts")
            while not stop.is_set():
                (tasks,), (head,) = reader_cluster.get_many([extras_prefix], [key])
                seen.append((head, len(tasks)))

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            lease = w._new_lease()
            with pytest.raises(NodeError, match="request is too large"):
                w._create_with(key, {"hint": 1}, lease, extras)
            (left,), (head,) = cluster.get_many([extras_prefix], [key])
            assert head is None and left == []  # nothing of the failed write stays
            extras[f"{extras_prefix}0150-big"] = {"blob": "z" * (8 << 10)}  # the retry fits
            assert w._create_with(key, {"hint": 2}, w._new_lease(), extras)
            (left,), (head,) = cluster.get_many([extras_prefix], [key])
            assert head == {"hint": 2} and len(left) == len(extras)
            assert not w._create_with(key, {"hint": 3}, w._new_lease(), extras)  # now it exists: refused
        finally:
            stop.set()
            t.join(timeout=30)
        assert seen, "the reader never ran"
        torn = [(h, n) for h, n in seen if h is not None and not h.get("writing") and n < len(extras)]
        assert not torn, f"a reader saw the key with {torn[0][1]} of {len(extras)} extras"


def test_a_hint_of_ten_thousand_files_is_written_read_back_and_its_copies_placed(etcd, tmp_path_factory):
    nodes = []
    try:
        for name in ("n0", "n1"):
            root = str(tmp_path_factory.mktemp(f"root-{name}"))
            n = NodeProc(root, str(tmp_path_factory.mktemp(f"work-{name}")), "--etcd", etcd, "--ttl", "5",
                         "--cpu-threshold", "101", "--safe-readers", "64", "--replica-quota", "1G:100000",
                         "--node-id", name, name=name)
            n.root = root
            nodes.append(n)
        name, job = "jobL/step-1", "jobL"
        d = os.path.join(nodes[0].root, "jobL", "step-1")
        os.makedirs(d)
        files = [".metadata"] + [f"__{r}_0.distcp" for r in range(RANKS)]
        for i, f in enumerate(files):
            with open(os.path.join(d, f), "wb") as out:
                out.write(i.to_bytes(8, "little"))
        published = publish_checkpoint(nodes[0].location, name, job=job, token=TOKEN)
        assert len(published["files"]) == len(files)
        hints = [FileHint(f, 8, 128, 8) for f in files]  # 128 readers each: a copy on n1 of every file
        plan = set_replication_hints(name, etcd=etcd, job=job, token=TOKEN, ttl_s=600, hints=hints)
        assert len(plan["files"]) == len(files) and all(f["new_nodes"] == ["n1"] for f in plan["files"])
        # the hint in etcd: a head and its files in parts, each request under etcd's limits
        cluster = Cluster(etcd)
        stored = dict(cluster._get_prefix(cluster.key("hints", job, "ckpt") + "/"))
        head = stored[cluster.key("hints", job, "ckpt", "jobL%2Fstep-1")]
        assert "files" not in head and head["file_parts"] > 1 and len(stored) == 1 + head["file_parts"]
        progress = replication_progress(name, etcd=etcd, job=job, token=TOKEN)
        assert progress["hint_live"] and progress["tasks"] == len(files)  # every copy task recorded
        assert sorted(progress["files"]) == sorted(files)  # the hint's files list read back whole
        # copies are placed from those tasks (all 10,241 take minutes on a loaded test machine: the first hundreds)
        placed = wait_for(lambda: (lambda p: p if p["done"] + p["failed"] >= 200 else None)(
            replication_progress(name, etcd=etcd, job=job, token=TOKEN)), timeout=300, what="copies placed")
        assert placed["failed"] == 0 and placed["errors"] == []
        assert release_replication_hints(name, etcd=etcd, job=job, token=TOKEN)["released"]
        assert not replication_progress(name, etcd=etcd, job=job, token=TOKEN)["hint_live"]
    finally:
        for n in nodes:
            n.terminate()
