"""Layout invariants, both I/O backends and the checksums of foresight.checkpoint."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch
import xxhash
from foresight.checksum import xxh3_many
from foresight.checkpoint.aligned_io import FileIO
from foresight.checkpoint.layout import ALIGN, BIG_TENSOR_BYTES, plan_layout
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * BIG_TENSOR_BYTES // 8), st.sampled_from([1, 2, 4, 8])), max_size=40))
def test_layout_is_disjoint_aligned_and_padded(specs):
    nbytes = [n * isz for n, isz in specs]
    itemsize = [isz for _, isz in specs]
    lay = plan_layout(nbytes, itemsize)
    assert lay.total % ALIGN == 0
    spans = sorted((int(o), int(o) + n) for o, n in zip(lay.offsets, nbytes) if n)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    for o, n, isz in zip(lay.offsets.tolist(), nbytes, itemsize):
        assert o % isz == 0 and o + n <= lay.total
        if n >= BIG_TENSOR_BYTES:
            assert o % ALIGN == 0


@pytest.mark.parametrize("backend", ["uring", "pread"])
def test_fileio_round_trip_both_backends(tmp_path, backend):
    fio = FileIO(chunk_bytes=1 << 20, backend=backend)
    try:
        n = 5 * (1 << 20) + 3 * 4096
        src = mmap.mmap(-1, n)
        src[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
        path = str(tmp_path / "f.bin")
        fd, direct = fio.open(path, write=True)
        fio.write(fd, memoryview(src), path=path)
        os.close(fd)
        dst = mmap.mmap(-1, n)
        fd, _ = fio.open(path)
        fio.wait(fio.submit_read(fd, memoryview(dst), path=path))
        os.close(fd)
        assert dst[:] == src[:]
    finally:
        fio.close()


def test_fileio_write_reporting_reports_each_piece_end_in_order_and_refuses_bad_ends(tmp_path):
    fio = FileIO(chunk_bytes=1 << 20, backend="pread")
    try:
        n = 3 * (1 << 20) + 3 * 4096
        src = mmap.mmap(-1, n)  # page-aligned (direct I/O)
        src[:] = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8).tobytes()
        path = str(tmp_path / "f.bin")
        fd, _ = fio.open(path, write=True)
        ends, seen = [1 << 20, (2 << 20) + 4096, n], []
        fio.write_reporting(fd, memoryview(src), ends, seen.append, path=path)
        for bad in ([1 << 20], [4096, 4096, n], [8192, 4096, n], []):  # short, repeated, decreasing, none
            with pytest.raises(ValueError, match="piece ends"):
                fio.write_reporting(fd, memoryview(src), bad, seen.append, path=path)
        os.close(fd)
        assert seen == ends and open(path, "rb").read() == src[:]
    finally:
        fio.close()


def test_fileio_write_reporting_reports_the_first_piece_before_the_last_is_even_submitted(tmp_path):
    """A replicated save's first unit leaves as soon as its piece lands, not once the device has worked through the
    whole file: a few pieces (``depth``) and at most ``ahead`` bytes are in flight (with the whole file submitted at
    once, the first piece landed only when most of the file had). Asserted by the order of events."""
    fio = FileIO(chunk_bytes=1 << 20, backend="pread")
    events = []
    submit, wait = fio.submit_write, fio.wait
    fio.submit_write = lambda fd, view, *, file_offset=0, path=None: (
        events.append(("submit", file_offset + len(view))) or submit(fd, view, file_offset=file_offset, path=path))
    fio.wait = lambda token: (wait(token), events.append(("landed", None)))
    try:
        n = 16 << 20
        src = mmap.mmap(-1, n)
        src[:] = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8).tobytes()
        path = str(tmp_path / "f.bin")
        ends = [(i + 1) << 20 for i in range(16)]
        for ahead, depth, most in ((4 << 20, 8, 4), (64 << 20, 2, 2)):  # the bytes bind, then the pieces
            events.clear()
            fd, _ = fio.open(path, write=True)
            fio.write_reporting(fd, memoryview(src), ends, lambda end: events.append(("reported", end)), path=path,
                                ahead=ahead, depth=depth)
            os.close(fd)
            assert [e for k, e in events if k == "reported"] == ends and open(path, "rb").read() == src[:]
            first, last = events.index(("reported", ends[0])), events.index(("submit", n))
            assert first < last  # the first unit was out before the last piece went to the device
            in_flight = 0
            for kind, _ in events:  # pieces submitted and not landed (1 MiB each here)
                in_flight += {"submit": 1, "landed": -1}.get(kind, 0)
                assert in_flight <= most
    finally:
        fio.close()


def test_checksums_match_xxhash():
    buf = np.random.default_rng(1).integers(0, 256, 9 << 20, dtype=np.uint8)
    offsets = np.array([0, 10, 4096, 1 << 20, 0], dtype=np.int64)
    nbytes = np.array([10, 0, 5000, 8 << 20, 9 << 20], dtype=np.int64)
    expected = [xxhash.xxh3_64_intdigest(buf[o:o + n].tobytes()) for o, n in zip(offsets, nbytes)]
    assert xxh3_many(memoryview(buf), offsets, nbytes).tolist() == expected



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_round_trip(tmp_path):
    import foresight.checkpoint as fc

    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, device="cuda").half()}
    expected = {k: v.cpu() for k, v in state.items()}
    with fc.Checkpointer(tmp_path) as ck:
        assert ck.save({"x": torch.zeros(1)}, 0).wait() and ck.staging.pinned
        h = ck.save(state, 1)
        for t in state.values():
            t.add_(1)  # on the current stream, ordered after the snapshot copies
        h.wait()
        got = ck.load(1).state_dict
    for k in state:
        assert torch.equal(got[k], expected[k])


def test_a_snapshot_that_fails_mid_copy_raises_to_the_caller_only_and_frees_its_slot(tmp_path, monkeypatch):
    """The writer starts with the snapshot (it writes what is staged); a copy that fails half-way stops it: save()
    raises that error, nothing is committed, the slot is free again and the next save() neither blocks nor raises
    the failure a second time."""
    import foresight.checkpoint.checkpointer as ckmod
    from foresight.checkpoint import Checkpointer

    real = ckmod.copy_into

    def half_then_fail(views, tensors, *, small, big, offsets=None, staged=None):
        staged.advance(int(offsets[big[len(big) // 2]]))  # the first half staged: the writer may write it
        raise RuntimeError("copy failed")

    state = {f"w{i}": torch.randn(1 << 18) for i in range(4)}
    with Checkpointer(str(tmp_path / "ck"), staging_bytes=8 << 20, slots=1, on_busy="raise") as ck:
        monkeypatch.setattr(ckmod, "copy_into", half_then_fail)
        with pytest.raises(RuntimeError, match="copy failed"):
            ck.save(state, 1)
        monkeypatch.setattr(ckmod, "copy_into", real)
        ck.save(state, 2).wait()  # the slot is free (on_busy="raise" would say so) and no failure is pending
        assert ck.steps() == [2]
        loaded = ck.load(2)
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in state.items())
