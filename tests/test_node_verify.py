"""A node checks its own copy of every sample against the shard map's xxh3 before decoding or sending it: a damaged
copy (a flipped byte, manifest kept) is never served; the client decodes those samples itself, so the batches are
the host's, bit for bit, and the node's metric, log and ``foresight node status`` name what failed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from foresight.loader import MediaDecodeStage
from foresight.node.client import NodeSource
from node_helpers import SPECS, TOKEN, NodeProc, host_reference, make_root, run_source

DAMAGED = (1, 4, 7)  # an image, a video, an image


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("verify-host")))
    r["reference"] = host_reference(r["dataset"], r["plan"])
    node_root = str(tmp_path_factory.mktemp("verify-node"))
    shutil.copytree(r["root"], node_root, dirs_exist_ok=True)
    ext = r["dataset"].lookup(np.asarray(DAMAGED))
    for shard, offset, length in zip(ext.shard, ext.offset, ext.length):  # one byte inside each sample
        path = os.path.join(node_root, "media", os.path.basename(r["dataset"].shard_paths[int(shard)]))
        with open(path, "r+b") as f:
            f.seek(int(offset) + int(length) // 2)
            b = f.read(1)
            f.seek(int(offset) + int(length) // 2)
            f.write(bytes([b[0] ^ 0x5A]))
    r["node_root"] = node_root
    r["damaged_uses"] = sum(s["sample_ids"].count(i) for s in r["reference"] for i in DAMAGED)
    assert r["damaged_uses"] > 0
    return r


@pytest.mark.parametrize("threshold,served_as", [(101, "samples_remote"), (0, "samples_raw")])
def test_damaged_samples_on_a_node_are_decoded_by_the_client(root, tmp_path, threshold, served_as):
    node = NodeProc(root["node_root"], str(tmp_path), "--cpu-threshold", str(threshold), "--metrics-port", "0",
                    name=f"verify-{threshold}")
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    source = NodeSource(stage, root["plan"], nodes=[node.location], token=TOKEN, job=f"verify-{threshold}")
    try:
        got = run_source(root["dataset"], root["plan"], source)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=10).read()
        status = subprocess.run([sys.executable, "-m", "foresight", "node", "status", "--node", node.location],
                                capture_output=True, text=True, timeout=120)
        status_json = subprocess.run([sys.executable, "-m", "foresight", "node", "status", "--node", node.location,
                                      "--json"], capture_output=True, text=True, timeout=120)
    finally:
        source.close()
        stage.close()
        node.terminate()
    assert got == root["reference"]
    uses = root["damaged_uses"]
    wanted = sum(len(r[n][0]) for r in got for n in SPECS if n in r)
    assert source.stats["samples_corrupt"] == uses and source.stats["samples_local"] == uses
    assert source.stats[served_as] == wanted - uses
    assert source.stats["parts_failed"] > 0
    assert f'foresight_node_corrupt_samples_total{{dataset="media"}} {float(uses)}' in metrics.decode()
    assert status.returncode == 0, status.stderr
    assert f"samples failing their checksum here: {uses} (media {uses})" in status.stdout
    assert json.loads(status_json.stdout)[0]["corrupt_samples"] == {"media": uses}
    logged = [json.loads(line) for line in node.log().splitlines() if "fail their checksum" in line]
    assert {s for rec in logged for s in rec["samples"]} == set(DAMAGED)
    assert all(rec["dataset"] == "media" and rec["node"] == node.node_id for rec in logged)


class _OffByOne:
    """A node decode stage whose pixels differ from the host's (as a node with other decode libraries could):
    the bytes verify, the tensors do not match."""

    def __init__(self, stage) -> None:
        self.stage = stage

    def __call__(self, fields, **kw):
        out = self.stage(fields, **kw)
        for name in SPECS:
            if name in out:
                out[name] = [t + 1 for t in out[name]] if isinstance(out[name], list) else out[name] + 1
        return out

    def close(self) -> None:
        self.stage.close()


@pytest.mark.parametrize("every", [1, 3])
def test_spot_check_compares_node_tensors_with_a_host_decode(root, tmp_path, every):
    node = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", name=f"spot-{every}")
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    source = NodeSource(stage, root["plan"], nodes=[node.location], token=TOKEN, job=f"spot-{every}",
                        spot_check=every)
    try:
        got = run_source(root["dataset"], root["plan"], source)
    finally:
        source.close()
        stage.close()
        node.terminate()
    wanted = sum(len(r[n][0]) for r in got for n in SPECS if n in r)
    assert got == root["reference"]
    assert source.stats["samples_remote"] == wanted and source.stats["samples_local"] == 0
    assert source.stats["spot_checked"] == -(-wanted // every) and source.stats["spot_mismatches"] == 0


def test_spot_check_counts_a_node_whose_tensors_differ(root, monkeypatch, caplog):
    from foresight.node.jobs import NodeJob
    from foresight.node.server import NodeServer

    opened = NodeJob.open.__func__

    def open_off_by_one(cls, *args, **kw):
        job = opened(cls, *args, **kw)
        job.stage = _OffByOne(job.stage)
        return job

    monkeypatch.setattr(NodeJob, "open", classmethod(open_off_by_one))
    server = NodeServer(root["root"], cpu_threshold=101, decode_threads=2)
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    source = NodeSource(stage, root["plan"], nodes=[server.location], token=TOKEN, job="spot-differ", spot_check=1)
    try:
        with caplog.at_level("WARNING", logger="foresight.node.client"):
            got = run_source(root["dataset"], root["plan"], source)
    finally:
        source.close()
        stage.close()
        server.stop()
    wanted = sum(len(r[n][0]) for r in got for n in SPECS if n in r)
    assert got == root["reference"]  # the host's decode went into every batch
    assert source.stats["spot_checked"] == wanted and source.stats["spot_mismatches"] == wanted
    lines = [r for r in caplog.records if "differs from the host" in r.getMessage()]
    assert len(lines) == wanted and {r.node for r in lines} == {server.node_id}


def test_spot_check_must_be_a_count():
    with pytest.raises(ValueError, match="spot_check"):
        NodeSource(None, None, nodes=["grpc://127.0.0.1:1"], token=TOKEN, spot_check=-1)
