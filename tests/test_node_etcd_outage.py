"""etcd going away mid-epoch, for longer than the node's lease, then coming back on the same endpoint with its data
or with none: the node and the job re-register (new lease, entries re-written), the client re-resolves, and the
epoch ends with the batches of a host decode."""
from __future__ import annotations

import os
import time

import pytest

from foresight.loader import MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.cluster.membership import Cluster
from foresight.testing.etcd import EtcdProcess
from node_helpers import SPECS, TOKEN, NodeProc, host_reference, make_root, run_source, wait_for

TTL = 2


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("outageroot")), samples=12, steps=8)
    r["reference"] = host_reference(r["dataset"], r["plan"])
    return r


@pytest.mark.parametrize("data", ["same-data-dir", "fresh-data-dir"])
def test_etcd_restart_mid_epoch_node_and_job_come_back(root, tmp_path, data):
    etcds = [EtcdProcess(str(tmp_path / "etcd0"))]
    port = int(etcds[0].endpoint.rsplit(":", 1)[1])
    node = NodeProc(root["root"], str(tmp_path), "--etcd", etcds[0].endpoint, "--node-id", "out", "--ttl", str(TTL),
                    "--cpu-threshold", "101", name="out")
    cluster = Cluster(etcds[0].endpoint)
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    source = NodeSource(stage, root["plan"], etcd=etcds[0].endpoint, token=TOKEN, job="outage", timeout=60,
                        retry_s=0.5, refresh_s=0.5)
    back = {}

    def before_decode(step):
        if step == 3:
            etcds[0].proc.kill()  # SIGKILL: no goodbye
            etcds[0].close()
            # the node notices (its refresh fails) before etcd comes back
            wait_for(lambda: _failed_refreshes(node) >= 1, timeout=60, what="the node to notice etcd is gone")
            restarted_at = time.time()
            data_dir = str(tmp_path / ("etcd0" if data == "same-data-dir" else "etcd1"))
            etcds.append(EtcdProcess(data_dir, port=port))
            # back within a bounded wait, written after the restart (not a stale key from before it)
            back["node"] = wait_for(lambda: _updated_after(cluster.nodes().get("out"), restarted_at), timeout=60,
                                    what="the node back in etcd")
            back["job"] = wait_for(lambda: _updated_after(cluster.jobs().get("outage/000000"), restarted_at),
                                   timeout=60, what="the job back in etcd")
            back["remote"] = source.stats["samples_remote"]

    try:
        got = run_source(root["dataset"], root["plan"], source, before_decode=before_decode)
        remote_after = source.stats["samples_remote"]
    finally:
        source.close()
        stage.close()
        node.terminate()
        for e in etcds:
            e.close()
    assert got == root["reference"]  # nothing lost, repeated or reordered
    assert back["node"]["location"] == node.location and back["job"]["plan_digest"] == root["plan"].digest
    assert remote_after > back["remote"]  # the client found the node again and took parts from it
    assert "etcd back; lease granted again" in node.log()


def _failed_refreshes(node) -> int:
    return node.log().count("etcd refresh failed")


def _updated_after(record, t):
    return record if record is not None and record.get("updated", 0) > t else None
