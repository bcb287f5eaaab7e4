"""``Loader(micro_batches=k)``: a rank's share of each step as k micro-batches in plan order, equal to the whole
step split by hand, resumable at a micro-batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from foresight.errors import PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import Loader
from foresight.plan import build_plan

SEQ = 16


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("micro")
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, int(n), dtype=np.uint16) for n in rng.integers(3, 60, 400)]
    with DatasetWriter(str(root / "tok"), token_dtype="uint16", align=0, fsync=False) as w:
        w.add_many(np.concatenate(docs), [len(d) for d in docs], modality="tokens")
    ds = open_dataset(str(root / "tok"))
    return ds, build_plan([(ds, 1.0)], seed=2, global_batch_size=16, seq_len=SEQ, num_steps=5)


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    root = tmp_path_factory.mktemp("micro-s")
    with DatasetWriter(str(root / "s"), fsync=False) as w:
        for i in range(60):
            w.add(bytes([i % 251]) * (50 + 37 * i), modality="bytes", meta={"caption": f"sample {i}"})
    ds = open_dataset(str(root / "s"))
    return ds, build_plan([(ds, 1.0)], seed=3, global_batch_size=12, num_steps=4)


def collect(loader, limit=None):
    out = []
    for batch in loader:
        out.append(batch.clone())
        if limit is not None and len(out) == limit:
            break
    return out


def test_token_micro_batches_are_the_step_split_by_hand(tokens):
    ds, plan = tokens
    k, rank, world = 4, 1, 2
    with Loader(ds, plan, rank=rank, world_size=world) as loader:
        whole = collect(loader)
    with Loader(ds, plan, rank=rank, world_size=world, micro_batches=k) as loader:
        assert len(loader) == 5 * k
        micro = collect(loader)
        assert loader.stats.steps == 5 and loader.stats.samples == 5 * 8
    assert [(b.step, b["micro_batch"]) for b in micro] == [(s, j) for s in range(5) for j in range(k)]
    m = 8 // k  # items per micro-batch: 16 / 2 ranks / 4
    for b in micro:
        w, j = whole[b.step], b["micro_batch"]
        rows = slice(j * m, (j + 1) * m)
        for name in ("tokens", "input_ids", "labels", "position_ids"):
            assert torch.equal(b[name], w[name][rows]), name
        lo, hi = j * m * SEQ, (j + 1) * m * SEQ
        cu = w["cu_seqlens"]
        assert torch.equal(b["cu_seqlens"], cu[(cu >= lo) & (cu <= hi)] - lo)
        ptr = w["item_ptr"]
        assert torch.equal(b["item_ptr"], ptr[j * m : (j + 1) * m + 1] - ptr[j * m])


def test_sample_micro_batches_keep_plan_order_bytes_and_meta(samples):
    ds, plan = samples
    with Loader(ds, plan, meta_fields=("caption",)) as loader:
        whole = collect(loader)
    with Loader(ds, plan, meta_fields=("caption",), micro_batches=3) as loader:
        micro = collect(loader)
    assert len(micro) == 3 * len(whole)
    for b in micro:
        w, j = whole[b.step], b["micro_batch"]
        assert b["sample_ids"].tolist() == w["sample_ids"].tolist()[j * 4 : (j + 1) * 4]
        assert b["caption"] == w["caption"][j * 4 : (j + 1) * 4]
        data = b["data"].numpy()
        got = [bytes(data[o : o + n]) for o, n in zip(b["offsets"].tolist(), b["lengths"].tolist())]
        assert got == [bytes(ds.read(int(s))) for s in b["sample_ids"].tolist()]


def test_resume_in_the_middle_of_a_step(tokens):
    ds, plan = tokens
    with Loader(ds, plan, micro_batches=4) as loader:
        full = collect(loader)
    with Loader(ds, plan, micro_batches=4) as loader:
        head = collect(loader, limit=10)  # steps 0, 1 and two micro-batches of step 2
        state = loader.state_dict()
    assert state["next_step"] == 2 and state["micro_batch"] == 2 and state["micro_batches"] == 4
    with Loader(ds, plan, micro_batches=4) as loader:
        loader.load_state_dict(state)
        assert len(loader) == 10
        tail = collect(loader)
    got = head + tail
    assert [(b.step, b["micro_batch"]) for b in got] == [(b.step, b["micro_batch"]) for b in full]
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, full))
    with Loader(ds, plan, micro_batches=2) as loader, pytest.raises(PlanError, match="micro_batches=4"):
        loader.load_state_dict(state)  # mid-step: only the same split can resume it
    with Loader(ds, plan, micro_batches=4) as loader:  # at a step boundary any split resumes
        collect(loader, limit=8)
        boundary = loader.state_dict()
    with Loader(ds, plan) as loader:
        loader.load_state_dict(boundary)
        assert [b.step for b in loader] == [2, 3, 4]


def test_a_share_that_does_not_split_is_refused(tokens):
    ds, plan = tokens
    with pytest.raises(PlanError, match=r"share of a step \(8 items: global batch size 16 / world size 2\) does "
                                        r"not split into 3"):
        Loader(ds, plan, rank=0, world_size=2, micro_batches=3)
    with pytest.raises(ValueError, match="step_stride"):
        Loader(ds, plan, micro_batches=2, step_stride=2)


def test_the_dataloader_adapter_says_micro_batches_are_a_loader_option(tokens):
    from foresight import ForesightIterableDataset

    ds, plan = tokens
    with pytest.raises(ValueError, match="micro_batches is a Loader option"):
        ForesightIterableDataset(ds, plan, micro_batches=2)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("world,k", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_unit_items_are_the_plans_rank_items_split_k_ways(tokens, compact, world, k):
    """The pipeline derives each unit's items from step 0's share (no per-step checks); they are the plan's own
    ``rank_items`` split k ways for every unit of every rank, and a step outside the plan is still refused by it."""
    ds, _ = tokens
    plan = build_plan([(ds, 1.0)], seed=2, global_batch_size=16, seq_len=SEQ, num_steps=5, compact=compact)
    for rank in range(world):
        with Loader(ds, plan, rank=rank, world_size=world, micro_batches=k) as loader:
            for unit in range(plan.num_steps * k):
                step, micro = divmod(unit, k)
                start, stop = plan.rank_items(step, rank, world)
                size = (stop - start) // k
                assert loader._unit_items(unit) == (step, micro, start + micro * size, start + (micro + 1) * size)
            with pytest.raises(PlanError):
                loader._unit_items(plan.num_steps * k)
