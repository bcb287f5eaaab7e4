"""export_safetensors: tensors, names and metadata survive; safetensors reads them back."""
from __future__ import annotations

import json

import foresight.checkpoint as fc
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def test_export_safetensors_round_trip(tmp_path):
    state = {"model": {"w": torch.randn(3, 4).to(torch.bfloat16), "b": torch.arange(4, dtype=torch.int8)},
             "big": torch.randn(100_000), "flag": torch.tensor(True), "lr": 0.1}
    with fc.Checkpointer(tmp_path / "ck") as ck:
        ck.save(state, 9, extra_state={"pos": 9}).wait()
        loaded = ck.load(9)
    out = fc.export_safetensors(loaded, tmp_path / "m.safetensors")
    got = load_file(out)
    assert set(got) == {"model.w", "model.b", "big", "flag"}
    assert torch.equal(got["model.w"], state["model"]["w"]) and got["model.w"].dtype == torch.bfloat16
    assert torch.equal(got["big"], state["big"]) and torch.equal(got["flag"], state["flag"])
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["foresight.step"] == "9" and json.loads(meta["foresight.extra_state"]) == {"pos": 9}
