"""A cluster on loopback: etcd and two storage nodes as real processes. Shards placed on different nodes, a step
assembled from both in plan order; a node killed mid-epoch (the client finishes identically and the node drops
out of etcd within its lease); a node restarted under the same id rejoins and serves again."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from foresight.loader import MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.cluster.membership import Cluster
from foresight.testing.etcd import EtcdProcess
from node_helpers import SPECS, TOKEN, NodeProc, host_reference, make_root, run_source, wait_for

TTL = "3"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdProcess(str(tmp_path_factory.mktemp("etcd"))) as e:
        yield e


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("clusterroot")), samples=16, steps=12)
    assert len(r["dataset"].shard_paths) >= 3
    r["reference"] = host_reference(r["dataset"], r["plan"])
    return r


def _node(root, etcd, workdir, name):
    return NodeProc(root["root"], str(workdir), "--etcd", etcd.endpoint, "--node-id", name, "--ttl", TTL,
                    "--cpu-threshold", "101", name=name)


def _source(root, etcd, job):
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    return stage, NodeSource(stage, root["plan"], etcd=etcd.endpoint, token=TOKEN, job=job, timeout=60,
                             retry_s=0.5, refresh_s=0.5)


def _place(root, etcd, nodes):
    out = subprocess.run([sys.executable, "-m", "foresight", "node", "place", "--etcd", etcd.endpoint,
                          root["dataset"].path, "--nodes", ",".join(nodes)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["placement"]


def _served(node_status):
    return node_status["served"].get("samples_decoded", 0)  # all jobs, those gone included


def test_steps_split_over_two_nodes_come_back_in_plan_order(root, etcd, tmp_path):
    a, b = _node(root, etcd, tmp_path, "na"), _node(root, etcd, tmp_path, "nb")
    try:
        cluster = Cluster(etcd.endpoint)
        wait_for(lambda: {"na", "nb"} <= set(cluster.nodes()), timeout=60, what="both nodes in etcd")
        placement = _place(root, etcd, ["na", "nb"])
        assert set(placement.values()) == {"na", "nb"}
        stage, source = _source(root, etcd, "split")
        try:
            got = run_source(root["dataset"], root["plan"], source)
            assert set(cluster.jobs()) == {"split/000000"}  # the job is registered in etcd while it runs
        finally:
            source.close()
            stage.close()
        assert got == root["reference"]
        assert source.stats["samples_local"] == 0
        statuses = json.loads(subprocess.run(
            [sys.executable, "-m", "foresight", "node", "status", "--etcd", etcd.endpoint, "--json"],
            capture_output=True, text=True, timeout=120, check=True).stdout)
        assert len(statuses) == 2 and all(_served(s) > 0 for s in statuses)  # both nodes served part of it
    finally:
        a.terminate()
        b.terminate()
        Cluster(etcd.endpoint)._call(lambda c: c.delete_prefix("/foresight/v1/placement/"))


@pytest.mark.slow
def test_node_killed_mid_epoch_then_restarted_client_finishes_identically(root, etcd, tmp_path):
    a, b = _node(root, etcd, tmp_path, "ka"), _node(root, etcd, tmp_path, "kb")
    cluster = Cluster(etcd.endpoint)
    restarted = []
    try:
        wait_for(lambda: {"ka", "kb"} <= set(cluster.nodes()), timeout=60, what="both nodes in etcd")
        _place(root, etcd, ["ka", "kb"])
        stage, source = _source(root, etcd, "kill")

        def before_decode(step):
            if step == 2:
                b.proc.kill()  # SIGKILL: no goodbye, its lease must expire
                b.proc.wait()
                wait_for(lambda: "kb" not in cluster.nodes(), timeout=60, what="the dead node to leave etcd")
            if step == 5:
                restarted.append(_node(root, etcd, tmp_path, "kb"))
                wait_for(lambda: "kb" in cluster.nodes(), timeout=60, what="the restarted node in etcd")

        try:
            got = run_source(root["dataset"], root["plan"], source, before_decode=before_decode)
        finally:
            source.close()
            stage.close()
        assert got == root["reference"]  # nothing lost, repeated or reordered
        assert source.stats["samples_local"] > 0  # kb's part of the steps it was away was decoded here
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "foresight", "node", "status", "--node", restarted[0].location, "--json"],
            capture_output=True, text=True, timeout=120, check=True).stdout)[0]
        assert _served(status) > 0  # the restarted node served the steps after it rejoined
    finally:
        a.terminate()
        b._log.close() if not b._log.closed else None
        for n in restarted:
            n.terminate()
        cluster._call(lambda c: c.delete_prefix("/foresight/v1/placement/"))


def test_sigterm_leaves_the_cluster_at_once(root, etcd, tmp_path):
    n = _node(root, etcd, tmp_path, "bye")
    cluster = Cluster(etcd.endpoint)
    wait_for(lambda: "bye" in cluster.nodes(), timeout=60, what="node in etcd")
    assert n.terminate() == 0
    assert "bye" not in cluster.nodes()  # lease revoked on shutdown, not left to expire
