"""A compact plan uploaded to a real node process travels as its plan.json alone: the node derives block_prefix.npy
from the datasets it holds, keeps the plan only if the digest matches, and its copy gives the host's steps."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.flight as flight
import pytest
from node_helpers import TOKEN, NodeProc, flight_action

from foresight.format import DatasetWriter, open_dataset
from foresight.cluster.auth import call_options, connect
from foresight.node.plans import UPLOAD_DIR, upload_plan
from foresight.plan import ArraySource, build_plan, load_plan


def _token_dataset(path: str, lengths: np.ndarray, seed: int):
    rng = np.random.default_rng(seed)
    with DatasetWriter(path, token_dtype="uint16") as w:
        w.add_many(rng.integers(0, 60000, int(lengths.sum()), dtype=np.uint16), lengths, modality="tokens")
    return open_dataset(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("compact-node")
    root, host = str(base / "root"), str(base / "host")
    rng = np.random.default_rng(3)
    a = _token_dataset(os.path.join(root, "a"), rng.integers(1, 60, 30_000), 1)
    b = _token_dataset(os.path.join(root, "b"), rng.integers(1, 30, 8_000), 2)
    node = NodeProc(root, str(base / "node"))
    yield {"root": root, "host": host, "a": a, "b": b, "node": node}
    node.terminate()


def _plan_dir(setup, name: str, sources, **kw) -> tuple[str, object]:
    plan = build_plan(sources, seed=7, global_batch_size=8, seq_len=64, num_steps=400, compact=True,
                      block_size=1, **kw)  # one document per block: a block_prefix far larger than plan.json
    out = os.path.join(setup["host"], name)
    plan.save(out)
    return out, plan


def _put(setup, plan_dir: str, digest: str) -> int:
    client = connect(setup["node"].location)
    try:
        return upload_plan(client, plan_dir, digest, call_options("uploader", TOKEN, timeout=120))
    finally:
        client.close()


def test_compact_plan_upload_is_its_inputs_and_the_node_derives_the_same_steps(setup):
    plan_dir, plan = _plan_dir(setup, "p", [(setup["a"], 0.7), (setup["b"], 0.3)])
    json_bytes = os.path.getsize(os.path.join(plan_dir, "plan.json"))
    prefix_bytes = os.path.getsize(os.path.join(plan_dir, "block_prefix.npy"))
    sent = _put(setup, plan_dir, plan.digest)
    assert sent == json_bytes < 4096 and prefix_bytes > 50 * sent  # the array stayed on the host
    health = flight_action(connect(setup["node"].location), "health", {})
    kept = os.path.join(setup["root"], health["plans"][plan.digest])
    assert kept == os.path.join(setup["root"], UPLOAD_DIR, plan.digest.split(":")[1])
    assert sorted(os.listdir(kept)) == ["block_prefix.npy", "plan.json"]
    on_node = load_plan(kept)  # verified against the digest
    assert on_node.digest == plan.digest
    np.testing.assert_array_equal(np.asarray(on_node.arrays["block_prefix"]), np.asarray(plan.arrays["block_prefix"]))
    on_node.attach([setup["a"], setup["b"]])
    for step in (0, 1, 177, 399):
        for world in (1, 4):
            for rank in range(world):
                mine = plan.pieces(*plan.rank_items(step, rank, world))
                theirs = on_node.pieces(*on_node.rank_items(step, rank, world))
                for x, y in zip(mine, theirs):
                    np.testing.assert_array_equal(x, y)
    assert _put(setup, plan_dir, plan.digest) == sent  # sent again: kept, nothing rebuilt or replaced


def test_compact_plans_the_node_cannot_derive_are_refused(setup):
    elsewhere = ArraySource(np.arange(1, 500), tokens=True, fingerprint="sha256:not-on-the-node")
    plan_dir, plan = _plan_dir(setup, "missing", [(setup["a"], 0.5), (elsewhere, 0.5)])
    with pytest.raises(flight.FlightError, match="does not hold them all"):
        _put(setup, plan_dir, plan.digest)
    # plan.json edited (another seed) under the digest of the original: derived, then refused by the digest
    plan_dir, plan = _plan_dir(setup, "edited", [(setup["a"], 1.0)])
    doc = json.load(open(os.path.join(plan_dir, "plan.json")))
    doc["inputs"]["seed"] = 8
    json.dump(doc, open(os.path.join(plan_dir, "plan.json"), "w"))
    with pytest.raises(flight.FlightError, match="do not match their digest"):
        _put(setup, plan_dir, plan.digest)
    uploads = os.path.join(setup["root"], UPLOAD_DIR)
    assert not any(n.startswith(".incoming") for n in os.listdir(uploads))  # no debris
    assert setup["node"].proc.poll() is None
