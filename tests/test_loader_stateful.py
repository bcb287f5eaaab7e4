"""The DataLoader adapter: exported from foresight, len(), and exact resume under torchdata's StatefulDataLoader
with worker processes (skipped where torchdata is not installed)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import foresight
from foresight.errors import PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import ForesightIterableDataset
from foresight.plan import build_plan

stateful = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful.StatefulDataLoader

STEPS = 11


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdl")
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 150, size=200)
    with DatasetWriter(str(root / "data"), token_dtype="uint16") as w:
        w.add_many(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
    ds = open_dataset(str(root / "data"))
    plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=4, seq_len=16, num_steps=STEPS)
    plan.save(str(root / "plan"))
    return str(root / "plan")


def _adapter(plan_dir, **kw):
    return ForesightIterableDataset(plan_dir, rank=0, world_size=1, prefetch=2, **kw)


def _run(loader, limit=None):
    out = []
    for batch in loader:
        out.append((batch["step"], batch["tokens"].clone()))
        if limit is not None and len(out) == limit:
            break
    return out


def test_exported_and_sized(saved):
    assert foresight.ForesightIterableDataset is ForesightIterableDataset
    assert len(_adapter(saved)) == STEPS
    assert len(_adapter(saved, start_step=4, end_step=9)) == 5
    assert len(StatefulDataLoader(_adapter(saved), batch_size=None, num_workers=2)) == STEPS


@pytest.mark.parametrize("num_workers,cut", [(2, 4), (2, 5), (0, 3)])
def test_exact_resume_under_stateful_dataloader(saved, num_workers, cut):
    # Worker processes fork the process that runs this: a fresh interpreter, not pytest's (which by now carries the
    # threads of hundreds of earlier tests), is what a training script forks. A hang fails within the timeout.
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_loader_stateful as t; "
            f"t.exact_resume({saved!r}, {num_workers}, {cut})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def exact_resume(saved, num_workers, cut):
    full = _run(StatefulDataLoader(_adapter(saved), batch_size=None, num_workers=num_workers, timeout=120 if num_workers else 0))
    assert [s for s, _ in full] == list(range(STEPS))

    first = StatefulDataLoader(_adapter(saved), batch_size=None, num_workers=num_workers, timeout=120 if num_workers else 0)
    head = _run(first, limit=cut)
    state = first.state_dict()
    del first  # the interrupted run is gone; only its state remains

    resumed = StatefulDataLoader(_adapter(saved), batch_size=None, num_workers=num_workers, timeout=120 if num_workers else 0)
    resumed.load_state_dict(state)
    tail = _run(resumed)
    got = head + tail
    assert [s for s, _ in got] == list(range(STEPS))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, full))


def test_dataset_state_without_workers(saved):
    ds = _adapter(saved)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    assert state["next_step"] == 3 and state["step_stride"] == 1
    other = _adapter(saved)
    other.load_state_dict(state)
    assert [b["step"] for b in other] == list(range(3, STEPS))
    assert [b["step"] for b in other] == list(range(STEPS))  # a finished pass starts the next one over


def test_state_of_another_plan_or_worker_count_is_refused(saved):
    state = _adapter(saved).state_dict()
    with pytest.raises(PlanError, match="another plan"):
        _adapter(saved).load_state_dict(dict(state, plan_digest="0" * 32))
    two = _adapter(saved)
    two.load_state_dict(dict(state, step_stride=2))
    with pytest.raises(ValueError, match="same num_workers"):
        next(iter(two))
