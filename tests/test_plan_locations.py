"""Plans remember their datasets: opened alone they find them again, moved ones are searched for by fingerprint or
refused with an error saying where they were expected; a plan that cannot be saved names the file."""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

from foresight.errors import PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.plan import build_plan, load_plan, open_plan_datasets

sys.path.insert(0, os.path.dirname(__file__))
from full_disk import full_disk  # noqa: E402,F401  (fixture)


def _dataset(path, seed):
    rng = np.random.default_rng(seed)
    with DatasetWriter(str(path), overwrite=True) as w:
        for _ in range(40):
            w.add(rng.integers(0, 1000, int(rng.integers(5, 50))).astype(np.uint16), modality="tokens")
    return open_dataset(str(path))


def _plan(tmp_path, *datasets):
    plan = build_plan([(d, 1.0) for d in datasets], seed=3, global_batch_size=4, seq_len=16, num_steps=5)
    plan.save(str(tmp_path / "plan"))
    return tmp_path / "plan"


def test_a_saved_plan_opens_its_datasets_alone(tmp_path):
    a, b = _dataset(tmp_path / "a", 1), _dataset(tmp_path / "b", 2)
    plan = load_plan(str(_plan(tmp_path, a, b)))
    got = open_plan_datasets(plan)
    assert [d.fingerprint for d in got] == [a.fingerprint, b.fingerprint]
    plan.check_sources(got)
    doc = json.loads((tmp_path / "plan" / "sources.json").read_text())
    assert [s["fingerprint"] for s in doc["sources"]] == plan.dataset_fingerprints


def test_locations_do_not_change_the_digest(tmp_path):
    a = _dataset(tmp_path / "a", 1)
    p1 = load_plan(str(_plan(tmp_path, a)))
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "a")
    other = build_plan([(open_dataset(str(tmp_path / "elsewhere" / "a")), 1.0)], seed=3, global_batch_size=4,
                       seq_len=16, num_steps=5)
    assert other.digest == p1.digest  # where the data sits is not part of the plan's identity


def test_plan_and_data_moved_together_are_found(tmp_path):
    _plan(tmp_path / "proj", _dataset(tmp_path / "proj" / "data", 1))
    shutil.move(str(tmp_path / "proj"), str(tmp_path / "moved"))
    got = open_plan_datasets(load_plan(str(tmp_path / "moved" / "plan")))  # by the path relative to the plan
    assert got[0].path == str(tmp_path / "moved" / "data")


def test_a_moved_dataset_is_found_by_fingerprint_or_refused_clearly(tmp_path, monkeypatch):
    a = _dataset(tmp_path / "a", 1)
    plan = load_plan(str(_plan(tmp_path, a)))
    os.makedirs(tmp_path / "store")
    shutil.move(str(tmp_path / "a"), str(tmp_path / "store" / "renamed"))
    with pytest.raises(PlanError, match=r"expected at .*/a, but it is not there.*FORESIGHT_DATA_PATH"):
        open_plan_datasets(plan)
    assert open_plan_datasets(plan, search=[str(tmp_path / "store")])[0].fingerprint == a.fingerprint
    monkeypatch.setenv("FORESIGHT_DATA_PATH", str(tmp_path / "store"))
    assert open_plan_datasets(plan)[0].fingerprint == a.fingerprint


def test_a_changed_dataset_at_the_recorded_path_is_refused(tmp_path):
    plan = load_plan(str(_plan(tmp_path, _dataset(tmp_path / "a", 1))))
    _dataset(tmp_path / "a", 99)  # same place, other data
    with pytest.raises(PlanError, match="has changed"):
        open_plan_datasets(plan)


def test_plan_without_locations_says_so(tmp_path):
    path = _plan(tmp_path, _dataset(tmp_path / "a", 1))
    os.remove(path / "sources.json")
    with pytest.raises(PlanError, match="records no dataset locations"):
        open_plan_datasets(load_plan(str(path)))


def test_plan_save_on_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, full_disk):
    rng = np.random.default_rng(0)
    with DatasetWriter(str(tmp_path / "big"), overwrite=True) as w:
        w.add_many(rng.integers(0, 9, 400_000).astype(np.uint16), np.full(20_000, 20, np.int64), modality="tokens")
    plan = build_plan([(open_dataset(str(tmp_path / "big")), 1.0)], seed=1, global_batch_size=64, seq_len=16,
                      epochs=1)
    with pytest.raises(OSError, match=r"No space left on device.*\.npy|\.npy.*No space") as e:
        plan.save(str(full_disk / "plan"))
    assert e.value.filename and str(e.value.filename).endswith(".npy")
    assert os.listdir(full_disk) == []
