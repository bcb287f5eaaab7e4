"""foresight._core, the raw pybind11 layer: dtypes are strict, errors carry context, results are exact."""
from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from foresight import _core
from foresight.errors import FormatError


def i64(*values):
    return np.array(values, dtype=np.int64)


# -- xxh3_batch ---------------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5000), st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), max_size=20))
def test_xxh3_batch_matches_the_xxhash_package(data, slices):
    slices = [(min(o, len(data)), min(n, len(data) - min(o, len(data)))) for o, n in slices]
    offsets = np.array([o for o, _ in slices], dtype=np.int64)
    lengths = np.array([n for _, n in slices], dtype=np.int64)
    got = _core.xxh3_batch(data, offsets, lengths)
    assert got.dtype == np.uint64
    assert got.tolist() == [xxhash.xxh3_64_intdigest(data[o : o + n]) for o, n in slices]


def test_xxh3_batch_takes_any_contiguous_buffer():
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    expect = xxhash.xxh3_64_intdigest(data.tobytes())
    as_2d = data.view(np.uint32).reshape(64, -1)
    for buf in (data, data.tobytes(), bytearray(data.tobytes()), memoryview(data), as_2d):
        assert _core.xxh3_batch(buf, i64(0), i64(1 << 20))[0] == expect
    with mmap.mmap(-1, 1 << 20) as m:
        m.write(data.tobytes())
        assert _core.xxh3_batch(m, i64(0), i64(1 << 20))[0] == expect


@pytest.mark.parametrize(
    ("offsets", "lengths", "error", "match"),
    [
        (i64(0, 5), i64(1), ValueError, "lengths has 1 entries, expected 2"),
        (i64(0, 95), i64(1, 10), ValueError, r"slice 1 \(offset 95, length 10\) is outside the buffer of 100"),
        (i64(-1), i64(1), ValueError, "slice 0 .*outside"),
        (i64(0), i64(-1), ValueError, "slice 0 .*outside"),
        (np.array([0], np.int32), i64(1), TypeError, "offsets must be an array of dtype int64, got int32"),
        (i64(0).reshape(1, 1), i64(1), ValueError, "1-D"),
        (np.arange(4, dtype=np.int64)[::2], i64(1, 1), ValueError, "contiguous"),
    ],
)
def test_xxh3_batch_bad_input(offsets, lengths, error, match):
    with pytest.raises(error, match=match):
        _core.xxh3_batch(bytes(100), offsets, lengths)


def test_xxh3_batch_rejects_non_buffers():
    with pytest.raises(TypeError, match="buffer must be a contiguous buffer.*got str"):
        _core.xxh3_batch("text", i64(0), i64(1))


# -- gather -------------------------------------------------------------------------------------------

def test_gather_packs_pieces_back_to_back():
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(10, dtype=np.uint8)
    assert _core.gather(src, i64(90, 0, 50), i64(3, 2, 4), dst) == 9
    assert dst.tolist() == [90, 91, 92, 0, 1, 50, 51, 52, 53, 0]


def test_gather_to_given_offsets_into_a_typed_array():
    src = np.arange(8, dtype=np.uint16)  # token pieces: byte offsets and lengths
    rows = np.zeros((2, 2), dtype=np.uint16)
    _core.gather(src, i64(12, 0), i64(4, 4), rows, i64(0, 4))
    assert rows.tolist() == [[6, 7], [0, 1]]


@pytest.mark.parametrize(
    ("src_off", "length", "dst_off", "match"),
    [
        (i64(0, 99), i64(1, 2), None, r"piece 1 \(offset 99, length 2\) is outside the source of 100"),
        (i64(0, 0), i64(6, 6), None, r"piece 1 \(6 bytes to destination offset 6\) does not fit .* 10 bytes"),
        (i64(0), i64(1), i64(10), "piece 0 .*does not fit"),
        (i64(0), i64(1), i64(0, 1), "dst_offsets has 2 entries, expected 1"),
    ],
)
def test_gather_bad_input_copies_nothing(src_off, length, dst_off, match):
    dst = np.zeros(10, dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        _core.gather(np.ones(100, np.uint8), src_off, length, dst, dst_off)
    assert not dst.any()


def test_gather_needs_a_writable_destination():
    with pytest.raises(TypeError, match="dst must be a contiguous writable buffer"):
        _core.gather(bytes(10), i64(0), i64(1), bytes(10))


# -- coalesce (raw) -----------------------------------------------------------------------------------

def test_coalesce_returns_arrays_and_stats():
    out = _core.coalesce(np.array([0, 0], np.int32), i64(0, 8192), i64(100, 100), max_gap=4096,
                         max_transfer=1 << 20, align=4096)
    assert out["t_offset"].tolist() == [0] and out["t_length"].tolist() == [12288]
    assert out["t_needed"].tolist() == [8292] and out["x_dest"].tolist() == [0, 8192]
    assert (out["total_bytes"], out["requested_bytes"], out["read_bytes"]) == (12288, 200, 12288)
    assert out["t_file"].flags.owndata is False  # numpy views the C++ vector, no copy


def test_coalesce_is_strict_about_dtypes():
    with pytest.raises(TypeError, match="file must be an array of dtype int32, got int64"):
        _core.coalesce(i64(0), i64(0), i64(1), max_gap=0, max_transfer=1, align=1)
    with pytest.raises(TypeError, match="length must be an array of dtype int64, got float64"):
        _core.coalesce(np.zeros(1, np.int32), i64(0), np.ones(1), max_gap=0, max_transfer=1, align=1)


def test_coalesce_backstops_python_checks():
    one = (np.zeros(1, np.int32), i64(0), i64(1))
    with pytest.raises(ValueError, match="align must be a power of two"):
        _core.coalesce(*one, max_gap=0, max_transfer=1, align=0)
    with pytest.raises(ValueError, match="offset has 2 entries, expected 1"):
        _core.coalesce(np.zeros(1, np.int32), i64(0, 1), i64(1), max_gap=0, max_transfer=1, align=1)
    with pytest.raises(FormatError, match="past the end of the file"):
        _core.coalesce(*one, max_gap=0, max_transfer=1, align=1, file_sizes=i64(0))


# -- Arena (raw) --------------------------------------------------------------------------------------

def test_arena_slots_are_page_aligned_views():
    a = _core.Arena(5000, 3)
    assert a.slot_bytes == a.page_size * 2 and a.nbytes == 3 * a.slot_bytes
    for i in range(3):
        assert a.address(i) % a.page_size == 0
        view = a.slot(i)
        assert view.dtype == np.uint8 and view.size == a.slot_bytes and view.ctypes.data == a.address(i)
    a.slot(1)[:] = 7
    assert a.view()[a.slot_bytes : 2 * a.slot_bytes].min() == 7
    a.close()


def test_arena_memory_outlives_close_while_viewed():
    a = _core.Arena(4096, 2)
    view = a.slot(1)
    assert a.live_views == 1
    a.close()
    assert a.closed and a.live_views == 1
    view[:] = 3  # still mapped: the view co-owns the memory
    assert int(view.sum()) == 3 * 4096
    del view
    gc.collect()
    assert a.live_views == 0
    with pytest.raises(ValueError, match="used after close"):
        a.slot(0)
    with pytest.raises(ValueError, match="closed arena"):
        a.acquire(0)


def test_arena_pool_and_errors():
    a = _core.Arena(4096, 2)
    assert [a.acquire(0), a.acquire(0), a.acquire(0.01)] == [0, 1, -1]
    a.release(1)
    assert a.acquire(-1) == 1
    with pytest.raises(ValueError, match="release of slot 5 but the arena has 2 slots"):
        a.release(5)
    a.release(0)
    with pytest.raises(ValueError, match="release of slot 0, which is not acquired"):
        a.release(0)
    with pytest.raises(ValueError, match="access of slot 2"):
        a.slot(2)
    with pytest.raises(ValueError, match="slots must be > 0"):
        _core.Arena(4096, 0)
    with pytest.raises(OSError, match="mmap of .* bytes failed"):
        _core.Arena(1 << 50, 1 << 12)
