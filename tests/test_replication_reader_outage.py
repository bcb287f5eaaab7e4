"""ReplicaReader through an etcd outage (issue 20, item 7): a reader holding a copy list keeps reading from live nodes
while etcd is away (bounded staleness), and refreshes are single-flight across threads. Real etcd and a real storage
node on loopback; the outage is etcd stopped (SIGSTOP: calls hang until their timeout) or killed."""
from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foresight.checkpoint.dcp import ForesightStorageWriter
from foresight.replication.hint_client import ReplicaReader, publish_checkpoint
from foresight.errors import NodeError
from foresight.testing.etcd import EtcdProcess
from node_helpers import NodeProc

TOKEN = "outage-token"
NAME, JOB = "jobO/step-1", "jobO"


@pytest.fixture()
def bed(tmp_path):
    etcd = EtcdProcess(str(tmp_path / "etcd"))
    root = str(tmp_path / "root")
    os.makedirs(root)
    node = None
    try:
        node = NodeProc(root, str(tmp_path / "work"), "--etcd", etcd.endpoint, "--ttl", "30", "--cpu-threshold",
                        "101", "--node-id", "o0", name="o0")
        ckpt = str(tmp_path / "ckpt")
        dcp.save({"w": torch.randn(64, 64)}, storage_writer=ForesightStorageWriter(ckpt))
        shutil.copytree(ckpt, os.path.join(root, *NAME.split("/")))
        publish_checkpoint(node.location, NAME, job=JOB, token=TOKEN)
        yield {"etcd": etcd, "node": node, "ckpt": ckpt}
    finally:
        if node is not None:
            node.terminate()
        if etcd.proc.poll() is None:
            etcd.proc.send_signal(signal.SIGCONT)  # a test stopped it
        etcd.close()


def test_a_cached_copy_list_serves_reads_while_etcd_is_down(bed):
    want = open(os.path.join(bed["ckpt"], ".metadata"), "rb").read()
    with ReplicaReader(bed["etcd"].endpoint, job=JOB, token=TOKEN, refresh_s=0.0, max_stale_s=600) as r:
        assert r.read(NAME, ".metadata") == want
        bed["etcd"].proc.kill()  # etcd is gone; the node is alive
        bed["etcd"].proc.wait(10)
        for _ in range(3):
            assert r.read(NAME, ".metadata") == want
        assert r.stats["stale_lists"] >= 1 and r.stats["reads"] == 4
    # without a cached list there is nothing to fall back on: the etcd error, not a hang
    with ReplicaReader(bed["etcd"].endpoint, job=JOB, token=TOKEN) as fresh:
        with pytest.raises(NodeError, match="etcd unreachable"):
            fresh.read(NAME, ".metadata")
    # past the staleness bound the cached list is no longer trusted
    with ReplicaReader(bed["etcd"].endpoint, job=JOB, token=TOKEN, refresh_s=0.0, max_stale_s=0.0) as r:
        r._copies[NAME] = (0.0, {".metadata": {}})
        with pytest.raises(NodeError, match="etcd unreachable"):
            r.read(NAME, ".metadata")


def test_refreshes_are_single_flight_across_threads(bed):
    want = open(os.path.join(bed["ckpt"], ".metadata"), "rb").read()
    with ReplicaReader(bed["etcd"].endpoint, job=JOB, token=TOKEN, refresh_s=0.0, max_stale_s=600) as r:
        assert r.read(NAME, ".metadata") == want
        assert r.stats["copy_refreshes"] == 1
        bed["etcd"].proc.send_signal(signal.SIGSTOP)  # etcd hangs: the one refresh blocks until its timeout
        try:
            with cf.ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda _: r.read(NAME, ".metadata"), range(8)))
        finally:
            bed["etcd"].proc.send_signal(signal.SIGCONT)
        assert got == [want] * 8
        assert r.stats["copy_refreshes"] == 2  # one ask for eight readers; the others read the list they had


def test_a_copy_list_refresh_is_one_etcd_round_trip(bed):
    # a hinted restore re-reads its hot files' copies every 50 ms while they are placed: the live nodes and every
    # file's range come back in one request, not one each
    files = sorted(os.listdir(bed["ckpt"]))
    with ReplicaReader(bed["etcd"].endpoint, job=JOB, token=TOKEN) as r:
        calls = r.cluster.calls
        whole = r.copies(NAME)
        assert r.cluster.calls - calls == 1 and sorted(whole) == files
        calls = r.cluster.calls
        some = r.refresh_files(NAME, files[:2])
        assert r.cluster.calls - calls == 1
        assert {f: some[f] for f in files[:2]} == {f: whole[f] for f in files[:2]}
        assert set(some[files[0]]) == {"o0"} and r.stats["file_refreshes"] == 1


def test_the_node_logs_an_etcd_outage_once_not_every_round(bed):
    """The replica manager's round (every 0.25 s) logged a warning each time it failed: four lines a second for
    as long as etcd was away. Now one line when it starts failing, one when it works again; the count is kept."""
    from node_helpers import flight_action
    from replication_helpers import wait_until

    import pyarrow.flight as flight

    client = flight.connect(bed["node"].location)
    bed["etcd"].proc.kill()
    bed["etcd"].proc.wait(10)
    wait_until(lambda: flight_action(client, "replicas.stats", {})["round_failures"] >= 8, "rounds to fail")
    assert bed["node"].log().count("replica manager round failed") == 1
    port = int(bed["etcd"].endpoint.rsplit(":", 1)[1])
    bed["etcd"].close()
    back = EtcdProcess(os.path.dirname(bed["etcd"].log_path), port=port)
    try:
        wait_until(lambda: "replica manager rounds work again" in bed["node"].log(), "rounds to work again")
        assert bed["node"].log().count("replica manager round failed") == 1
    finally:
        client.close()
        back.close()
