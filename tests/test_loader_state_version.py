"""A resume state carries its format version and plan digest; one this code cannot honour is refused, not resumed."""
from __future__ import annotations

import numpy as np
import pytest

from foresight.errors import PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import ForesightIterableDataset, Loader
from foresight.loader.loader import STATE_VERSION
from foresight.plan import build_plan

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 100, size=120)
    with DatasetWriter(str(root / "data"), token_dtype="uint16") as w:
        w.add_many(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
    ds = open_dataset(str(root / "data"))
    plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=4, seq_len=16, num_steps=STEPS)
    plan.save(str(root / "plan"))
    other = build_plan([(ds, 1.0)], seed=6, global_batch_size=4, seq_len=16, num_steps=STEPS)
    return ds, plan, other, str(root / "plan")


def _state_after(ds, plan, steps: int) -> dict:
    with Loader(ds, plan, prefetch=1) as loader:
        it = iter(loader)
        for _ in range(steps):
            next(it)
        return loader.state_dict()


def _steps_after_resume(ds, plan, state) -> list[int]:
    with Loader(ds, plan, prefetch=1) as loader:
        loader.load_state_dict(state)
        return [b.step for b in loader]


def test_loader_state_has_a_version_and_resumes(setup):
    ds, plan, _, _ = setup
    state = _state_after(ds, plan, 2)
    assert state == {"version": STATE_VERSION, "plan_digest": plan.digest, "next_step": 2}
    assert _steps_after_resume(ds, plan, state) == list(range(2, STEPS))


def test_a_state_without_version_is_version_1(setup):
    ds, plan, _, _ = setup
    state = _state_after(ds, plan, 3)
    del state["version"]  # written before the field existed
    assert _steps_after_resume(ds, plan, state) == list(range(3, STEPS))


@pytest.mark.parametrize("version", [STATE_VERSION + 1, 0, "1", 1.5, True, None])
def test_an_unknown_or_newer_version_is_refused(setup, version):
    ds, plan, _, _ = setup
    state = dict(_state_after(ds, plan, 1), version=version)
    with Loader(ds, plan, prefetch=1) as loader:
        with pytest.raises(PlanError, match=rf"version {version!r}.*reads version {STATE_VERSION}"):
            loader.load_state_dict(state)


def test_a_state_of_another_plan_is_refused(setup):
    ds, plan, other, _ = setup
    state = _state_after(ds, other, 2)
    with Loader(ds, plan, prefetch=1) as loader:
        with pytest.raises(PlanError, match=f"another plan.*expected={plan.digest}.*found={other.digest}"):
            loader.load_state_dict(state)
        with pytest.raises(PlanError, match="another plan"):
            loader.load_state_dict({"next_step": 2})  # no digest at all: nothing says it is this plan's


@pytest.mark.parametrize("next_step", [-1, "2", None, 2.5])
def test_a_malformed_next_step_is_refused(setup, next_step):
    ds, plan, _, _ = setup
    state = dict(_state_after(ds, plan, 1), next_step=next_step)
    with Loader(ds, plan, prefetch=1) as loader:
        with pytest.raises(PlanError, match="next_step"):
            loader.load_state_dict(state)


def test_the_dataset_adapter_follows_the_same_rules(setup):
    _, _, other, plan_dir = setup
    ds = ForesightIterableDataset(plan_dir, rank=0, world_size=1, prefetch=1)
    state = ds.state_dict()
    assert state["version"] == STATE_VERSION
    legacy = {k: v for k, v in state.items() if k != "version"}
    resumed = ForesightIterableDataset(plan_dir, rank=0, world_size=1, prefetch=1)
    resumed.load_state_dict(legacy)
    assert [b["step"] for b in resumed] == list(range(STEPS))
    with pytest.raises(PlanError, match=rf"version {STATE_VERSION + 1}.*reads version {STATE_VERSION}"):
        resumed.load_state_dict(dict(state, version=STATE_VERSION + 1))
    with pytest.raises(PlanError, match="another plan"):
        resumed.load_state_dict(dict(state, plan_digest=other.digest))
