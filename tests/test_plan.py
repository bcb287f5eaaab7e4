"""The plan builder: agreement with the numpy oracle, packing, mixtures, shuffles, rank view, bad inputs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from foresight.errors import PlanError
from foresight.plan import ArraySource, build_plan
from foresight.testing.plan_reference import reference_arrays
from foresight.plan.shuffle import epoch_order
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ARRAYS = ("item_ptr", "piece_dataset", "piece_sample", "piece_offset", "piece_length")


def token_sources(seed: int = 0, sizes=(5000, 300, 40)) -> list[ArraySource]:
    rng = np.random.default_rng(seed)
    # Some empty documents, some longer than a sequence.
    return [ArraySource(rng.integers(0, 90, n) * (rng.random(n) > 0.1), tokens=True, fingerprint=f"t{i}")
            for i, n in enumerate(sizes)]


def sample_sources(seed: int = 0, sizes=(5000, 300, 40)) -> list[ArraySource]:
    rng = np.random.default_rng(seed)
    return [ArraySource(rng.integers(0, 10_000, n), tokens=False, fingerprint=f"s{i}") for i, n in enumerate(sizes)]


@pytest.mark.parametrize("kind", ["tokens", "samples"])
@pytest.mark.parametrize("shuffle,block_size", [("global", None), ("block", 16), ("block", 1)])
def test_matches_numpy_reference(kind, shuffle, block_size):
    srcs = token_sources() if kind == "tokens" else sample_sources()
    # 70_000 samples in the first source: exercises the multi-bucket global shuffle too.
    big = ArraySource(np.random.default_rng(9).integers(1, 30, 70_000), tokens=kind == "tokens")
    srcs = [big] + srcs
    weights = [2.0, 1.0, 0.5, 0.25]
    seq_len = 32 if kind == "tokens" else None
    plan = build_plan(list(zip(srcs, weights)), seed=11, global_batch_size=16, seq_len=seq_len,
                      num_steps=700, shuffle=shuffle, block_size=block_size)
    sizes = [s.token_counts() if kind == "tokens" else s.sample_bytes() for s in srcs]
    ref = reference_arrays(sizes, weights=weights, kind=kind, seed=11, num_items=700 * 16, seq_len=seq_len,
                           shuffle=shuffle, block_size=block_size)
    for name in ARRAYS:
        np.testing.assert_array_equal(plan.arrays[name], ref[name], err_msg=name)
        assert plan.arrays[name].dtype == ref[name].dtype or name == "piece_dataset"


def _doc_tokens(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Give every token of every document a unique value: (flat values, start of each document)."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.arange(int(counts.sum()), dtype=np.int64), starts


@pytest.mark.parametrize("shuffle,block_size", [("global", None), ("block", 8)])
def test_packing_is_the_shuffled_token_stream(shuffle, block_size):
    srcs = token_sources(3)
    seq_len = 50
    plan = build_plan([(s, w) for s, w in zip(srcs, [1, 1, 1])], seed=5, global_batch_size=8,
                      seq_len=seq_len, epochs=2.5, shuffle=shuffle, block_size=block_size)
    items_of = [np.flatnonzero(plan.piece_dataset[plan.item_ptr[:-1]] == d) for d in range(len(srcs))]
    for d, src in enumerate(srcs):
        counts = src.token_counts()
        values, starts = _doc_tokens(counts)
        epochs = plan.summary["datasets"][d]["epochs_started"]
        order = np.concatenate([epoch_order(src.num_samples, seed=5, dataset_index=d, epoch=e, shuffle=shuffle,
                                            block_size=block_size) for e in range(epochs)])
        stream = np.concatenate([values[starts[s] : starts[s] + counts[s]] for s in order])
        covered = np.zeros(len(values), dtype=bool)
        for j, item in enumerate(items_of[d]):
            p = plan.pieces(int(item), int(item) + 1)
            got = np.concatenate([values[starts[s] + o : starts[s] + o + n]
                                  for s, o, n in zip(p.sample, p.offset, p.length)])
            np.testing.assert_array_equal(got, stream[j * seq_len : j * seq_len + seq_len + 1])
            assert (p.dataset == d).all() and (p.length > 0).all()
            for s, o, n in zip(p.sample, p.offset, p.length):
                covered[starts[s] + o : starts[s] + o + n] = True
        if plan.summary["datasets"][d]["epochs_covered"] >= 1:
            assert covered.all(), f"dataset {d}: some tokens never appear"


def test_token_sequences_overlap_by_one_like_megatron():
    src = ArraySource(np.array([5, 3, 7, 2]), tokens=True)
    plan = build_plan([(src, 1)], seed=0, global_batch_size=1, seq_len=3, num_steps=5)
    assert (np.add.reduceat(plan.piece_length, plan.item_ptr[:-1]) == 4).all()
    # Item j starts at token j*3 of the stream: a piece offset moves by 3 per item within one document.
    values, starts = _doc_tokens(src.token_counts())
    flat = [values[starts[s] + o : starts[s] + o + n] for s, o, n in
            zip(plan.piece_sample, plan.piece_offset, plan.piece_length)]
    seqs = np.split(np.concatenate(flat), np.cumsum(np.full(5, 4))[:-1])
    for a, b in itertools.pairwise(seqs):
        assert a[-1] == b[0]


@pytest.mark.parametrize("shuffle,block_size", [("global", None), ("block", 10)])
def test_sample_plans_visit_every_sample_once_per_epoch(shuffle, block_size):
    src = ArraySource(np.arange(100, 1100), tokens=False)
    plan = build_plan([(src, 1.0)], seed=2, global_batch_size=10, epochs=3, shuffle=shuffle, block_size=block_size)
    assert plan.kind == "samples" and plan.num_items == 3000
    np.testing.assert_array_equal(plan.item_ptr, np.arange(3001))
    for e in range(3):
        assert sorted(plan.piece_sample[e * 1000 : (e + 1) * 1000]) == list(range(1000))
    np.testing.assert_array_equal(plan.piece_length, plan.piece_sample + 100)
    assert not plan.piece_offset.any()
    assert not np.array_equal(plan.piece_sample[:1000], plan.piece_sample[1000:2000]), "epochs reshuffle"


def test_mixture_follows_the_weights_at_every_prefix():
    srcs = sample_sources(1, sizes=(50, 700, 3000))
    weights = np.array([5.0, 3.0, 2.0])
    plan = build_plan(list(zip(srcs, weights)), seed=1, global_batch_size=10, num_steps=3000)
    choice = plan.piece_dataset.astype(np.int64)
    onehot = np.zeros((len(choice), 3), dtype=np.int64)
    onehot[np.arange(len(choice)), choice] = 1
    seen = np.cumsum(onehot, axis=0)
    expected = np.outer(np.arange(1, len(choice) + 1), weights / weights.sum())
    assert np.abs(seen - expected).max() <= 1.0 + 1e-9
    shares = [d["share"] for d in plan.summary["datasets"]]
    np.testing.assert_allclose(shares, weights / weights.sum(), atol=1e-4)
    # The 50-sample dataset cycles through many reshuffled epochs, each a permutation.
    small = plan.piece_sample[choice == 0]
    for e in range(len(small) // 50):
        assert sorted(small[e * 50 : (e + 1) * 50]) == list(range(50))


def test_block_shuffle_keeps_a_step_close_on_disk():
    n, block, batch = 100_000, 64, 64
    src = ArraySource(np.full(n, 4096), tokens=False)
    spans = {}
    for shuffle, bs in [("global", None), ("block", block)]:
        plan = build_plan([(src, 1)], seed=3, global_batch_size=batch, num_steps=200, shuffle=shuffle, block_size=bs)
        blocks_per_step = [len(np.unique(plan.piece_sample[s * batch : (s + 1) * batch] // block)) for s in range(200)]
        spans[shuffle] = max(blocks_per_step)
        if shuffle == "block":
            # Whole blocks, in a shuffled order, each block's samples shuffled inside it.
            runs = plan.piece_sample[: (n // block) * block].reshape(-1, block)
            assert (runs // block == (runs[:, :1] // block)).all()
            assert not (np.diff(plan.piece_sample[:block]) == 1).all()
            assert not (np.diff(runs[:, 0] // block) == 1).all()
    assert spans["block"] <= 2
    assert spans["global"] >= 50


def test_same_inputs_same_plan_other_seed_other_plan():
    srcs = token_sources(4)
    kw = {"global_batch_size": 8, "seq_len": 20, "num_steps": 50}
    a = build_plan([(s, 1) for s in srcs], seed=7, **kw)
    b = build_plan([(s, 1) for s in srcs], seed=7, **kw)
    c = build_plan([(s, 1) for s in srcs], seed=8, **kw)
    assert a.digest == b.digest and a.digest.startswith("sha256:")
    for name in ARRAYS:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])
    assert c.digest != a.digest and not np.array_equal(a.piece_sample, c.piece_sample)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_elastic_resume_continues_the_global_sequence(data):
    batch = 24
    plan = build_plan([(s, w) for s, w in zip(token_sources(5), [3, 2, 1])], seed=9, global_batch_size=batch,
                      seq_len=16, num_steps=30)
    sizes = [w for w in range(1, batch + 1) if batch % w == 0]
    # A run that changes world size at some resume points.
    points = sorted(data.draw(st.sets(st.integers(1, plan.num_steps - 1), max_size=3)))
    worlds = [data.draw(st.sampled_from(sizes)) for _ in range(len(points) + 1)]
    bounds = [0, *points, plan.num_steps]
    seen_items = []
    for (lo, hi), w in zip(itertools.pairwise(bounds), worlds):
        for step in range(lo, hi):
            ranges = [plan.rank_items(step, r, w) for r in range(w)]
            assert ranges[0][0] == step * batch and ranges[-1][1] == (step + 1) * batch
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            assert (ranges[0][0], ranges[-1][1]) == plan.step_items(step)
            for start, stop in ranges:
                p = plan.pieces(start, stop)
                g = plan.pieces(*plan.step_items(step))
                off = int(g.item_ptr[start - step * batch])
                np.testing.assert_array_equal(p.sample, g.sample[off : off + len(p.sample)])
                seen_items.extend(range(start, stop))
    assert seen_items == list(range(plan.num_items))


def test_pieces_are_zero_copy_views():
    plan = build_plan([(token_sources()[0], 1)], seed=0, global_batch_size=4, seq_len=64, num_steps=10)
    p = plan.pieces(*plan.rank_items(3, 1, 2))
    assert np.shares_memory(p.sample, plan.piece_sample) and np.shares_memory(p.length, plan.piece_length)
    assert p.item_ptr[0] == 0 and len(p.item_ptr) == 3
    step = plan.step_dict(3, rank=1, world_size=2)
    assert [i["item"] for i in step["items"]] == [14, 15]
    assert sum(piece["length"] for piece in step["items"][0]["pieces"]) == 65


def test_rank_view_errors():
    plan = build_plan([(sample_sources()[0], 1)], seed=0, global_batch_size=12, num_steps=4)
    with pytest.raises(PlanError, match="divisible"):
        plan.rank_items(0, 0, 5)
    with pytest.raises(PlanError, match="rank"):
        plan.rank_items(0, 4, 4)
    with pytest.raises(PlanError, match="step"):
        plan.rank_items(4, 0, 4)
    with pytest.raises(PlanError, match="step"):
        plan.step_items(-1)
    with pytest.raises(PlanError, match="world_size"):
        plan.rank_items(0, 0, 0)
    with pytest.raises(PlanError):
        plan.pieces(5, 100)


TOK = ArraySource(np.array([10, 20, 30]), tokens=True)
SMP = ArraySource(np.array([10, 20, 30]), tokens=False)


@pytest.mark.parametrize("sources,kw,message", [
    ([], {}, "non-empty"),
    ("abc", {}, "non-empty"),
    ([(TOK,)], {}, "pair"),
    ([(TOK, 0.0)], {}, "positive"),
    ([(TOK, float("nan"))], {}, "positive"),
    ([(TOK, -1)], {}, "positive"),
    ([(object(), 1)], {}, "not a dataset"),
    ([(TOK, 1), (SMP, 1)], {}, "mix"),
    ([(TOK, 1)], {"seq_len": None}, "seq_len"),
    ([(TOK, 1)], {"seq_len": 0}, "seq_len"),
    ([(SMP, 1)], {"seq_len": 8}, "only for token data"),
    ([(TOK, 1)], {"global_batch_size": 0}, "global_batch_size"),
    ([(TOK, 1)], {"global_batch_size": 2.5}, "global_batch_size"),
    ([(TOK, 1)], {"seed": -1}, "seed"),
    ([(TOK, 1)], {"num_steps": None}, "exactly one"),
    ([(TOK, 1)], {"epochs": 1}, "exactly one"),
    ([(TOK, 1)], {"num_steps": 0}, "num_steps"),
    ([(TOK, 1)], {"num_steps": None, "epochs": 0.001}, "less than one step"),
    ([(TOK, 1)], {"num_steps": None, "epochs": float("inf")}, "epochs"),
    ([(TOK, 1)], {"shuffle": "local"}, "shuffle"),
    ([(TOK, 1)], {"shuffle": "block"}, "block_size"),
    ([(TOK, 1)], {"block_size": 4}, "only for shuffle='block'"),
    ([(ArraySource(np.array([0, 0]), tokens=True), 1)], {}, "no tokens"),
    ([(ArraySource(np.array([], dtype=np.int64), tokens=False), 1)], {"seq_len": None}, "at least one sample"),
])
def test_bad_inputs_raise_plan_error(sources, kw, message):
    args = {"seed": 0, "global_batch_size": 2, "seq_len": 4, "num_steps": 3}
    args.update(kw)
    with pytest.raises(PlanError, match=message):
        build_plan(sources, **args)


class _BadSizes(ArraySource):
    def __init__(self, sizes, reported):
        super().__init__(sizes, tokens=True)
        self._reported = reported

    def token_counts(self):
        return self._reported


@pytest.mark.parametrize("reported,message", [
    (np.array([1, 2]), "one entry per sample"),
    (np.array([1.0, 2.0, 3.0]), "integer array"),
    (np.array([4, -1, 3]), "negative"),
])
def test_bad_dataset_sizes(reported, message):
    with pytest.raises(PlanError, match=message):
        build_plan([(_BadSizes(np.array([1, 2, 3]), reported), 1)], seed=0, global_batch_size=1, seq_len=2,
                   num_steps=1)


def test_epochs_and_summary():
    src = ArraySource(np.full(100, 11), tokens=True)  # 1100 tokens: (1100 - 1) // 10 = 109 sequences per epoch
    plan = build_plan([(src, 1)], seed=0, global_batch_size=4, seq_len=10, epochs=2)
    assert plan.num_steps == 218 // 4 and plan.num_items == plan.num_steps * 4
    assert plan.summary["num_pieces"] == plan.num_pieces == plan.item_ptr[-1]
    assert plan.summary["datasets"][0]["epochs_started"] == 2
    assert plan.inputs["epochs"] == 2.0 and plan.inputs["num_steps"] is None


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=30), min_size=1, max_size=3),
    weights=st.lists(st.floats(0.05, 5.0), min_size=3, max_size=3),
    kind=st.sampled_from(["tokens", "samples"]),
    seq_len=st.integers(1, 50),
    batch=st.integers(1, 6),
    steps=st.integers(1, 20),
    seed=st.integers(0, 2**64 - 1),
    block=st.one_of(st.none(), st.integers(1, 8)),
)
def test_random_inputs_match_the_reference(sizes, weights, kind, seq_len, batch, steps, seed, block):
    arrays = [np.array(s, dtype=np.int64) for s in sizes]
    if kind == "tokens":
        arrays = [a if a.sum() else a + 1 for a in arrays]
    srcs = [ArraySource(a, tokens=kind == "tokens") for a in arrays]
    shuffle = "global" if block is None else "block"
    plan = build_plan(list(zip(srcs, weights)), seed=seed, global_batch_size=batch,
                      seq_len=seq_len if kind == "tokens" else None, num_steps=steps, shuffle=shuffle, block_size=block)
    ref = reference_arrays(arrays, weights=weights[: len(arrays)], kind=kind, seed=seed, num_items=batch * steps,
                           seq_len=seq_len if kind == "tokens" else None, shuffle=shuffle, block_size=block)
    for name in ARRAYS:
        np.testing.assert_array_equal(plan.arrays[name], ref[name], err_msg=name)
    if kind == "tokens":
        assert (np.add.reduceat(plan.piece_length, plan.item_ptr[:-1]) == seq_len + 1).all()
