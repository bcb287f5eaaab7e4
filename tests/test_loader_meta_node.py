"""meta_fields through a storage node: a NodeSource decodes the step remotely, and the loader's meta values line
up with the tensors the node sent back (the loader adds them after any decode callable, from its own read)."""
from __future__ import annotations

import pytest

from foresight.loader import Loader, MediaDecodeStage
from foresight.node.client import NodeSource
from node_helpers import SPECS, TOKEN, make_root


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_root(str(tmp_path_factory.mktemp("metanode")))


def test_meta_fields_align_with_tensors_a_node_decoded(root):
    from foresight.node.server import NodeServer

    ds, plan = root["dataset"], root["plan"]
    server = NodeServer(root["root"], cpu_threshold=101, decode_threads=2)
    stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
    source = NodeSource(stage, plan, nodes=[server.location], token=TOKEN, job="meta")
    try:
        with Loader(ds, plan, decode=stage, source=source, meta_fields=("modality", "num_frames")) as loader:
            mixed = 0
            for batch in loader:
                ids = batch["sample_ids"].tolist()
                assert batch["modality"] == [ds.meta(s)["modality"] for s in ids]
                mixed += set(batch["modality"]) == {"image", "video"}  # where alignment matters most
                for name in set(batch["modality"]):
                    rows = batch[f"{name}_index"].tolist()
                    assert len(batch[f"{name}_modality"]) == len(batch[name]) == len(rows) > 0
                    assert batch[f"{name}_modality"] == [name] * len(rows)
                    assert batch[f"{name}_num_frames"] == [ds.meta(ids[p]).get("num_frames") for p in rows]
        assert mixed >= 2
        assert source.stats["samples_remote"] > 0 and source.stats["samples_local"] == 0
    finally:
        source.close()
        stage.close()
        server.stop()
