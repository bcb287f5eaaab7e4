"""Loader(verify=True) checks every sample a step uses, token plans included, or refuses at construction."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from foresight.errors import ChecksumError
from foresight.format import DatasetWriter, open_dataset, write_megatron_dataset
from foresight.loader import Loader
from foresight.plan import build_plan
from test_loader import BACKENDS, _expected_rows, _token_dataset


def _flip_byte(ds, sample: int, at: int) -> int:
    """Flip one byte of ``sample`` (``at`` bytes from its start; negative counts from its end); return its offset."""
    ext = ds.lookup(np.array([sample]))
    offset = int(ext.offset[0]) + (at if at >= 0 else int(ext.length[0]) + at)
    with open(ds.shard_paths[int(ext.shard[0])], "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    return offset


@pytest.mark.parametrize("backend", BACKENDS)
def test_flipped_byte_at_the_end_of_a_token_sample_is_caught(tmp_path, backend):
    ds, tokens, lengths = _token_dataset(tmp_path / "t", docs=120, seed=5)
    plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=4, seq_len=24, num_steps=6)
    # A sample whose last token step 2 uses: flip the last byte of that token.
    start, stop = plan.rank_items(2, 0, 1)
    pieces = plan.pieces(start, stop)
    ends = np.asarray(pieces.offset) + np.asarray(pieces.length)
    full = np.flatnonzero(ends == lengths[np.asarray(pieces.sample)])
    victim = int(pieces.sample[full[0]])
    _flip_byte(ds, victim, -1)
    with Loader(ds, plan, backend=backend) as loader:  # without verify the corrupt token reaches the rows
        rows = {b.step: b["tokens"].numpy().astype(np.int64) for b in loader if b.step == 2}[2]
    assert not np.array_equal(rows, _expected_rows_from(tokens, lengths, plan, start, stop))
    with Loader(ds, plan, backend=backend, verify=True) as loader:
        with pytest.raises(ChecksumError) as info:
            for _ in loader:
                pass
    message = str(info.value)
    sample_start = int(ds.lookup(np.array([victim])).offset[0])
    assert f"sample={victim}" in message and "shard-00000.bin" in message and f"offset={sample_start}" in message


def _expected_rows_from(tokens, lengths, plan, start, stop) -> np.ndarray:
    """Rows from the pristine token arrays (the dataset on disk may be corrupt)."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    pieces = plan.pieces(start, stop)
    flat = np.concatenate([tokens[starts[s] + o : starts[s] + o + n] for s, o, n in
                           zip(pieces.sample, pieces.offset, pieces.length)])
    return flat.reshape(stop - start, plan.seq_len + 1).astype(np.int64)


def test_corruption_outside_the_used_piece_is_caught_too(tmp_path):
    # The step uses only the head of a long document; the whole sample is read and checked all the same.
    ds, _, lengths = _token_dataset(tmp_path / "t", docs=60, seed=6)
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=2, seq_len=16, num_steps=1)
    pieces = plan.pieces(*plan.rank_items(0, 0, 1))
    partial = [(int(s), int(o + n)) for s, o, n in zip(pieces.sample, pieces.offset, pieces.length)
               if o + n < lengths[s]]
    assert partial, "the plan should cut at least one document"
    victim, used = partial[0]
    _flip_byte(ds, victim, -1)
    with Loader(ds, plan) as loader:
        list(loader)  # the flipped byte is in no row: nothing to see without verify
    with Loader(ds, plan, verify=True) as loader:
        with pytest.raises(ChecksumError, match=f"sample={victim}"):
            list(loader)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_gap", [-1, 0, 1 << 16])
def test_verified_token_batches_equal_the_unverified_ones(tmp_path, backend, max_gap):
    # Long documents cut across items and steps, a mixture of two dtypes: verify changes what is read, not rows.
    narrow, _, _ = _token_dataset(tmp_path / "n", docs=80, seed=7, dtype=np.uint16)
    wide, _, _ = _token_dataset(tmp_path / "w", docs=80, seed=8, dtype=np.uint32)
    plan = build_plan([(narrow, 0.5), (wide, 0.5)], seed=4, global_batch_size=6, seq_len=40, num_steps=8)
    with Loader([narrow, wide], plan, backend=backend, max_gap=max_gap, verify=True, prefetch=3) as loader:
        steps = 0
        for batch in loader:
            want = _expected_rows([narrow, wide], plan, *plan.rank_items(batch.step, 0, 1)).astype(np.int64)
            assert torch.equal(batch["input_ids"], torch.from_numpy(want[:, :-1]))
            assert torch.equal(batch["labels"], torch.from_numpy(want[:, 1:]))
            steps += 1
        assert steps == plan.num_steps
        s = loader.stats.as_dict()
        assert s["bytes_requested"] > s["samples"] * (plan.seq_len + 1) * 2  # whole samples, not just pieces


def test_slots_are_sized_for_whole_samples(tmp_path):
    # Documents of tens of thousands of tokens cut into rows of 33: a step needs a few rows but whole documents.
    rng = np.random.default_rng(2)
    lengths = rng.integers(20000, 40000, size=12)
    tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16)
    with DatasetWriter(str(tmp_path / "long"), token_dtype="uint16") as w:
        w.add_many(tokens, lengths, modality="tokens")
    ds = open_dataset(str(tmp_path / "long"))
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=4, seq_len=32, num_steps=20)
    with Loader(ds, plan, verify=True) as loader:
        for batch in loader:
            want = _expected_rows([ds], plan, *plan.rank_items(batch.step, 0, 1)).astype(np.int64)
            assert torch.equal(batch["input_ids"], torch.from_numpy(want[:, :-1]))
        s = loader.stats.as_dict()
    assert s["bytes_requested"] >= 20 * 20000 * 2  # each step read at least one whole document
    assert s["slot_overflows"] == 0  # and it fit the slot sized at start-up


def test_verify_without_checksums_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    write_megatron_dataset(tmp_path / "m", [rng.integers(0, 1000, 300) for _ in range(20)], np.uint16)
    ds = open_dataset(tmp_path / "m.idx")
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=2, seq_len=16, num_steps=2)
    with pytest.raises(ValueError, match=r"verify=True but dataset 0 \(\S*/m\) has no checksums"):
        Loader(ds, plan, verify=True)
    with Loader(ds, plan) as loader:  # without verify the same dataset loads
        assert len(list(loader)) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_that_fails_verify_gives_its_slot_back_and_counts_its_reads(tmp_path, backend):
    """A step whose checksum fails raises in the consumer, and its arena slot goes back (before: the failed
    step's slot stayed taken, so each retry of the iteration lost one and the loader then waited for a slot for
    good), and its reads' submit and wait times are in the stats like any step's (before: dropped with it)."""
    from test_loader import _bytes_dataset

    ds, _ = _bytes_dataset(tmp_path / "b", n=60)
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=10, num_steps=6)
    _flip_byte(ds, int(plan.pieces(*plan.rank_items(0, 0, 1)).sample[0]), 0)  # step 0 fails, every time
    with Loader(ds, plan, backend=backend, verify=True, prefetch=1) as loader:
        slots = loader._arena.slots
        for _ in range(slots + 1):  # each try fails at step 0 again
            with pytest.raises(ChecksumError):
                next(iter(loader))
            assert loader._thread is None  # the pipeline thread was joined: its ring is drained
            assert loader._arena.free_slots == slots
        assert loader.stats.io_wait_s > 0 and loader.stats.steps == 0
