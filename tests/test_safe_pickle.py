"""DCP ``.metadata`` is loaded by a restricted unpickler: real metadata loads, code in a pickle never runs."""
from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter
from foresight.replication.hints import derive_dcp_hints
from foresight.replication.hot_layout import HotFileStorageWriter
from foresight.replication.merge import read_tensors
from foresight.replication.source import LocalSource
from foresight.replication.units import ReplicaBuilder, verify_checkpoint
from foresight.checkpoint.safe_pickle import load_dcp_metadata
from foresight.errors import CheckpointError

WRITERS = {"foresight": ForesightStorageWriter, "hot": HotFileStorageWriter, "pytorch": dcp.FileSystemWriter}


def train_state() -> dict:
    """Model + optimizer state after one step (tensors of several dtypes, bytes items such as lr)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    model.add_module("emb", torch.nn.Embedding(10, 4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (model[1](model[0](torch.randn(3, 8))).sum() + model.emb(torch.tensor([1])).float().sum()).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 3}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    state = train_state()
    for name, writer in WRITERS.items():
        dcp.save(state, storage_writer=writer(str(root / name)), no_dist=True)
    return root


# Pickles a malicious file would hold (protocol 0 by hand, so the global is exactly the named one); each one
# creates the file ``marker`` when it is unpickled.
PAYLOADS = {
    "os.system": lambda marker: f"cos\nsystem\n(S'touch {marker}'\ntR.".encode(),
    "builtins.eval": lambda marker: f"cbuiltins\neval\n(S'open({str(marker)!r}, \"w\").close()'\ntR.".encode(),
    "subprocess.Popen": lambda marker: f"csubprocess\nPopen\n((S'touch'\nS'{marker}'\nttR.".encode(),
}


def _run_for_real(payload: bytes) -> None:
    obj = pickle.loads(payload)  # noqa: S301 (the control: proves the payload is live)
    if hasattr(obj, "wait"):
        obj.wait()


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_real_dcp_metadata_loads_and_equals_pickle_load(saved, writer):
    path = str(saved / writer / ".metadata")
    with open(path, "rb") as f:
        raw = f.read()
    md = load_dcp_metadata(raw, source=path)
    assert md == pickle.loads(raw)
    with open(path, "rb") as f:
        assert load_dcp_metadata(f, source=path) == md
    assert "model.0.weight" in md.state_dict_metadata and len(md.storage_data) > 5


def test_dcp_load_through_the_reader_is_unchanged(saved):
    target = train_state()
    target["model"]["0.weight"] = torch.zeros(4, 8)
    dcp.load(target, storage_reader=ForesightStorageReader(str(saved / "foresight")), no_dist=True)
    assert torch.equal(target["model"]["0.weight"], train_state()["model"]["0.weight"])


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, name):
    control = tmp_path / "control"
    _run_for_real(PAYLOADS[name](control))
    assert control.exists()  # the payload really acts when unpickled by pickle itself
    marker = tmp_path / "pwned"
    with pytest.raises(CheckpointError, match=rf"refused.*{name}.*path=/x/\.metadata"):
        load_dcp_metadata(PAYLOADS[name](marker), source="/x/.metadata")
    assert not marker.exists()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_global_hidden_inside_real_metadata_is_refused(saved, tmp_path):
    with open(saved / "foresight" / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.storage_meta.checkpoint_id = _Evil(tmp_path / "pwned")
    with pytest.raises(CheckpointError, match=rf"refers to {os.system.__module__}\.system.*path=evil"):
        load_dcp_metadata(pickle.dumps(md), source="evil")
    assert not (tmp_path / "pwned").exists()


def test_truncated_or_foreign_pickles_get_a_clear_error(saved):
    raw = (saved / "foresight" / ".metadata").read_bytes()
    for cut in (0, 1, len(raw) // 2, len(raw) - 1):
        with pytest.raises(CheckpointError, match="truncated or corrupt.*path=ck/.metadata"):
            load_dcp_metadata(raw[:cut], source="ck/.metadata")
    with pytest.raises(CheckpointError, match="holds a dict, not a torch.distributed.checkpoint Metadata"):
        load_dcp_metadata(pickle.dumps({"a": 1}), source="ck/.metadata")


def _poisoned_copy(saved, tmp_path, marker):
    ck = tmp_path / "ck"
    shutil.copytree(saved / "foresight", ck)
    (ck / ".metadata").write_bytes(PAYLOADS["os.system"](marker))
    return ck


@pytest.mark.parametrize("reader", ["dcp reader", "hints", "replica verify", "merge"])
def test_every_metadata_reader_refuses_a_malicious_file(saved, tmp_path, reader):
    marker = tmp_path / "pwned"
    ck = _poisoned_copy(saved, tmp_path, marker)
    read = {
        "dcp reader": lambda: ForesightStorageReader(str(ck)).read_metadata(),
        "hints": lambda: derive_dcp_hints(str(ck), world_size=4),
        "replica verify": lambda: verify_checkpoint(str(ck)),
        "merge": lambda: read_tensors(LocalSource(str(ck))),
    }[reader]
    with pytest.raises(CheckpointError, match=rf"refused.*os\.system.*path={ck}/\.metadata"):
        read()
    assert not marker.exists()


def test_a_replica_with_a_malicious_metadata_is_never_published(saved, tmp_path):
    marker = tmp_path / "pwned"
    rb = ReplicaBuilder(str(tmp_path / "eval"), "job/step-00000001")
    with pytest.raises(CheckpointError, match=r"refused.*os\.system"):
        rb.finalize({".metadata": PAYLOADS["os.system"](marker)}, expected_units=0)
    assert not marker.exists() and not os.path.exists(rb.final)


def test_the_receiving_node_refuses_a_malicious_replica_over_flight(tmp_path):
    """The real receiving path: a site process gets ``DoPut replica.commit`` whose ``.metadata`` runs code."""
    from pyarrow import flight

    from foresight.replication.flight_calls import SCHEMA, binary_batch

    from replication_helpers import Site

    marker = tmp_path / "pwned"
    body = PAYLOADS["os.system"](marker)
    cmd = {"op": "replica.commit", "name": "job/step-00000001", "units": 0, "source_site": "attacker",
           "files": [[".metadata", len(body)]]}
    site = Site("eval-b", str(tmp_path / "eval"))
    try:
        client = flight.connect(site.url)
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("replica.commit", json.dumps(cmd)), SCHEMA)
        writer.write_batch(binary_batch(memoryview(body)))
        writer.done_writing()
        with pytest.raises(flight.FlightError, match=r"refused to unpickle.*os\.system.*\.metadata"):
            reader.read()  # the answer, or the node's refusal (reported by the read or the close)
            writer.close()
        client.close()
        assert not os.path.exists(os.path.join(site.root, "job", "step-00000001"))
    finally:
        site.stop()
    assert not marker.exists()
