"""One calling convention for the Loader: Loader(plan) or Loader(plan, datasets=...) to override; the older
Loader(datasets, plan) still works and warns. The same for the DataLoader adapter."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from foresight.format import DatasetWriter, open_dataset
from foresight.loader import ForesightIterableDataset, Loader
from foresight.plan import build_plan


@pytest.fixture()
def saved(tmp_path):
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 120, size=80)
    with DatasetWriter(str(tmp_path / "corpus"), token_dtype="uint16") as w:
        w.add_many(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
    with open_dataset(str(tmp_path / "corpus")) as ds:
        build_plan([(ds, 1.0)], seed=3, global_batch_size=4, seq_len=16, num_steps=5).save(str(tmp_path / "plan"))
    return tmp_path


def rows(loader) -> list[torch.Tensor]:
    with loader:
        return [batch["tokens"].clone() for batch in loader]


def test_the_plan_alone_with_datasets_and_the_old_form_give_the_same_batches(saved):
    alone = rows(Loader(str(saved / "plan")))
    with open_dataset(str(saved / "corpus")) as ds:
        override = rows(Loader(saved / "plan", datasets=ds))
        with pytest.warns(DeprecationWarning, match=r"Loader\(datasets, plan\) is the old form"):
            old = Loader(ds, saved / "plan")
        old_form = rows(old)
    assert len(alone) == 5
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(alone, override, old_form))


def test_ambiguous_calls_are_refused_naming_the_one_form(saved):
    with open_dataset(str(saved / "corpus")) as ds:
        with pytest.raises(TypeError, match=r"one positional argument, the plan"):
            Loader(ds, saved / "plan", datasets=ds)
        with pytest.raises(TypeError, match=r"one positional argument, the plan"):
            Loader(ds, saved / "plan", saved / "plan")
        with pytest.raises(TypeError, match=r"Loader needs a plan: Loader\(plan\)"):
            Loader(ds)


def test_the_dataloader_adapter_takes_the_same_one_form(saved):
    alone = [batch["tokens"] for batch in ForesightIterableDataset(str(saved / "plan"), rank=0, world_size=1)]
    with open_dataset(str(saved / "corpus")) as ds:
        override = [b["tokens"] for b in ForesightIterableDataset(saved / "plan", datasets=ds, rank=0, world_size=1)]
        with pytest.warns(DeprecationWarning, match=r"ForesightIterableDataset\(datasets, plan\) is the old form"):
            old = ForesightIterableDataset(ds, saved / "plan", rank=0, world_size=1)
        old_form = [batch["tokens"] for batch in old]
    assert len(alone) == 5
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(alone, override, old_form))
