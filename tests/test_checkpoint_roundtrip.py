"""Round trips through foresight.checkpoint: structure, dtypes, odd shapes, in-place restore, snapshots."""
from __future__ import annotations

import math

import threading

import foresight.checkpoint as fc
from foresight.checkpoint.background_writer import BackgroundWriter
import pytest
import torch
from foresight.errors import CheckpointError
from hypothesis import given, settings
from hypothesis import strategies as st


def assert_same(a, b, path="root"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.numel() and a.dtype == torch.bool else a,
                           b.view(torch.uint8) if b.numel() and b.dtype == torch.bool else b), path
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def mixed_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(300, 64, generator=g),
            "layers": [{"w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
                        "b": torch.randn(64, generator=g).half()} for _ in range(3)],
            "mask": torch.rand(17, generator=g) > 0.5,
            "q": torch.randint(-128, 127, (33,), dtype=torch.int8, generator=g),
            "ids": torch.arange(7, dtype=torch.int64),
            "empty": torch.empty(0, 5),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "transposed": torch.randn(40, 30, generator=g).t(),
            "strided": torch.randn(100, generator=g)[::3],
            "big": torch.randn(300_000, generator=g),  # above the aligned-extent threshold
        },
        "optim": {
            "state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.zeros(4)}, 1: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": float("inf"), "foreach": None,
                              "params": [0, 1], "name": "decay"}],
        },
        "epoch": 4,
        "nan": float("nan"),
    }


def test_round_trip_nested_mixed(tmp_path):
    state = mixed_state()
    with fc.Checkpointer(tmp_path) as ck:
        h = ck.save(state, 100, extra_state={"plan_step": 101, "digest": "abc"})
        assert isinstance(h, fc.SaveHandle)
        h.wait()
        assert h.done() and h.path.endswith("step-00000100")
        got = ck.load("latest")
    assert got.step == 100 and got.extra_state == {"plan_step": 101, "digest": "abc"} and got.tier == 0
    assert_same(state, got.state_dict)
    src = state["model"]["transposed"]
    assert not src.is_contiguous()  # the case this checks: a strided view is saved by value
    assert got.state_dict["model"]["transposed"].shape == src.shape
    assert torch.equal(got.state_dict["model"]["transposed"], src)


def test_thousands_of_small_tensors_and_module_functions(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"block{i}": {"w": torch.randn(int(n), generator=g), "i": torch.tensor([i], dtype=torch.int32)}
             for i, n in enumerate(torch.randint(1, 200, (3000,), generator=g))}
    fc.save(state, 5, root=tmp_path).wait()
    fc.save(state, 6, root=tmp_path).wait()
    assert fc.latest_step(root=tmp_path) == 6
    assert_same(state, fc.load(5, root=tmp_path).state_dict)


def test_mutation_after_save_does_not_leak(tmp_path):
    state = {"w": torch.zeros(1 << 20), "small": torch.zeros(10), "n": torch.zeros(3, 3)}
    with fc.Checkpointer(tmp_path) as ck:
        h = ck.save(state, 1)
        for t in state.values():  # training continues immediately
            t.add_(1.0)
        h.wait()
        got = ck.load(1).state_dict
    assert all(float(t.abs().sum()) == 0.0 for t in got.values())


def test_load_into_existing_tensors_in_place(tmp_path):
    state = mixed_state(2)
    with fc.Checkpointer(tmp_path, staging_bytes=8 << 20) as ck:
        ck.save(state, 7).wait()
        target = mixed_state(3)
        ptrs = {k: v.data_ptr() for k, v in target["model"].items() if isinstance(v, torch.Tensor)}
        target["model"]["embed.weight"] = torch.zeros(2, 2)  # shape mismatch: replaced, not filled
        res = ck.load(7, into=target)
    assert res.state_dict is target
    assert_same(state, target)
    for k, p in ptrs.items():
        if k != "embed.weight":
            assert target["model"][k].data_ptr() == p, k
    # replaced tensors must not alias the (reused) staging buffer
    target["model"]["embed.weight"].add_(1)
    with fc.Checkpointer(tmp_path) as ck:
        assert_same(state, ck.load(7).state_dict)


def test_tied_tensors_stay_tied(tmp_path):
    w = torch.randn(8, 8)
    with fc.Checkpointer(tmp_path) as ck:
        ck.save({"a": w, "b": w}, 1).wait()
        got = ck.load(1).state_dict
    assert got["a"] is got["b"] and torch.equal(got["a"], w)


def test_staging_overflow_is_explicit(tmp_path):
    with fc.Checkpointer(tmp_path, staging_bytes=1 << 16) as ck:
        with pytest.raises(CheckpointError, match="does not fit the staging pool"):
            ck.save({"w": torch.zeros(1 << 16)}, 1)



def test_busy_staging_raises_when_asked(tmp_path, monkeypatch):
    # Force the state under test: the writer holds the only staging slot until the test lets it go, so the next
    # save finds it busy every time (no race on how fast the disk is).
    release = threading.Event()
    write_one = BackgroundWriter._write_one

    def held_write(self, job):
        release.wait(60)
        return write_one(self, job)

    monkeypatch.setattr(BackgroundWriter, "_write_one", held_write)
    with fc.Checkpointer(tmp_path, staging_bytes=1 << 22, on_busy="raise") as ck:
        first = ck.save({"w": torch.zeros(1 << 20)}, 1)
        with pytest.raises(CheckpointError, match="on_busy='raise'"):
            ck.save({"w": torch.zeros(1 << 20)}, 2)
        release.set()
        first.wait()
        ck.save({"w": torch.ones(1 << 20)}, 3).wait()  # the slot is free again once the write is done
        assert torch.equal(ck.load(3).state_dict["w"], torch.ones(1 << 20))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="on_busy"):
        fc.Checkpointer(tmp_path, on_busy="drop")
    with pytest.raises(ValueError, match="keep"):
        fc.Checkpointer(tmp_path, keep=0)
    with fc.Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointError, match="extra_state is not JSON"):
            ck.save({"w": torch.zeros(1)}, 1, extra_state={"x": object()})
        with pytest.raises(CheckpointError, match="not checkpointable"):
            ck.save({"w": object()}, 1)
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ck.load("latest")


def test_extra_state_round_trips_exactly(tmp_path):
    extra = {"loader": {"next_step": 7, "epochs": {0: 3, 1: 4}, "shape": (2, 3), "mixed": {1: "a", "1": "b"}},
             "flags": {True: None, 2.5: [1, (2, 3)]}, "nan": float("nan"), "inf": -float("inf"), "plain": [1, "x"]}
    with fc.Checkpointer(tmp_path) as ck:
        ck.save({"w": torch.zeros(2)}, 1, extra_state=extra).wait()
        ck.save({"w": torch.zeros(2)}, 2, extra_state={"plain": [1, {"a": None}]}).wait()
        got = ck.load(1).extra_state
        assert ck.load(2).extra_state == {"plain": [1, {"a": None}]}
    assert_same(extra, got)
    assert type(got["loader"]["shape"]) is tuple and list(got["loader"]["epochs"]) == [0, 1]
    import json
    index = json.load(open(tmp_path / "step-00000002" / "index.json"))
    assert "extra_state_exact" not in index  # plain JSON stays plain


@pytest.mark.parametrize(("extra", "where"), [({"a": {"b": [1, {2}]}}, "at=a.b.1"),
                                              ({"a": {(1, 2): 3}}, "at=a"),
                                              ({"pos": [torch.ones(1)]}, "at=pos.0")])
def test_extra_state_that_cannot_round_trip_names_the_key_path(tmp_path, extra, where):
    with fc.Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointError, match="extra_state") as ei:
            ck.save({"w": torch.zeros(2)}, 1, extra_state=extra)
        assert where in str(ei.value)
        assert ck.steps() == []


_dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool,
                           torch.uint8, torch.float64])
_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(_dtypes, _shapes), min_size=0, max_size=20), st.integers(0, 2**31))
def test_property_round_trip(tmp_path_factory, specs, seed):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (dt, shape) in enumerate(specs):
        t = torch.randint(0, 100, shape, generator=g) if shape else torch.randint(0, 100, (), generator=g)
        state[f"t{i}"] = (t % 2).bool() if dt == torch.bool else t.to(dt)
    root = tmp_path_factory.mktemp("prop")
    with fc.Checkpointer(root) as ck:
        ck.save(state, 0).wait()
        assert_same(state, ck.load(0).state_dict)


def test_automatic_staging_grows_for_a_larger_state(tmp_path):
    with fc.Checkpointer(tmp_path) as ck:  # staging_bytes=None: sized by the first save
        ck.save({"w": torch.ones(1000)}, 1)
        first = ck.staging.slot_bytes
        bigger = {"w": torch.arange(1 << 20, dtype=torch.float32)}
        ck.save(bigger, 2).wait()
        assert ck.staging.slot_bytes > first
        assert torch.equal(ck.load(2).state_dict["w"], bigger["w"])
        assert torch.equal(ck.load(1).state_dict["w"], torch.ones(1000))
