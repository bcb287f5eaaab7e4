"""The loader, resume and the DataLoader adapter over a compact plan: the same batches as from its
materialized form (tests/compact_reference.py), over a foresight dataset blended with a Megatron-read one."""
from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from compact_reference import reference_compact
from foresight.format import DatasetWriter, open_dataset, write_megatron_dataset
from foresight.loader import ForesightIterableDataset, Loader
from foresight.plan import CompactPlan, Plan, build_plan, load_plan

STEPS, BATCH, SEQ = 12, 4, 24


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("compact")
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 120, size=150)
    with DatasetWriter(str(root / "web"), token_dtype="uint16") as w:
        w.add_many(rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
    docs = [rng.integers(0, 60000, int(k), dtype=np.uint16) for k in rng.integers(1, 60, size=70)]
    write_megatron_dataset(str(root / "code"), docs, np.uint16)
    web, code = open_dataset(str(root / "web")), open_dataset(str(root / "code.idx"))
    plan = build_plan([(web, 0.6), (code, 0.4)], seed=9, global_batch_size=BATCH, seq_len=SEQ, num_steps=STEPS,
                      compact=True, block_size=8)
    plan.save(str(root / "plan"))
    ref = reference_compact([web.token_counts(), code.token_counts()], [0.6, 0.4], seed=9, seq_len=SEQ,
                            num_items=STEPS * BATCH, block_size=8)
    materialized = Plan(inputs=plan.inputs, summary=dict(plan.summary, num_pieces=len(ref["piece_sample"])),
                        arrays=ref)
    return root, [web, code], plan, materialized


def _batches(loader, limit=None):
    out = []
    for b in loader:
        out.append((b.step, b["tokens"].clone()))
        if limit is not None and len(out) == limit:
            break
    return out


def _same(a, b):
    return len(a) == len(b) and all(s == t and torch.equal(x, y) for (s, x), (t, y) in zip(a, b))


def test_loader_yields_the_materialized_batches(corpus):
    root, datasets, plan, materialized = corpus
    with Loader(datasets, materialized) as loader:
        want = _batches(loader)
    assert len(want) == STEPS
    with Loader(datasets, plan) as loader:
        assert _same(_batches(loader), want)
    # the saved plan alone: its datasets (one of them Megatron-read) found from sources.json
    with Loader(str(root / "plan")) as loader:
        assert isinstance(loader.plan, CompactPlan)
        assert _same(_batches(loader), want)
    # the rows are the documents' real tokens
    first = plan.pieces(0, 1)
    row = np.concatenate([np.frombuffer(datasets[d].read(int(s)), np.uint16)[o : o + n]
                          for d, s, o, n in zip(first.dataset, first.sample, first.offset, first.length)])
    assert np.array_equal(want[0][1][0].numpy().astype(np.int64), row.astype(np.int64))


def test_any_world_size_and_exact_resume(corpus):
    root, datasets, plan, _ = corpus
    with Loader(datasets, plan) as loader:
        full = _batches(loader)
    for world in (2, 4):
        shares = []
        for rank in range(world):
            with Loader(datasets, load_plan(str(root / "plan")), rank=rank, world_size=world) as loader:
                shares.append(_batches(loader))
        for step in range(STEPS):
            assert torch.equal(torch.cat([s[step][1] for s in shares]), full[step][1])
    # resume: a state saved after k steps continues with exactly the same batches, at another world size too
    with Loader(datasets, plan) as loader:
        head = _batches(loader, limit=5)
        state = loader.state_dict()
    with Loader(datasets, load_plan(str(root / "plan"))) as loader:
        loader.load_state_dict(state)
        tail = _batches(loader)
    assert _same(head + tail, full)
    halves = []
    for rank in range(2):
        with Loader(datasets, plan, rank=rank, world_size=2) as loader:
            loader.load_state_dict(state)
            halves.append(_batches(loader))
    assert [s for s, _ in halves[0]] == list(range(5, STEPS))
    for i, step in enumerate(range(5, STEPS)):
        assert torch.equal(torch.cat([halves[0][i][1], halves[1][i][1]]), full[step][1])


def test_dataloader_adapter_over_a_compact_plan(corpus):
    root, datasets, plan, materialized = corpus
    with Loader(datasets, materialized) as loader:
        want = [t for _, t in _batches(loader)]
    adapter = ForesightIterableDataset(str(root / "plan"), rank=0, world_size=1, prefetch=2)
    assert len(adapter) == STEPS
    got = [b["tokens"].clone() for b in torch.utils.data.DataLoader(adapter, batch_size=None)]
    assert len(got) == STEPS and all(torch.equal(a, b) for a, b in zip(got, want))


def test_verifying_loader_over_a_compact_plan(corpus):
    root, datasets, _, _ = corpus
    web = datasets[0]
    plan = build_plan([(web, 1.0)], seed=4, global_batch_size=BATCH, seq_len=SEQ, num_steps=6, compact=True)
    ref = reference_compact([web.token_counts()], [1.0], seed=4, seq_len=SEQ, num_items=6 * BATCH, block_size=None)
    materialized = Plan(inputs=plan.inputs, summary=dict(plan.summary, num_pieces=len(ref["piece_sample"])),
                        arrays=ref)
    with Loader([web], materialized) as loader:
        want = _batches(loader)
    with Loader([web], plan, verify=True) as loader:  # checksums of every sample a step reads
        assert _same(_batches(loader), want)


def test_a_billion_sequence_plan_opens_and_loads_in_small_memory(tmp_path):
    """A compact plan of 10^9 sequences (materialized: 8 GB of item_ptr alone) over a small Megatron corpus: the
    loader sizes its slots from the plan's bound and reads its first batches without walking the plan."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 60000, int(k), dtype=np.uint16) for k in rng.integers(1, 1000, size=2000)]
    write_megatron_dataset(str(tmp_path / "corpus"), docs, np.uint16)
    corpus = open_dataset(str(tmp_path / "corpus.idx"))
    batch, steps = 8, 125_000_000
    plan = build_plan([(corpus, 1.0)], seed=3, global_batch_size=batch, seq_len=32, num_steps=steps,
                      compact=True, block_size=500)
    assert plan.num_items == 10**9
    plan.save(str(tmp_path / "plan"))
    process = psutil.Process()
    before = process.memory_info().rss
    opened = load_plan(str(tmp_path / "plan"))
    with Loader([corpus], opened, world_size=2, rank=1) as loader:
        got = _batches(loader, limit=3)
    grown = process.memory_info().rss - before
    assert [s for s, _ in got] == [0, 1, 2]
    assert opened._prefix_cache["items"] == 0  # item_ptr never computed from item 0
    assert grown < 256 << 20, f"RSS grew by {grown >> 20} MiB"
    for step, rows in got:  # rank 1's half of each step: the plan's pieces, read from the corpus
        p = plan.pieces(*plan.rank_items(step, 1, 2))
        for i in range(batch // 2):
            a, b = int(p.item_ptr[i]), int(p.item_ptr[i + 1])
            row = np.concatenate([docs[int(s)][o : o + n] for s, o, n in zip(p.sample[a:b], p.offset[a:b],
                                                                          p.length[a:b])])
            assert np.array_equal(rows[i].numpy().astype(np.int64), row.astype(np.int64))


def test_piece_bound_covers_the_materialized_count(corpus):
    _, _, plan, materialized = corpus
    for world in (1, 2, 4):
        exact = materialized.max_rank_pieces(STEPS, world)
        ptr = np.asarray(materialized.item_ptr)
        per_rank = BATCH // world
        assert exact == int((ptr[per_rank::per_rank] - ptr[:-1:per_rank]).max())
        assert exact <= plan.max_rank_pieces(STEPS, world) <= per_rank * (SEQ + 1)
    assert np.array_equal(plan.leading_piece_lengths(10), np.asarray(materialized.piece_length[:10]))


@pytest.mark.parametrize("lengths,block_size,seq_len", [((200, 5000), 4, 64), ((1, 3), 8, 16), ((0, 40), 3, 24),
                                                        ((1, 2000), None, 512)])
def test_piece_bound_holds_and_tightens_with_long_documents(lengths, block_size, seq_len):
    from foresight.plan import ArraySource

    rng = np.random.default_rng(seq_len)
    sources = [(ArraySource(rng.integers(*lengths, size=300), tokens=True), 0.7),
               (ArraySource(rng.integers(1, 50, 90), tokens=True), 0.3)]
    batch, steps = 16, 30
    plan = build_plan(sources, seed=2, global_batch_size=batch, seq_len=seq_len, num_steps=steps, compact=True,
                      block_size=block_size)
    ptr = np.asarray(plan.pieces(0, plan.num_items).item_ptr)
    for world in (1, 4, 16):
        n = batch // world
        exact = int((ptr[n::n] - ptr[:-1:n]).max())
        assert exact <= plan.max_rank_pieces(steps, world) <= n * (seq_len + 1)
    if lengths[0] >= 200:  # long documents: far fewer pieces than tokens
        assert plan.max_rank_pieces(steps, 1) < batch * (seq_len + 1) // 4
