"""The compact plan's Packer: cursors kept from call to call give the same pieces as placing them from scratch
(``pack_range``) and as the materialized reference (tests/compact_reference.py), on any sequence of windows; the
batched slot permutation equals the one-by-one bijection; consecutive steps continue instead of locating again."""
from __future__ import annotations

import threading
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compact_reference import draw_corpus, reference_compact
from foresight import _compact_kernels
from foresight.errors import PlanError
from foresight.plan import ArraySource, build_plan
from foresight.plan import compact

NAMES = ("item_ptr", "piece_dataset", "piece_sample", "piece_offset", "piece_length")


def _plan(sizes, weights, *, seed, batch, seq_len, steps, block_size, group=64):
    with mock.patch.object(compact, "DEFAULT_BLOCK_GROUP", group):
        return build_plan([(ArraySource(np.asarray(s), tokens=True), w) for s, w in zip(sizes, weights)], seed=seed,
                          global_batch_size=batch, seq_len=seq_len, num_steps=steps, compact=True,
                          block_size=block_size)


def _fresh(plan, start, stop):
    """The pieces of ``[start, stop)`` with every cursor placed from scratch (``pack_range``, twice: count, write)."""
    args = plan._args()[:-1]
    ptr = plan._count(start, stop)
    total = int(ptr[-1])
    cols = (np.empty(total, np.uint16), np.empty(total, np.int64), np.empty(total, np.int64),
            np.empty(total, np.int64))
    assert _compact_kernels.pack_range(start, stop, plan.seq_len, *args, ptr, *cols, np.zeros(4, np.int64)) == total
    return (ptr, *cols)


def _assert_window(got, ref, start, stop):
    lo, hi = ref["item_ptr"][start], ref["item_ptr"][stop]
    np.testing.assert_array_equal(got[0], ref["item_ptr"][start : stop + 1] - lo, err_msg="item_ptr")
    for name, arr in zip(NAMES[1:], got[1:]):
        np.testing.assert_array_equal(arr, ref[name][lo:hi], err_msg=name)


@settings(max_examples=60, deadline=None)
@given(m=st.one_of(st.integers(1, 1100), st.integers(1, 2**62)), key=st.integers(0, 2**64 - 1), data=st.data())
def test_permute_span_equals_the_bijection_one_by_one(m, key, data):
    lo = data.draw(st.integers(0, m))
    hi = data.draw(st.integers(lo, min(m, lo + 1500)))
    want = _compact_kernels.permute_many(np.arange(lo, hi, dtype=np.uint64), m, key)
    np.testing.assert_array_equal(_compact_kernels.permute_span_many(lo, hi, m, key), want)
    if m <= 1100 and lo == 0 and hi == m:  # the whole domain: a permutation
        assert sorted(want.tolist()) == list(range(m))


@st.composite
def windows(draw, num_items, batch):
    """Windows as a loader, a rank, a resume or an inspector asks for them: consecutive steps, one rank's shares,
    random jumps forward and back, empty and whole ranges."""
    out = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["steps", "shares", "jump", "empty"]))
        if kind == "steps":
            first = draw(st.integers(0, num_items // batch - 1))
            count = draw(st.integers(1, 6))
            out += [(s * batch, (s + 1) * batch) for s in range(first, min(first + count, num_items // batch))]
        elif kind == "shares":
            world = draw(st.sampled_from([w for w in (2, 3, 4, 8) if batch % w == 0] or [1]))
            rank = draw(st.integers(0, world - 1))
            n = batch // world
            first = draw(st.integers(0, num_items // batch - 1))
            out += [(s * batch + rank * n, s * batch + (rank + 1) * n)
                    for s in range(first, min(first + 5, num_items // batch))]
        elif kind == "jump":
            start = draw(st.integers(0, num_items))
            out.append((start, draw(st.integers(start, num_items))))
        else:
            at = draw(st.integers(0, num_items))
            out.append((at, at))
    return out


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_sources=st.integers(1, 3),
    block_size=st.one_of(st.none(), st.integers(1, 40)),
    seq_len=st.integers(1, 40),
    seed=st.integers(0, 2**64 - 1),
    batch=st.sampled_from([1, 2, 4, 6, 8]),
    steps=st.integers(1, 30),
    group=st.sampled_from([1, 3, 16, 1000]),
)
def test_packer_equals_fresh_packing_and_the_reference_on_any_windows(data, num_sources, block_size, seq_len, seed,
                                                                      batch, steps, group):
    sizes, weights = draw_corpus(data, num_sources)
    plan = _plan(sizes, weights, seed=seed, batch=batch, seq_len=seq_len, steps=steps, block_size=block_size,
                 group=group)
    ref = reference_compact(sizes, weights, seed=seed, seq_len=seq_len, num_items=plan.num_items,
                            block_size=block_size, block_group=group)
    packer = _compact_kernels.Packer(plan.seq_len, *plan._args()[:-1])  # one packer for the whole sequence
    for start, stop in data.draw(windows(plan.num_items, batch)):
        got = packer.pack(start, stop)
        _assert_window(got, ref, start, stop)
        for a, b in zip(got, _fresh(plan, start, stop)):
            np.testing.assert_array_equal(a, b)


def test_consecutive_steps_continue_and_shares_walk_forward():
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 60, 4000)
    plan = _plan([sizes], [1.0], seed=4, batch=8, seq_len=32, steps=300, block_size=64)
    ref = reference_compact([sizes], [1.0], seed=4, seq_len=32, num_items=plan.num_items, block_size=64,
                            block_group=64)
    packer = _compact_kernels.Packer(plan.seq_len, *plan._args()[:-1])
    assert plan.num_items >= 2048  # a window this long is packed with the GIL released (RELEASE_GIL_ITEMS)
    _assert_window(packer.pack(0, plan.num_items), ref, 0, plan.num_items)  # and leaves room for any window below
    packer.locates = 0
    for step in range(plan.num_steps):  # a loader's pass: placed once, then each step continues the last
        _assert_window(packer.pack(*plan.step_items(step)), ref, *plan.step_items(step))
    assert packer.locates == 1
    # a rank's shares: the next one is 6 items (about 6 documents) on, mostly in the same block: walked to
    packer.locates = 0
    for step in range(plan.num_steps):
        window = plan.rank_items(step, 1, 4)
        _assert_window(packer.pack(*window), ref, *window)
    blocks = len(np.unique(ref["piece_sample"] // 64))  # tiles of 64 blocks of 64 documents: ~ blocks entered
    assert packer.locates < blocks < plan.num_steps
    # a jump back is located from scratch, and correct
    before = packer.locates
    _assert_window(packer.pack(0, 8), ref, 0, 8)
    assert packer.locates == before + 1


def test_plans_keep_one_packer_per_thread():
    rng = np.random.default_rng(8)
    sizes = [rng.integers(0, 50, 500), rng.integers(1, 30, 300)]
    plan = _plan(sizes, [0.6, 0.4], seed=2, batch=4, seq_len=24, steps=200, block_size=8)
    ref = reference_compact(sizes, [0.6, 0.4], seed=2, seq_len=24, num_items=plan.num_items, block_size=8,
                            block_group=64)
    errors = []

    def walk(rank):
        try:
            for step in range(plan.num_steps):
                window = plan.rank_items(step, rank, 2)
                _assert_window(plan.pieces(*window), ref, *window)
        except BaseException as e:  # surfaced by the main thread below
            errors.append(e)

    threads = [threading.Thread(target=walk, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert plan._packer() is plan._packer()  # this thread's, kept
    # attach() gives new kernel arguments: a new packer over them
    old = plan._packer()
    plan.attach([ArraySource(s, tokens=True) for s in sizes])
    assert plan._packer() is not old
    _assert_window(plan.pieces(40, 60), ref, 40, 60)


def test_an_error_leaves_no_cursor_behind():
    sizes = np.arange(1, 200, dtype=np.int64)
    src = ArraySource(sizes, tokens=True)
    plan = build_plan([(src, 1.0)], seed=3, global_batch_size=4, seq_len=32, num_steps=40, compact=True,
                      block_size=16)
    good = plan.pieces(0, plan.num_items)
    counts = src.token_counts()
    assert np.shares_memory(counts, plan._args()[-1][0])  # the kernel reads the counts in place
    saved = counts.copy()
    # wherever the walk stops on the error, the next window (whichever item it starts at) is placed from scratch,
    # not continued from the cursor the error left mid-walk
    for start in range(12, plan.num_items):
        plan.pieces(8, 12)  # this thread's cursor sits at item 12
        counts[:] = 1  # the index rewritten under the plan
        with pytest.raises(PlanError, match="do not add up|ran past") as err:
            plan.pieces(12, plan.num_items)
        assert err.value.context["dataset"] == 0
        counts[:] = saved
        got = plan.pieces(start, start + 1)
        lo, hi = good.item_ptr[start], good.item_ptr[start + 1]
        np.testing.assert_array_equal(got.sample, good.sample[lo:hi])
        np.testing.assert_array_equal(got.offset, good.offset[lo:hi])
    packer = plan._packer()
    with pytest.raises(ValueError, match="start <= stop"):
        packer.pack(5, 4)
