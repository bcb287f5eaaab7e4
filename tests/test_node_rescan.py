"""A node notices datasets added, removed or repacked under its root: a dataset copied in after the node started is
advertised (health and etcd) and served; a registration naming a dataset the node has not scanned rescans first;
a dataset repacked in place mid-job is refused for that job with a clear error, and the client decodes the rest
of the epoch itself (the batches stay the host's)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import urllib.request

import pyarrow.flight as flight
import pytest

from foresight.loader import MediaDecodeStage
from foresight.cluster.auth import call_options, connect
from foresight.node.client import NodeSource
from foresight.cluster.membership import Cluster
from foresight.testing.etcd import EtcdProcess
from node_helpers import SPECS, TOKEN, NodeProc, host_reference, make_root, run_source, wait_for


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("rescan-host")))
    r["reference"] = host_reference(r["dataset"], r["plan"])
    return r


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdProcess(str(tmp_path_factory.mktemp("rescan-etcd"))) as e:
        yield e


def _health(location: str) -> dict:
    client = connect(location)
    try:
        out = list(client.do_action(flight.Action("health", b"{}"), call_options(None, None, timeout=30)))
        return json.loads(out[0].body.to_pybytes())
    finally:
        client.close()


def _copy_in(root, node_root: str) -> None:
    """Copy the dataset in as a pack would leave it: shards and maps first, the manifest last."""
    src, dst = os.path.join(root["root"], "media"), os.path.join(node_root, "media")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("manifest.json"))
    shutil.copy2(os.path.join(src, "manifest.json"), os.path.join(dst, "manifest.json"))


def _repack_in_place(path: str) -> None:
    """The same samples packed again with another shard size (another manifest and fingerprint), moved over the
    old files of ``path`` shards first and manifest last, as a repack in place would leave them."""
    from test_loader_media import _clip, _jpeg

    from foresight.format import DatasetWriter
    from foresight.media import probe_media

    fresh = path + ".repack"
    with DatasetWriter(fresh, shard_bytes=60000) as w:
        for i in range(12):
            data, kind = (_jpeg(i), "image") if i % 2 else (_clip(i), "video")
            w.add(data, modality=kind, meta=probe_media(data, kind))
    names = sorted(os.listdir(fresh), key=lambda n: n == "manifest.json")
    for name in names:
        os.replace(os.path.join(fresh, name), os.path.join(path, name))
    for name in set(os.listdir(path)) - set(names):  # shards of the old packing that the new one has not
        os.unlink(os.path.join(path, name))
    os.rmdir(fresh)


def test_a_dataset_added_after_the_node_started_is_advertised_and_served(root, etcd, tmp_path):
    node_root = str(tmp_path / "node-root")
    os.makedirs(node_root)
    node = NodeProc(node_root, str(tmp_path), "--cpu-threshold", "101", "--rescan-s", "0.5", "--etcd",
                    etcd.endpoint, "--ttl", "3", "--node-id", "late", name="late")
    fingerprint = str(root["dataset"].fingerprint)
    try:
        assert _health(node.location)["datasets"] == {}
        _copy_in(root, node_root)
        wait_for(lambda: _health(node.location)["datasets"].get("media", {}).get("fingerprint") == fingerprint,
                 what="the node to list the dataset copied in")
        cluster = Cluster(etcd.endpoint)
        wait_for(lambda: cluster.nodes().get("late", {}).get("datasets", {}).get("media", {}).get("fingerprint")
                 == fingerprint, what="etcd to advertise the dataset")
        stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
        source = NodeSource(stage, root["plan"], etcd=etcd.endpoint, token=TOKEN, job="late-dataset")
        try:
            got = run_source(root["dataset"], root["plan"], source)
        finally:
            source.close()
            stage.close()
        assert got == root["reference"]
        wanted = sum(len(r[n][0]) for r in got for n in SPECS if n in r)
        assert source.stats["samples_remote"] == wanted and source.stats["samples_local"] == 0
        shutil.rmtree(os.path.join(node_root, "media"))  # removed: no longer advertised
        wait_for(lambda: "media" not in cluster.nodes().get("late", {}).get("datasets", {"media": 1}),
                 what="etcd to drop the removed dataset")
    finally:
        node.terminate()
    assert '"dataset added under the root"' in node.log() or "dataset added under the root" in node.log()


def test_a_registration_naming_an_unscanned_dataset_rescans_first(root, tmp_path):
    node_root = str(tmp_path / "node-root")
    os.makedirs(node_root)
    node = NodeProc(node_root, str(tmp_path), "--cpu-threshold", "101", "--rescan-s", "0", name="on-demand")
    try:
        _copy_in(root, node_root)
        shutil.copytree(os.path.join(root["root"], "plans"), os.path.join(node_root, "plans"))
        assert _health(node.location)["datasets"] == {}  # no periodic scan
        req = {"job": "on-demand", "datasets": ["media"], "plan": "plans/p1", "plan_digest": root["plan"].digest,
               "rank": 0, "world_size": 1, "specs": {k: v.to_dict() for k, v in SPECS.items()}, "seed": 9}
        client = connect(node.location)
        try:
            list(client.do_action(flight.Action("register_job", json.dumps(req).encode()),
                                  call_options("on-demand", TOKEN, timeout=60)))
        finally:
            client.close()
        health = _health(node.location)
        assert health["datasets"]["media"]["fingerprint"] == str(root["dataset"].fingerprint)
        assert health["plans"][root["plan"].digest] == "plans/p1"
    finally:
        node.terminate()


def test_a_dataset_repacked_in_place_mid_job_is_refused_and_decoded_here(root, tmp_path, caplog):
    node_root = str(tmp_path / "node-root")
    shutil.copytree(root["root"], node_root)
    node = NodeProc(node_root, str(tmp_path), "--cpu-threshold", "101", "--rescan-s", "0.5", "--metrics-port", "0",
                    name="repack")
    fingerprint = str(root["dataset"].fingerprint)
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    source = NodeSource(stage, root["plan"], nodes=[node.location], token=TOKEN, job="repacked", retry_s=0.2)

    def repack_before(step: int) -> None:
        if step == 2:
            _repack_in_place(os.path.join(node_root, "media"))
            wait_for(lambda: _health(node.location)["datasets"].get("media", {}).get("fingerprint")
                     not in (None, fingerprint), what="the node to see the repacked dataset")
            wait_for(lambda: "job refused: its dataset changed" in node.log(), what="the node to refuse the job")

    try:
        with caplog.at_level(logging.WARNING, logger="foresight.node.client"):
            got = run_source(root["dataset"], root["plan"], source, before_decode=repack_before)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=10).read()
    finally:
        source.close()
        stage.close()
        node.terminate()
    assert got == root["reference"]  # never the repacked bytes through the old maps
    later = sum(len(r[n][0]) for r in got[2:] for n in SPECS if n in r)
    assert source.stats["samples_local"] == later and source.stats["parts_failed"] > 0
    assert source.stats["samples_remote"] == sum(len(r[n][0]) for r in got[:2] for n in SPECS if n in r)
    refusals = [r for r in caplog.records if "repacked on this node" in str(getattr(r, "error", ""))]
    assert refusals, [getattr(r, "error", None) for r in caplog.records]
    assert "'media' was repacked on this node while job 'repacked.0' used it" in refusals[0].error
    text = metrics.decode()
    assert 'foresight_node_dataset_changes_total{change="changed"} 1.0' in text
    assert 'foresight_node_refusals_total{reason="dataset_changed"} 1.0' in text
