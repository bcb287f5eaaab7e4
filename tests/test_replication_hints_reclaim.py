"""Replica lifetime on two in-process nodes and a real etcd: reclaim waits for in-flight reads, corrupt copies are
never served to a reader, and the per-node service limit's token buckets."""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pyarrow.flight as flight
import pytest

from foresight.replication.hint_client import (
    ReplicaReader,
    publish_checkpoint,
    release_replication_hints,
    replication_progress,
    set_replication_hints,
    wait_for_replicas,
)
from foresight.replication.hints import FileHint
from foresight.errors import ProtocolError
from foresight.cluster.auth import call_options
from foresight.cluster.membership import Cluster
from foresight.testing.etcd import EtcdProcess
from foresight.replication.replica_manager import ReplicaManager
from foresight.replication.replica_requests import ckpt_key
from foresight.node.server import NodeServer
from foresight.cluster.throttle import ServiceLimit, TokenBucket, parse_amounts
from node_helpers import wait_for

JOB, TOKEN, NAME, FILE = "jobD", "reclaim-token-1", "jobD/step-1", "blob.bin"
PREFIX = "/t12-reclaim"


class _Node:
    """A NodeServer with its replica manager, registered in the cluster as `foresight node serve --etcd` does."""

    def __init__(self, root: str, etcd: str, node_id: str, limit: ServiceLimit, **manager) -> None:
        self.server = NodeServer(root, node_id=node_id, cpu_threshold=101)
        self.cluster = Cluster(etcd, prefix=PREFIX)
        self.reg = self.cluster.register_node(node_id, lambda: {"node": node_id, "location": self.server.location,
                                                                  "instance": self.server.instance}, ttl=5)
        self.etcd = Cluster(etcd, prefix=PREFIX)  # the manager's own client: its calls counted apart
        self.manager = ReplicaManager(self.server, self.etcd, limit=limit, **{"lease_ttl": 5, **manager})
        self.location, self.root = self.server.location, root

    def close(self) -> None:
        self.manager.close()
        self.reg.close()
        self.server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EtcdProcess(str(tmp_path_factory.mktemp("etcd"))) as etcd:
        a = _Node(str(tmp_path_factory.mktemp("a")), etcd.endpoint, "a", ServiceLimit())
        b = _Node(str(tmp_path_factory.mktemp("b")), etcd.endpoint, "b", ServiceLimit.parse("1M"))  # slow reads
        data = np.random.default_rng(3).integers(0, 255, 6 << 20, dtype=np.uint8).tobytes()
        os.makedirs(os.path.join(a.root, JOB, "step-1"))
        with open(os.path.join(a.root, JOB, "step-1", FILE), "wb") as f:
            f.write(data)
        publish_checkpoint(a.location, NAME, job=JOB, token=TOKEN)
        try:
            yield {"etcd": etcd.endpoint, "a": a, "b": b, "data": data,
                   "copy": os.path.join(b.root, ".replicas", JOB, "step-1", FILE)}
        finally:
            b.close()
            a.close()


def _hint(c):
    set_replication_hints(NAME, node=c["a"].location, job=JOB, token=TOKEN, ttl_s=600,
                          hints=[FileHint(FILE, len(c["data"]), 1024, len(c["data"]))])
    done = wait_for_replicas(NAME, node=c["a"].location, job=JOB, token=TOKEN, timeout=120)
    assert done["files"][FILE]["copies"] == ["a", "b"] and os.path.exists(c["copy"])


def _ticket():
    return flight.Ticket(json.dumps({"kind": "ckpt.get", "job": JOB, "checkpoint": NAME, "file": FILE}).encode())


def test_reclaim_waits_for_a_read_in_progress(cluster):
    c, b = cluster, cluster["b"]
    _hint(c)
    client = flight.FlightClient(b.location)
    try:
        stream = client.do_get(_ticket(), call_options(JOB, TOKEN, timeout=120))
        first = stream.read_chunk().data  # the read is under way: 6 MiB at 1 MiB/s
        release_replication_hints(NAME, node=c["a"].location, job=JOB, token=TOKEN)
        wait_for(lambda: b.manager.stats["reclaimed"] >= 1, timeout=60, what="the copy's key to expire")
        assert os.path.exists(c["copy"])  # deferred: the read still holds it
        with pytest.raises(flight.FlightError, match="serves no copy"):  # but no new read starts on it
            client.do_get(_ticket(), call_options(JOB, TOKEN, timeout=60)).read_all()
        rest = [chunk.data for chunk in stream]
        got = b"".join(bytes(batch.column(0)[i].as_buffer()) for batch in [first, *rest]
                       for i in range(len(batch.column(0))))
        assert got == c["data"]
        wait_for(lambda: not os.path.exists(c["copy"]), timeout=30, what="the copy deleted after its read")
    finally:
        client.close()
    assert b.manager.inflight == 0


def test_a_corrupt_copy_is_never_served_to_a_reader(cluster, monkeypatch):
    c = cluster
    _hint(c)
    with open(c["copy"], "r+b") as f:  # same size, other bytes: only the checksum can tell
        f.write(b"\xff" * 4096)
    with ReplicaReader(c["etcd"], job=JOB, token=TOKEN, prefix=PREFIX, retry_s=0) as reader:
        wait_for(lambda: reader.refresh_loads(force=True).get("b") == 0, timeout=30, what="b advertising no reads")
        for _ in range(64):  # a and b look alike to the reader: it picks either at random
            assert reader.read(NAME, FILE) == c["data"]
            if reader.stats["verify_failures"]:
                break
        assert reader.stats["verify_failures"] >= 1 and reader.stats["by_node"].get("a", 0) >= 1
    b = c["b"].manager
    reclaimed, unlink, counted = b.stats["reclaimed"], b._unlink, threading.Event()

    def lagging_unlink(path):  # b's reclaim lags once the copy is deleted (a loaded host), until it is counted
        unlink(path)
        counted.wait(60)

    monkeypatch.setattr(b, "_unlink", lagging_unlink)
    try:
        release_replication_hints(NAME, node=c["a"].location, job=JOB, token=TOKEN)
        wait_for(lambda: not os.path.exists(c["copy"]), timeout=60, what="the corrupt copy reclaimed")
        now = b.stats["reclaimed"]
    finally:
        counted.set()
    assert now == reclaimed + 1  # counted by the time the copy is gone


def test_the_planning_node_wakes_the_target_instead_of_waiting_for_its_poll(cluster, tmp_path):
    # c: a target that would look for tasks only once an hour; the hint reaches it through replicas.wake
    (tmp_path / "c").mkdir()
    c = _Node(str(tmp_path / "c"), cluster["etcd"], "c", ServiceLimit(), poll_s=3600, lease_ttl=600)
    put, counted = c.manager._put, threading.Event()

    def lagging_put(key, value, lease=None):  # c's copy thread lags once its task reads done (a loaded host)
        put(key, value, lease=lease)
        if value.get("state") == "done":
            counted.wait(60)  # ... until the test has read its count

    c.manager._put = lagging_put
    try:
        wait_for(lambda: "c" in cluster["a"].cluster.nodes(), timeout=30, what="c registered")
        set_replication_hints(NAME, node=cluster["a"].location, job=JOB, token=TOKEN, ttl_s=600,
                              hints=[FileHint(FILE, len(cluster["data"]), 1024, len(cluster["data"]))])
        done = wait_for_replicas(NAME, node=cluster["a"].location, job=JOB, token=TOKEN, timeout=120)
        made = c.manager.stats["copies_made"]
        counted.set()
        assert set(done["files"][FILE]["copies"]) == {"a", "b", "c"} and made == 1
        assert cluster["a"].manager.stats["wake_failures"] == 0
        steps = done["steps_s"]  # where placement's time went, per step
        assert set(steps) == {"pickup", "pull", "register"} and all(v >= 0 for v in steps.values())
    finally:
        counted.set()
        release_replication_hints(NAME, node=cluster["a"].location, job=JOB, token=TOKEN)
        c.close()
    wait_for(lambda: cluster["b"].manager.describe()["hinted_copies"] == 0, timeout=60, what="b's copy reclaimed")


def test_a_hinted_copy_costs_its_planner_and_its_target_a_few_etcd_round_trips(cluster, tmp_path):
    # placement is on the restart's clock and every etcd write is a sync: the planner reads once and writes the hint
    # with its tasks once; a target reads its tasks, pulls from the holders the task names and registers the copy
    # with one write (earlier: a read per file, a write per task, and six calls per copy on the target)
    nodes = {}
    for name in ("p", "t"):  # poll once an hour: only the hint's wake makes them look for tasks
        (tmp_path / name).mkdir()
        nodes[name] = _Node(str(tmp_path / name), cluster["etcd"], name, ServiceLimit(), poll_s=3600, lease_ttl=600)
    p, t = nodes["p"], nodes["t"]
    try:
        wait_for(lambda: {"p", "t"} <= set(cluster["a"].cluster.nodes()), timeout=30, what="p and t registered")
        replication_progress(NAME, node=p.location, job=JOB, token=TOKEN)  # binds the job's token at p first
        before = {n: x.etcd.calls for n, x in nodes.items()}
        plan = set_replication_hints(NAME, node=p.location, job=JOB, token=TOKEN, ttl_s=600,
                                     hints=[FileHint(FILE, len(cluster["data"]), 1024, len(cluster["data"]))])
        planned = p.etcd.calls - before["p"]
        # the plan's reads, the lease, the hint with its tasks (and p's read of its own tasks, if its wake came first)
        assert planned <= 4, planned
        wait_for(lambda: t.manager.stats["copies_made"] == 1 and p.manager.stats["copies_made"] == 1, timeout=120,
                 what="p's and t's copies")
        made = {n: x.etcd.calls - before[n] for n, x in nodes.items()}
        # t: its tasks, its load record (its first round in an hour), a look for expired copies once its copy is
        # registered, the copy and its task in one write; p: the same after its plan
        assert made["t"] <= 4 and made["p"] <= 7, made
        assert set(plan["files"][0]["new_nodes"]) >= {"p", "t"}
    finally:
        release_replication_hints(NAME, node=cluster["a"].location, job=JOB, token=TOKEN)
        for x in nodes.values():
            x.close()
    wait_for(lambda: cluster["b"].manager.describe()["hinted_copies"] == 0, timeout=60, what="b's copy reclaimed")


def test_a_target_whose_named_holders_do_not_serve_looks_the_holders_up(cluster, tmp_path):
    # the task's holders are the planner's view; one gone since (here: nothing listens there) costs a retry, then
    # the target asks etcd for the live copies and pulls from one of them
    (tmp_path / "t").mkdir()
    t = _Node(str(tmp_path / "t"), cluster["etcd"], "t2", ServiceLimit(), poll_s=3600, lease_ttl=600)
    etcd = Cluster(cluster["etcd"], prefix=PREFIX)
    lease = etcd._call(lambda c: c.lease(ttl=60))
    try:
        key = etcd.key("replicas", ".tasks", "t2", ckpt_key(NAME), FILE)
        with ReplicaReader(cluster["etcd"], job=JOB, token=TOKEN, prefix=PREFIX) as r:
            xxh3 = r.copies(NAME)[FILE]["a"]["xxh3"]
        task = {"job": JOB, "checkpoint": NAME, "file": FILE, "size": len(cluster["data"]), "xxh3": xxh3,
                "grant": "g" * 32, "lease": lease.id, "state": "pending", "created": 0.0, "node": "t2",
                "sources": [{"node": "gone", "location": "grpc://127.0.0.1:9"}]}
        etcd._call(lambda c: c.put(key, json.dumps(task), lease=lease))
        t.manager._copy(key, task)
        done = json.loads(etcd._call(lambda c: c.get(key))[0])
        assert done["state"] == "done" and done["source"] == "a" and t.manager.stats["copies_made"] == 1
        with open(os.path.join(t.root, ".replicas", JOB, "step-1", FILE), "rb") as f:
            assert f.read() == cluster["data"]
    finally:
        lease.revoke()
        t.close()


def test_service_limit_syntax_and_token_bucket_arithmetic():
    assert parse_amounts("64M:500") == (64 << 20, 500)
    assert parse_amounts("1GiB") == (1 << 30, 0) and parse_amounts(":20") == (0, 20) and parse_amounts(None) == (0, 0)
    with pytest.raises(ProtocolError, match="must look like"):
        parse_amounts("fast")
    with pytest.raises(ProtocolError, match="negative"):
        parse_amounts("-1M")
    assert not ServiceLimit.parse("0").limited and ServiceLimit.parse("8M:100").limited
    now = [1000.0]  # the buckets' clock, moved by hand: the arithmetic is checked, not this machine's timing
    bucket = TokenBucket(100.0, burst_s=0.0, clock=lambda: now[0])
    assert [bucket.reserve(100), bucket.reserve(100)] == [1.0, 2.0]  # one second of tokens each, in arrival order
    assert bucket.waited_s == 3.0
    now[0] += 1.5  # the first reservation is used, the second is due in 0.5 s: a newcomer queues behind it
    assert bucket.reserve(50) == 1.0 and bucket.waited_s == 4.0
    now[0] += 60.0  # idle: no debt carried, and no credit beyond the burst (none here)
    assert [bucket.reserve(100), bucket.reserve(100)] == [1.0, 2.0]
    burst = TokenBucket(100.0, burst_s=0.5, clock=lambda: now[0])
    assert [burst.reserve(50), burst.reserve(50), burst.reserve(100)] == [0.0, 0.5, 1.5]  # 0.5 s of tokens at once


def test_a_copy_pull_goes_ahead_of_the_readers_queue_and_pushes_it_back():
    now = [1000.0]
    bucket = TokenBucket(100.0, burst_s=0.0, clock=lambda: now[0])
    assert [bucket.reserve(100) for _ in range(3)] == [1.0, 2.0, 3.0]  # a storm's readers queue for 3 s
    assert bucket.reserve(50, priority=True) == 0.5  # the copy's source read waits for its own tokens only
    assert bucket.reserve(100) == 4.5  # the next reader pays for them: the rate holds over the queue
    assert bucket.waited_s == 1.0 + 2.0 + 3.0 + 0.5 + 4.5


def test_a_restarted_node_deletes_copies_no_hint_holds(cluster, tmp_path):
    stale = tmp_path / ".replicas" / JOB / "step-9"
    stale.mkdir(parents=True)
    (stale / "old.bin").write_bytes(b"x" * 4096)  # left by a crash: its hint's key is gone from etcd
    (stale / ".tmp-half.bin-1234").write_bytes(b"y")  # a copy cut short
    node = _Node(str(tmp_path), cluster["etcd"], "c", ServiceLimit())
    try:
        assert not (stale / "old.bin").exists() and not list(stale.iterdir())
        assert node.manager.describe()["hinted_copies"] == 0
    finally:
        node.close()
