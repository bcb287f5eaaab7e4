"""``Loader(ds, plan, decode=stage, source=NodeSource(...))``: the loader does not read the samples the nodes decode,
and the batches are the host-side decode's, bit for bit, whether the node decodes, defers under its CPU guard,
sends raw bytes, or is gone."""
from __future__ import annotations

import numpy as np
import pytest

from foresight.errors import ProtocolError
from foresight.loader import Loader, MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.node.protocol import decode_action
from node_helpers import SPECS, TOKEN, host_reference, make_root, summary


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("loadersource")))
    r["reference"] = host_reference(r["dataset"], r["plan"])
    return r


def _run(root, source, **kw) -> tuple[list[dict], dict]:
    with Loader(root["dataset"], root["plan"], decode=source.stage, source=source, **kw) as loader:
        got = [summary(b) for b in loader]
        return got, loader.stats.as_dict()


def _with_node(root, *, cpu_threshold: float, guard_reply: str = "raw", job: str):
    from foresight.node.server import NodeServer

    server = NodeServer(root["root"], cpu_threshold=cpu_threshold, decode_threads=2)
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    source = NodeSource(stage, root["plan"], nodes=[server.location], token=TOKEN, job=job, guard_reply=guard_reply)
    return server, stage, source


@pytest.mark.parametrize("threshold,reply,served_as", [(101, "raw", "samples_remote"), (0, "raw", "samples_raw"),
                                                       (0, "defer", "samples_deferred")])
def test_loader_reads_none_of_the_nodes_samples_and_matches_host_decode(root, threshold, reply, served_as):
    server, stage, source = _with_node(root, cpu_threshold=threshold, guard_reply=reply, job=f"ls-{reply}")
    try:
        got, stats = _run(root, source)
        snapshot = server.metrics.snapshot()
    finally:
        source.close()
        stage.close()
        server.stop()
    assert got == root["reference"]
    # every sample of this dataset has a spec: the loader itself reads nothing
    assert stats["bytes_requested"] == 0 and stats["extents"] == 0
    wanted = sum(len(r[n][0]) for r in got for n in SPECS if n in r)
    assert source.stats[served_as] == wanted
    others = {"samples_remote", "samples_raw", "samples_deferred", "samples_local"} - {served_as}
    assert all(source.stats[k] == 0 for k in others), source.stats
    if reply == "defer":  # the guarded node read and shipped no sample bytes
        assert snapshot["served"].get("bytes_deferred", 0) == 0 and snapshot["served"].get("bytes_raw", 0) == 0
        assert snapshot["served"]["samples_deferred"] == wanted
        assert source.stats["bytes_received"] < 64 * 1024 * root["plan"].num_steps  # positions, not clips


def test_node_gone_the_loader_path_reads_and_decodes_here(root):
    server, stage, source = _with_node(root, cpu_threshold=101, job="ls-gone")
    server.stop()
    source.timeout = source.register_timeout = 5.0
    try:
        got, stats = _run(root, source)
    finally:
        source.close()
        stage.close()
    assert got == root["reference"]
    assert stats["bytes_requested"] == 0  # the loader still skipped them: the source read them on demand
    assert source.stats["samples_local"] == sum(len(r[n][0]) for r in got for n in SPECS if n in r)


def test_batch_marks_samples_it_did_not_read(root):
    server, stage, source = _with_node(root, cpu_threshold=101, job="ls-marks")
    try:
        with Loader(root["dataset"], root["plan"], source=source) as loader:  # decode defaults to source.stage
            batch = next(iter(loader))
            offsets, lengths = np.asarray(batch["offsets"]), np.asarray(batch["lengths"])
            assert (offsets == -1).all() and (lengths == 0).all()
            assert any(name in batch for name in SPECS)
            with_source = loader._transfer_bytes
        with Loader(root["dataset"], root["plan"], decode=stage) as plain:
            assert with_source < plain._transfer_bytes  # no arena room for bytes it never reads
    finally:
        source.close()
        stage.close()
        server.stop()


def test_source_refusals(root):
    server, stage, source = _with_node(root, cpu_threshold=101, job="ls-refuse")
    other = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=1)
    try:
        with pytest.raises(ValueError, match="same stage"):
            Loader(root["dataset"], root["plan"], decode=other, source=source)
        with pytest.raises(ValueError, match="guard_reply"):
            NodeSource(stage, root["plan"], nodes=[server.location], token=TOKEN, guard_reply="bytes-please")
    finally:
        other.close()
        source.close()
        stage.close()
        server.stop()


def test_register_refuses_an_unknown_guard_reply():
    body = (b'{"job": "j", "datasets": ["media"], "plan": "plans/p1", "plan_digest": "sha256:%s", "rank": 0, '
            b'"world_size": 1, "specs": {"image": {"modality": "image"}}, "seed": 1, "guard_reply": "%s"}')
    with pytest.raises(ProtocolError, match="guard_reply"):
        decode_action("register_job", body % (b"0" * 64, b"exec"))
    assert decode_action("register_job", body % (b"0" * 64, b"defer"))["guard_reply"] == "defer"
