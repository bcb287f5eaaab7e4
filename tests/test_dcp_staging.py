"""ForesightStorageWriter as DCP's async stager: any value plain save accepts, and a reused writer
whose state dict changed structure (keys, shapes, dtypes) between saves."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Tag:  # a custom object in a state dict: pickled into a bytes item by DCP's planner
    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tag) and other.name == self.name


def _async_save(state, writer) -> None:
    dcp.async_save(state, storage_writer=writer, no_dist=True).result()


def _load(state, path) -> dict:
    dcp.load(state, storage_reader=ForesightStorageReader(path), no_dist=True)
    return state


def test_async_save_stages_values_outside_tensor_and_bytes(tmp_path):
    state = {"w": torch.arange(6.0), "np": np.arange(4, dtype=np.int16), "ids": {3, 1, 2}, "tag": Tag("run-7"),
             "cfg": {"steps": (1, 2), "beta": 0.9}}
    for cache in (True, False):
        path = tmp_path / f"cache-{cache}"
        _async_save(state, ForesightStorageWriter(path, cache_staged_state_dict=cache))
        got = _load({"w": torch.zeros(6), "np": None, "ids": None, "tag": None, "cfg": {"steps": None, "beta": 0.0}},
                    path)
        assert torch.equal(got["w"], state["w"])
        assert isinstance(got["np"], np.ndarray) and np.array_equal(got["np"], state["np"])
        assert got["ids"] == {1, 2, 3} and got["tag"] == Tag("run-7")
        assert got["cfg"] == {"steps": (1, 2), "beta": 0.9}


def test_reused_writer_async_save_after_key_added(tmp_path):
    # optimizer state appears after the first step: the second save has more keys than the first
    writer = ForesightStorageWriter(tmp_path / "a")
    _async_save({"model": {"w": torch.ones(3)}}, writer)
    later = {"model": {"w": torch.full((3,), 2.0)}, "optim": {"exp_avg": torch.full((3,), 5.0), "step": 1}}
    writer.reset(tmp_path / "b")
    _async_save(later, writer)
    got = _load({"model": {"w": torch.zeros(3)}, "optim": {"exp_avg": torch.zeros(3), "step": 0}}, tmp_path / "b")
    assert torch.equal(got["model"]["w"], later["model"]["w"])
    assert torch.equal(got["optim"]["exp_avg"], later["optim"]["exp_avg"]) and got["optim"]["step"] == 1


def test_reused_writer_async_save_after_shape_or_dtype_changed(tmp_path):
    # copying into the cached copy would broadcast (4,) <- (1,) and convert bf16 -> fp32 without a word
    writer = ForesightStorageWriter(tmp_path / "a")
    _async_save({"w": torch.zeros(4), "h": torch.zeros(2)}, writer)
    later = {"w": torch.full((1,), 3.0), "h": torch.tensor([1.5, 2.5], dtype=torch.bfloat16)}
    writer.reset(tmp_path / "b")
    _async_save(later, writer)
    md = ForesightStorageReader(tmp_path / "b").read_metadata()
    assert tuple(md.state_dict_metadata["w"].size) == (1,)
    assert md.state_dict_metadata["h"].properties.dtype == torch.bfloat16
    got = _load({"w": torch.zeros(1), "h": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "b")
    assert torch.equal(got["w"], later["w"]) and torch.equal(got["h"], later["h"])


def test_reused_writer_restages_when_a_value_becomes_a_tensor(tmp_path):
    writer = ForesightStorageWriter(tmp_path / "a")
    _async_save({"lr": 0.1, "w": torch.ones(2)}, writer)
    writer.reset(tmp_path / "b")
    _async_save({"lr": torch.tensor(0.05), "w": torch.ones(2)}, writer)
    got = _load({"lr": torch.tensor(0.0), "w": torch.zeros(2)}, tmp_path / "b")
    assert torch.equal(got["lr"], torch.tensor(0.05))
