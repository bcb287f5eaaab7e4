"""Loader("plan/"): a saved plan opens the datasets it recorded (sources.json), finds a moved one under search
paths, and refuses a missing or changed one with a PlanError saying where it was expected."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from foresight.errors import PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import Loader
from foresight.plan import build_plan, load_plan


def _tokens(path, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 120, size=120)
    tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16)
    with DatasetWriter(str(path), token_dtype="uint16") as w:
        w.add_many(tokens, lengths, modality="tokens")
    return open_dataset(str(path))


@pytest.fixture()
def saved(tmp_path):
    ds = _tokens(tmp_path / "data" / "corpus")
    plan = build_plan([(ds, 1.0)], seed=7, global_batch_size=4, seq_len=24, num_steps=6)
    plan.save(str(tmp_path / "plan"))
    with Loader(ds, plan) as loader:
        reference = [(b.step, b["tokens"].clone()) for b in loader]
    return tmp_path, reference


def _batches(loader):
    return [(b.step, b["tokens"].clone()) for b in loader]


def _same(a, b):
    return len(a) == len(b) and all(s == t and torch.equal(x, y) for (s, x), (t, y) in zip(a, b))


def test_plan_directory_alone(saved):
    root, reference = saved
    with Loader(str(root / "plan")) as loader:
        assert _same(_batches(loader), reference)
        assert loader.datasets[0].path == str(root / "data" / "corpus")


def test_loaded_plan_alone_and_keyword(saved):
    root, reference = saved
    plan = load_plan(str(root / "plan"))
    with Loader(plan) as loader:
        assert _same(_batches(loader), reference)
    with Loader(None, root / "plan") as loader:  # a PathLike, datasets left to the plan
        assert _same(_batches(loader), reference)


def test_moved_together_with_the_plan(saved, tmp_path_factory):
    root, reference = saved
    moved = tmp_path_factory.mktemp("elsewhere") / "project"
    shutil.move(str(root), str(moved))  # plan and data keep their relative layout
    with Loader(str(moved / "plan")) as loader:
        assert _same(_batches(loader), reference)


def test_moved_dataset_found_under_search(saved, tmp_path_factory):
    root, reference = saved
    new_home = tmp_path_factory.mktemp("new_home")
    shutil.move(str(root / "data" / "corpus"), str(new_home / "corpus"))
    with pytest.raises(PlanError, match="expected at .*corpus.*search="):
        Loader(str(root / "plan"))
    with Loader(str(root / "plan"), search=[str(new_home)]) as loader:
        assert _same(_batches(loader), reference)


def test_changed_dataset_is_refused(saved):
    root, _ = saved
    shutil.rmtree(root / "data" / "corpus")
    _tokens(root / "data" / "corpus", seed=1)  # same place, other content
    with pytest.raises(PlanError, match="has changed"):
        Loader(str(root / "plan"))


def test_unsaved_plan_alone_is_refused(tmp_path):
    ds = _tokens(tmp_path / "d")
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=2, seq_len=8, num_steps=2)
    with pytest.raises(PlanError, match="not been saved"):
        Loader(plan)


def test_not_a_plan_is_refused(tmp_path):
    ds = _tokens(tmp_path / "d")
    with pytest.raises(TypeError, match="Loader needs a plan"):
        Loader(ds)


def test_datasets_opened_for_the_plan_are_closed_with_the_loader(saved):
    root, _ = saved
    loader = Loader(str(root / "plan"))
    ds = loader.datasets[0]
    next(iter(loader)).clone()
    ds.read(0)  # opens a descriptor of the dataset's own
    assert ds._fds
    loader.close()
    assert not ds._fds
