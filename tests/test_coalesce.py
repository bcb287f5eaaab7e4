"""foresight.io.coalesce: every requested byte is delivered exactly, whatever the extents."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foresight.errors import FormatError
from foresight.io.coalesce import Transfers, coalesce

ALIGNS = (1, 8, 512, 4096)


@st.composite
def steps(draw):
    """Random files in memory and a step's extents over them (unsorted, overlapping, duplicated, empty)."""
    nfiles = draw(st.integers(1, 3))
    sizes = [draw(st.integers(0, 40_000)) for _ in range(nfiles)]
    extents = []
    for _ in range(draw(st.integers(0, 40))):
        f = draw(st.integers(0, nfiles - 1))
        off = draw(st.integers(0, sizes[f]))
        length = draw(st.integers(0, min(sizes[f] - off, draw(st.sampled_from([0, 16, 600, 5000, 40_000])))))
        extents.append((f, off, length))
    if extents and draw(st.booleans()):  # exact duplicates
        extents += draw(st.lists(st.sampled_from(extents), max_size=5))
    options = dict(
        max_gap=draw(st.sampled_from([0, 1, 100, 4096, 20_000])),
        max_transfer=draw(st.sampled_from([1, 512, 4096, 8192, 65_536, 1 << 30])),
        align=draw(st.sampled_from(ALIGNS)),
    )
    seed = draw(st.integers(0, 2**32 - 1))
    return sizes, extents, options, seed


def arrays(extents):
    ext = np.array(extents, dtype=np.int64).reshape(-1, 3)
    return ext[:, 0].astype(np.int32), ext[:, 1].copy(), ext[:, 2].copy()


def execute(tr: Transfers, files: list[bytes]) -> np.ndarray:
    """Do the transfers as a reader would, accepting short reads at end of file if they hold t_needed bytes."""
    region = np.full(tr.total_bytes, 0xA5, dtype=np.uint8)  # not zero: stale bytes must not pass as data
    for f, off, n, need, dest in zip(tr.t_file, tr.t_offset, tr.t_length, tr.t_needed, tr.t_dest):
        got = files[f][off : off + n]
        assert need <= len(got), "transfer needs bytes beyond the end of its file"
        region[dest : dest + len(got)] = np.frombuffer(got, dtype=np.uint8)
    return region


def union_bytes(extents) -> int:
    covered = set()
    for f, off, n in extents:
        covered.update((f, b) for b in range(off, off + n))
    return len(covered)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_every_requested_byte_is_delivered_exactly(step):
    sizes, extents, options, seed = step
    rng = np.random.default_rng(seed)
    files = [rng.bytes(n) for n in sizes]
    file, offset, length = arrays(extents)
    tr = coalesce(file, offset, length, **options)
    region = execute(tr, files)
    for i, (f, off, n) in enumerate(extents):
        view = tr.view(region, i)
        assert np.shares_memory(view, region) or n == 0
        assert view.tobytes() == files[f][off : off + n], f"extent {i} {(f, off, n)} got wrong bytes"
    # Same answer with the file sizes given (they only validate).
    again = coalesce(file, offset, length, file_sizes=np.array(sizes), **options)
    assert np.array_equal(again.t_offset, tr.t_offset) and np.array_equal(again.x_dest, tr.x_dest)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_transfer_shape_invariants(step):
    sizes, extents, options, _ = step
    a, m, g = options["align"], options["max_transfer"], options["max_gap"]
    file, offset, length = arrays(extents)
    tr = coalesce(file, offset, length, **options)
    nonzero = length > 0

    for arr in (tr.t_offset, tr.t_length, tr.t_dest):
        assert arr.dtype == np.int64 and np.all(arr % a == 0)
    assert tr.t_file.dtype == np.int32 and tr.x_dest.dtype == np.int64
    assert np.all(tr.t_length > 0) and np.all((0 < tr.t_needed) & (tr.t_needed <= tr.t_length))
    # Sorted by (file, offset), non-overlapping within a file.
    same_file = tr.t_file[1:] == tr.t_file[:-1]
    assert np.all(tr.t_file[1:] >= tr.t_file[:-1])
    assert np.all(tr.t_offset[1:][same_file] >= (tr.t_offset + tr.t_length)[:-1][same_file])
    # Back to back in the region, inside total_bytes.
    assert np.all(tr.t_dest[1:] >= (tr.t_dest + tr.t_length)[:-1])
    assert tr.total_bytes == (int(tr.t_dest[-1] + tr.t_length[-1]) if tr.io_count else 0)
    assert np.all(tr.x_dest + length <= tr.total_bytes)
    assert np.all(tr.x_dest[~nonzero] == 0)
    # Bounded size and count.
    rounded = ((offset + length + a - 1) // a * a - offset // a * a)[nonzero]
    assert np.all(tr.t_length <= max(m, int(rounded.max(initial=0))))
    assert tr.io_count <= int(nonzero.sum())
    # Stats.
    assert tr.requested_bytes == int(length.sum())
    assert tr.read_bytes == int(tr.t_length.sum())
    assert tr.stats()["io_count"] == tr.io_count
    if a == 1 and g == 0:
        assert tr.read_bytes == union_bytes(extents), "no extra bytes without gaps or alignment"


@settings(max_examples=100, deadline=None)
@given(steps(), st.randoms(use_true_random=False))
def test_input_order_does_not_matter(step, random):
    sizes, extents, options, _ = step
    shuffled = list(range(len(extents)))
    random.shuffle(shuffled)
    tr = coalesce(*arrays(extents), **options)
    tr2 = coalesce(*arrays([extents[i] for i in shuffled]), **options)
    for name in ("t_file", "t_offset", "t_length", "t_needed", "t_dest"):
        assert np.array_equal(getattr(tr, name), getattr(tr2, name)), name
    assert np.array_equal(tr.x_dest[shuffled], tr2.x_dest)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=50), st.sampled_from(ALIGNS))
def test_contiguous_sorted_extents_with_large_max_transfer_are_one_read(lengths, align):
    length = np.array(lengths, dtype=np.int64)
    offset = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    tr = coalesce(np.zeros(len(length), np.int32), offset, length, max_gap=0, max_transfer=1 << 30, align=align)
    assert tr.io_count == 1
    assert tr.t_needed[0] == length.sum()
    assert np.array_equal(tr.x_dest, offset)  # one transfer from offset 0: the region mirrors the file


def test_gap_and_max_transfer_decide_merging():
    file = np.zeros(3, np.int32)
    offset = np.array([0, 10_000, 50_000])
    length = np.array([4096, 4096, 4096])
    assert coalesce(file, offset, length, max_gap=0, max_transfer=1 << 20, align=4096).io_count == 3
    merged = coalesce(file, offset, length, max_gap=8192, max_transfer=1 << 20, align=4096)
    assert merged.t_offset.tolist() == [0, 49152] and merged.t_length.tolist() == [16384, 8192]
    assert merged.amplification == pytest.approx((16384 + 8192) / (3 * 4096))
    capped = coalesce(file, offset, length, max_gap=1 << 20, max_transfer=16384, align=4096)
    assert capped.t_length.tolist() == [16384, 8192]


def test_long_extent_is_its_own_transfer_and_shared_blocks_continue_it():
    # Extent 0 is longer than max_transfer; extent 1 starts in its last block and would grow it further.
    file = np.zeros(2, np.int32)
    offset = np.array([0, 20_000])
    length = np.array([20_100, 5_000])
    tr = coalesce(file, offset, length, max_gap=0, max_transfer=8192, align=4096)
    assert tr.t_offset.tolist() == [0, 20480] and tr.t_length.tolist() == [20480, 8192]
    assert tr.t_dest.tolist() == [0, 20480]  # the continuation follows in the region as in the file
    assert tr.x_dest.tolist() == [0, 20_000]


def test_needed_stops_at_the_last_requested_byte():
    tr = coalesce(np.zeros(1, np.int32), np.array([5000]), np.array([100]), align=4096)
    assert (tr.t_offset[0], tr.t_length[0], tr.t_needed[0]) == (4096, 4096, 1004)


def test_empty_and_all_zero_length_steps():
    tr = coalesce([], [], [])
    assert (tr.io_count, tr.total_bytes, tr.amplification, len(tr.x_dest)) == (0, 0, 1.0, 0)
    tr = coalesce([0, 1], [7, 9], [0, 0])
    assert tr.io_count == 0 and tr.x_dest.tolist() == [0, 0]


def test_accepts_any_integer_dtype_that_fits():
    tr = coalesce(np.array([0, 1], np.int64), np.array([0, 10], np.uint32), [5, 5], align=1)
    assert tr.t_file.tolist() == [0, 1] and tr.x_dest.tolist() == [0, 5]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([0, 0], [0, 1], [1]), {}, ValueError, "differ in length"),
        (([0], [0], [-3]), {}, ValueError, "extent 0 has negative length -3"),
        (([0, 0], [0, -1], [1, 1]), {}, ValueError, "extent 1 has negative offset -1"),
        (([-1], [0], [1]), {}, ValueError, "extent 0 has negative file index -1"),
        (([0], [2**62], [2**62]), {}, ValueError, "overflows"),
        (([2**31], [0], [1]), {}, ValueError, "outside int32"),
        (([0], np.array([0.5]), [1]), {}, TypeError, "offset must hold integers"),
        (([[0]], [[0]], [[1]]), {}, ValueError, "1-D"),
        (([0], [0], [1]), {"align": 3000}, ValueError, "power of two"),
        (([0], [0], [1]), {"max_gap": -1}, ValueError, "max_gap must be >= 0"),
        (([0], [0], [1]), {"max_transfer": 0}, ValueError, "max_transfer must be >= 1"),
        (([0], [0], [1]), {"align": 4096.0}, TypeError, "align must be an int"),
        (([1], [0], [1]), {"file_sizes": [10]}, ValueError, "names file 1 but file_sizes has 1 entries"),
    ],
)
def test_bad_input_names_the_problem(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        coalesce(*args, **kwargs)


def test_extent_past_end_of_file_is_a_format_error():
    with pytest.raises(FormatError, match=r"extent 1 \(file 0, offset 90, length 20\) ends at 110.*100 bytes"):
        coalesce([0, 0], [0, 90], [10, 20], file_sizes=[100])


def test_large_step_runs_in_one_call():
    rng = np.random.default_rng(0)
    n = 200_000
    offset = rng.integers(0, 1 << 34, n)
    tr = coalesce(rng.integers(0, 8, n).astype(np.int32), offset, rng.integers(0, 65536, n),
                  max_gap=32 << 10, max_transfer=1 << 20)
    assert 0 < tr.io_count <= n and tr.total_bytes >= tr.requested_bytes // 2


def test_transfer_limit_grows_with_large_extents_within_bounds():
    from foresight.io.coalesce import (DEFAULT_MAX_TRANSFER, EXTENTS_PER_TRANSFER, MAX_AUTO_TRANSFER,
                                       transfer_limit_for)

    assert transfer_limit_for(0) == DEFAULT_MAX_TRANSFER
    assert transfer_limit_for(16 << 10) == DEFAULT_MAX_TRANSFER
    assert transfer_limit_for(1 << 20) == EXTENTS_PER_TRANSFER << 20
    assert transfer_limit_for(1e9) == MAX_AUTO_TRANSFER
    assert transfer_limit_for(300_001) % 4096 == 0
