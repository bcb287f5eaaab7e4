"""One lifetime rule for loader batches: valid until the next batch is asked for (or ``release()``); after that
every accessor raises, and ``batch.clone()`` keeps a copy that never goes stale. Stats say where time went."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from foresight.errors import ForesightError, StaleBatchError
from foresight.loader import Loader, LoaderStats
from foresight.loader.stats import STAGES
from foresight.plan import build_plan
from test_loader import _bytes_dataset, _expected_rows, _token_dataset


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    ds, _, _ = _token_dataset(tmp_path_factory.mktemp("life") / "t")
    return ds, build_plan([(ds, 1.0)], seed=7, global_batch_size=8, seq_len=32, num_steps=10)


@pytest.mark.parametrize("field", ["tokens", "input_ids", "labels", "position_ids", "sample_ids"])
def test_a_held_cpu_batch_raises_once_its_slot_is_recycled(tokens, field):
    ds, plan = tokens
    with Loader(ds, plan, prefetch=1) as loader:
        it = iter(loader)
        first = next(it)
        kept = first.clone()
        want = _expected_rows([ds], plan, *plan.rank_items(0, 0, 1)).astype(np.int64)
        assert torch.equal(first["input_ids"], torch.from_numpy(want[:, :-1]))
        for _ in range(4):  # later steps reuse every slot, the first one's included
            next(it)
        assert first.released
        with pytest.raises(StaleBatchError, match="step 0"):
            first[field]
        with pytest.raises(StaleBatchError):
            list(first.items())
        assert "released" in repr(first)
        # The copy taken in time is the batch's, whatever ran since.
        assert not kept.released and kept.step == 0
        assert torch.equal(kept["input_ids"], torch.from_numpy(want[:, :-1]))
        assert torch.equal(kept["tokens"].to(torch.int64), torch.from_numpy(want))


def test_byte_batches_follow_the_same_rule(tmp_path):
    ds, payloads = _bytes_dataset(tmp_path / "b", n=60)
    plan = build_plan([(ds, 1.0)], seed=2, global_batch_size=6, num_steps=8)
    with Loader(ds, plan, prefetch=1) as loader:
        held = list(loader)  # each batch is recycled as the next is asked for
        assert all(b.released for b in held)
        for b in held:
            with pytest.raises(StaleBatchError, match=f"step {b.step}"):
                b["data"]


def test_without_auto_release_a_batch_lives_until_release(tokens):
    ds, plan = tokens
    with Loader(ds, plan, prefetch=1, auto_release=False) as loader:
        it = iter(loader)
        a, b = next(it), next(it)
        want = _expected_rows([ds], plan, *plan.rank_items(0, 0, 1)).astype(np.int64)
        assert torch.equal(a["input_ids"], torch.from_numpy(want[:, :-1]))  # still valid: not released
        a.release()
        with pytest.raises(StaleBatchError):
            a["input_ids"]
        b.release()
        next(it)


def test_a_batch_outlives_its_abandoned_iterator_until_the_next_iteration(tokens):
    import gc

    ds, plan = tokens
    want = [_expected_rows([ds], plan, *plan.rank_items(s, 0, 1)).astype(np.int64) for s in range(2)]
    with Loader(ds, plan, prefetch=1) as loader:
        batch = next(iter(loader))  # the iterator is dropped at once: no next batch was asked for
        gc.collect()
        assert torch.equal(batch["input_ids"], torch.from_numpy(want[0][:, :-1]))
        second = next(iter(loader))  # a new iteration asks for the next batch
        assert second.step == 1 and torch.equal(second["input_ids"], torch.from_numpy(want[1][:, :-1]))
        with pytest.raises(StaleBatchError):
            batch["input_ids"]
    # Closing reads nothing more into the slot: the last batch stays as it was.
    assert torch.equal(second["input_ids"], torch.from_numpy(want[1][:, :-1]))


def test_unreleased_batches_stay_valid_after_iteration_and_close(tokens):
    ds, plan = tokens
    loader = Loader(ds, plan, prefetch=1, auto_release=False, end_step=2)
    held = list(loader)
    want = _expected_rows([ds], plan, *plan.rank_items(1, 0, 1)).astype(np.int64)
    assert torch.equal(held[1]["input_ids"], torch.from_numpy(want[:, :-1]))
    held[0].release()
    loader.close()
    assert torch.equal(held[1]["input_ids"], torch.from_numpy(want[:, :-1]))
    held[1].release()  # after close: no error, and the batch is stale
    assert held[1].released


def test_holding_every_slot_raises_instead_of_waiting(tokens):
    ds, plan = tokens
    with Loader(ds, plan, prefetch=1, auto_release=False) as loader:
        it = iter(loader)
        held = [next(it) for _ in range(loader._arena.slots)]
        with pytest.raises(ForesightError, match="holds all 3 arena slots"):
            next(it)
        for b in held:
            b.release()


def test_iterable_adapter_yields_owned_copies(tokens):
    from foresight.loader.torch_dataset import ForesightIterableDataset

    ds, plan = tokens
    got = list(ForesightIterableDataset([ds], plan, rank=0, world_size=1))
    for step, batch in enumerate(got):
        want = _expected_rows([ds], plan, *plan.rank_items(step, 0, 1)).astype(np.int64)
        assert torch.equal(batch["input_ids"], torch.from_numpy(want[:, :-1]))


def test_no_torch_warning_about_read_only_arrays(tmp_path):
    # torch warns once per process, so a fresh interpreter runs a loaded (memory-mapped, read-only) plan.
    script = textwrap.dedent(
        f"""
        import sys, warnings
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        warnings.simplefilter("error")
        from test_loader import _bytes_dataset, _token_dataset
        from foresight.loader import Loader
        from foresight.plan import build_plan, load_plan
        tok, _, _ = _token_dataset({str(tmp_path / "t")!r})
        byt, _ = _bytes_dataset({str(tmp_path / "b")!r}, n=40)
        for ds, kw in ((tok, dict(seq_len=16)), (byt, {{}})):
            path = build_plan([(ds, 1.0)], seed=1, global_batch_size=4, num_steps=3, **kw).save(
                {str(tmp_path)!r} + "/plan-" + str(id(ds)))
            with Loader(load_plan(path), datasets=ds) as loader:
                for batch in loader:
                    pass
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "not writable" not in done.stderr


def test_every_stats_field_is_documented_and_printed():
    doc = LoaderStats.__doc__
    names = [f for f in LoaderStats.__dataclass_fields__ if not f.startswith("_")] + ["amplification"]
    missing = [n for n in names if f"\n        {n}:" not in doc and f"\n        {n} (" not in doc]
    assert not missing
    assert {f"{s}_s" for s in STAGES} <= set(LoaderStats.__dataclass_fields__)
    assert "slot_wait=" in str(LoaderStats())


def test_slot_wait_is_reported_apart_from_coalescing(tokens):
    ds, plan = tokens
    with Loader(ds, plan, prefetch=1) as loader:
        for _ in loader:
            pass
        s = loader.stats.as_dict()
    assert s["slot_wait_s"] > 0 and s["coalesce_s"] > 0 and s["verify_s"] == 0
