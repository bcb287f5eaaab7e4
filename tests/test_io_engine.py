"""foresight.io.engine: real files, real io_uring, every test on every backend.

Backends: "uring" (with the RWF_NOWAIT page-cache pass), "uring_ring" (the pass off, so every
request goes through the ring) and "pread" (the thread pool).
"""
from __future__ import annotations

import errno
import mmap
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foresight.errors import IOEngineError
from foresight.io import IOEngine, fdatasync, fsync, open_file

BACKENDS = ["uring", "uring_ring", "pread"]
FILE_SIZE = 256 << 10


def uring_unavailable() -> str | None:
    """Why the io_uring variants must skip here (not compiled in, or refused by the kernel), or None."""
    try:
        IOEngine(backend="uring").close()
    except IOEngineError as e:
        return str(e)
    return None


URING_SKIP = uring_unavailable()


def make_engine(backend: str, **kw) -> IOEngine:
    if backend.startswith("uring") and URING_SKIP:
        pytest.skip(URING_SKIP)
    if backend == "uring_ring":
        return IOEngine(backend="uring", nowait=False, **kw)
    return IOEngine(backend=backend, **kw)


def aligned(nbytes: int) -> np.ndarray:
    """Page-aligned, zeroed buffer (anonymous mmap)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 4096)), dtype=np.uint8)[:nbytes]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param.startswith("uring") and URING_SKIP:
        pytest.skip(URING_SKIP)
    return request.param


@pytest.fixture
def engine(backend):
    with make_engine(backend) as eng:
        yield eng


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("io") / "data.bin"
    data = np.random.default_rng(0).integers(0, 256, FILE_SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = open_file(path)
    yield str(path), fd, data
    os.close(fd)


def dest_layout(lengths: np.ndarray, gap: int = 0) -> tuple[np.ndarray, int]:
    """Back-to-back destination positions with an optional gap; returns (positions, total)."""
    pos = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        pos[1:] = np.cumsum(lengths[:-1] + gap)
    return pos, int(lengths.sum() + gap * len(lengths))


# -- reads ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=BACKENDS)
def module_engine(request):
    with make_engine(request.param, queue_depth=8) as eng:
        yield eng


extents = st.lists(
    st.integers(0, FILE_SIZE).flatmap(
        lambda off: st.tuples(
            st.just(off),
            st.one_of(st.sampled_from([0, min(1, FILE_SIZE - off)]), st.integers(0, FILE_SIZE - off)),
        )
    ),
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ext=extents, gap=st.sampled_from([0, 3]))
def test_any_extents_delivered_exactly(module_engine, data_file, ext, gap):
    _, fd, data = data_file
    offsets = np.array([o for o, _ in ext], dtype=np.int64)
    lengths = np.array([n for _, n in ext], dtype=np.int64)
    pos, total = dest_layout(lengths, gap)
    buf = np.full(total + 1, 0xEE, dtype=np.uint8)  # canary: nothing is written outside the extents
    addrs = buf.ctypes.data + pos.astype(np.uint64)
    got = module_engine.read_batch(fd, offsets, lengths, addrs)
    assert np.array_equal(got, lengths)
    for p, o, n in zip(pos, offsets, lengths):
        assert np.array_equal(buf[p:p + n], data[o:o + n])
        assert np.all(buf[p + n:p + n + gap] == 0xEE)
    assert buf[-1] == 0xEE


def test_large_batch_beyond_queue_depth(backend, data_file):
    _, fd, data = data_file
    rng = np.random.default_rng(1)
    n = 3000
    offsets = rng.integers(0, FILE_SIZE - 4096, n)
    lengths = rng.integers(1, 4096, n)
    pos, total = dest_layout(lengths)
    buf = np.zeros(total, dtype=np.uint8)
    with make_engine(backend, queue_depth=4, max_inflight_bytes=8192) as eng:
        got = eng.read_batch(np.full(n, fd, np.int32), offsets, lengths, buf.ctypes.data + pos.astype(np.uint64))
        assert eng.stats["requests"] == n
    assert np.array_equal(got, lengths)
    expect = np.concatenate([data[o:o + k] for o, k in zip(offsets, lengths)])
    assert np.array_equal(buf, expect)


def test_empty_batch_and_zero_lengths(engine, data_file):
    _, fd, _ = data_file
    assert len(engine.read_batch(fd, np.array([], np.int64), np.array([], np.int64), np.array([], np.uint64))) == 0
    got = engine.read_batch(fd, [5, 7], [0, 0], [0, 0])  # no buffer needed for zero bytes
    assert got.tolist() == [0, 0]


def test_submit_poll_wait_overlap(engine, data_file):
    _, fd, data = data_file
    rng = np.random.default_rng(2)
    bufs, tickets, expected = [], [], []
    for _ in range(3):
        offsets = rng.integers(0, FILE_SIZE - 8192, 500)
        lengths = rng.integers(1, 8192, 500)
        pos, total = dest_layout(lengths)
        buf = np.zeros(total, np.uint8)
        tickets.append(engine.submit_reads(fd, offsets, lengths, buf.ctypes.data + pos.astype(np.uint64)))
        bufs.append(buf)
        expected.append(np.concatenate([data[o:o + k] for o, k in zip(offsets, lengths)]))
    while not engine.poll(tickets[0]):
        pass
    for i in (2, 0, 1):  # out of order
        engine.wait(tickets[i])
        assert np.array_equal(bufs[i], expected[i])
    with pytest.raises(KeyError):
        engine.wait(tickets[0])


def test_threads_each_with_own_engine(backend, data_file):
    _, fd, data = data_file
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            with make_engine(backend, queue_depth=16, threads=2) as eng:
                for _ in range(5):
                    offsets = rng.integers(0, FILE_SIZE - 4096, 200)
                    lengths = rng.integers(0, 4096, 200)
                    pos, total = dest_layout(lengths)
                    buf = np.zeros(total, np.uint8)
                    eng.read_batch(fd, offsets, lengths, buf.ctypes.data + pos.astype(np.uint64))
                    expect = np.concatenate([data[o:o + k] for o, k in zip(offsets, lengths)])
                    assert np.array_equal(buf, expect)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_shared_engine_across_threads(engine, data_file):
    _, fd, data = data_file
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(10):
                offsets = rng.integers(0, FILE_SIZE - 4096, 100)
                lengths = rng.integers(1, 4096, 100)
                pos, total = dest_layout(lengths)
                buf = np.zeros(total, np.uint8)
                t = engine.submit_reads(fd, offsets, lengths, buf.ctypes.data + pos.astype(np.uint64))
                engine.wait(t)
                assert np.array_equal(buf, np.concatenate([data[o:o + k] for o, k in zip(offsets, lengths)]))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- writes -----------------------------------------------------------------------------------------

def test_write_then_read_back(engine, tmp_path):
    path = tmp_path / "out.bin"
    fd = open_file(path, write=True)
    try:
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        starts = np.arange(0, len(src), 65536, dtype=np.int64)[::-1].copy()  # any order
        lengths = np.full(len(starts), 65536, np.int64)
        got = engine.write_batch(fd, starts + 4096, lengths, src.ctypes.data + starts.astype(np.uint64))
        assert np.array_equal(got, lengths)
        fdatasync(fd)
        fsync(fd)
        assert os.path.getsize(path) == len(src) + 4096
        back = np.zeros_like(src)
        engine.read_batch(fd, [4096], [len(src)], [back.ctypes.data])
        assert np.array_equal(back, src)
        assert path.read_bytes()[4096:] == src.tobytes()
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def scratch_fd(tmp_path_factory):
    fd = open_file(tmp_path_factory.mktemp("w") / "scratch.bin", write=True)
    yield fd
    os.close(fd)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 1 << 16), max_size=30), data=st.data())
def test_any_disjoint_writes_land_exactly(module_engine, scratch_fd, cuts, data):
    """Split [0, 64 KiB) at arbitrary cuts, write the pieces in any order, read the file back."""
    os.ftruncate(scratch_fd, 0)
    bounds = np.unique(np.array([0, 1 << 16, *cuts], dtype=np.int64))
    offsets, lengths = bounds[:-1], np.diff(bounds)
    order = np.array(data.draw(st.permutations(range(len(offsets)))), dtype=np.int64)
    src = np.random.default_rng(len(cuts)).integers(0, 256, 1 << 16, dtype=np.uint8)
    got = module_engine.write_batch(scratch_fd, offsets[order], lengths[order],
                                    src.ctypes.data + offsets[order].astype(np.uint64))
    assert np.array_equal(got, lengths[order])
    assert os.pread(scratch_fd, 1 << 17, 0) == src.tobytes()


def test_direct_write_and_read(engine, tmp_path):
    path = tmp_path / "direct.bin"
    fd = open_file(path, write=True, direct=True)
    try:
        src = aligned(1 << 20)
        src[:] = np.random.default_rng(4).integers(0, 256, len(src), dtype=np.uint8)
        offsets = np.arange(0, 1 << 20, 16384, dtype=np.int64)
        lengths = np.full(len(offsets), 16384, np.int64)
        engine.write_batch(fd, offsets, lengths, src.ctypes.data + offsets.astype(np.uint64))
        fsync(fd)
        dst = aligned(1 << 20)
        perm = np.random.default_rng(5).permutation(len(offsets))
        engine.read_batch(fd, offsets[perm], lengths[perm], dst.ctypes.data + offsets[perm].astype(np.uint64))
        assert np.array_equal(dst, src)
    finally:
        os.close(fd)


def test_write_on_read_only_fd_names_request(engine, data_file):
    path, fd, _ = data_file
    buf = np.zeros(16, np.uint8)
    with pytest.raises(IOEngineError) as ei:
        engine.write_batch(fd, [0, 0], [0, 16], [0, buf.ctypes.data])
    assert ei.value.errno == errno.EBADF
    assert "request=1" in str(ei.value) and path in str(ei.value)


# -- O_DIRECT and registration ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def direct_file(tmp_path_factory):
    """40,000 bytes: not a multiple of 4096, so the last block is partial."""
    path = tmp_path_factory.mktemp("direct") / "d.bin"
    data = np.random.default_rng(6).integers(0, 256, 40000, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = open_file(path, direct=True)
    yield str(path), fd, data
    os.close(fd)


def test_direct_reads_aligned(engine, direct_file):
    _, fd, data = direct_file
    buf = aligned(8 * 4096)
    offsets = np.array([4096 * k for k in (3, 0, 8, 1)], np.int64)
    lengths = np.array([4096, 8192, 4096, 4096], np.int64)
    pos = np.array([0, 4096, 12288, 16384], np.int64)
    got = engine.read_batch(fd, offsets, lengths, buf.ctypes.data + pos.astype(np.uint64))
    assert got.tolist() == lengths.tolist()
    for p, o, n in zip(pos, offsets, lengths):
        assert np.array_equal(buf[p:p + n], data[o:o + n])


def test_direct_misaligned_rejected(engine, direct_file):
    path, fd, _ = direct_file
    buf = aligned(3 * 4096)
    for off, n, shift in ((100, 4096, 0), (4096, 1000, 0), (4096, 4096, 16)):
        with pytest.raises(IOEngineError) as ei:
            engine.read_batch(fd, [0, off], [4096, n], [buf.ctypes.data + 4096, buf.ctypes.data + shift])
        msg = str(ei.value)
        assert ei.value.errno == errno.EINVAL
        assert "not aligned" in msg and "request=1" in msg and f"offset={off}" in msg and path in msg


def test_direct_tail_block_past_eof(engine, direct_file):
    path, fd, data = direct_file
    buf = aligned(4096)
    tail = 40000 - 36864
    with pytest.raises(IOEngineError) as ei:
        engine.read_batch(fd, [36864], [4096], [buf.ctypes.data])
    assert ei.value.errno == errno.ENODATA and "offset=36864" in str(ei.value) and path in str(ei.value)
    got = engine.read_batch(fd, [36864], [4096], [buf.ctypes.data], allow_eof=True)
    assert got.tolist() == [tail]
    assert np.array_equal(buf[:tail], data[36864:])
    assert engine.read_batch(fd, [36864], [4096], [buf.ctypes.data], needed=[tail]).tolist() == [tail]
    with pytest.raises(IOEngineError, match="past end of file"):
        engine.read_batch(fd, [36864], [4096], [buf.ctypes.data], needed=[tail + 1])


def test_registered_files_and_buffers(backend, direct_file, data_file):
    _, dfd, ddata = direct_file
    _, fd, data = data_file
    arena = aligned(64 * 4096)
    with make_engine(backend) as eng:
        eng.register_files([fd, dfd])
        eng.register_buffers([arena, (arena.ctypes.data, 16 * 4096)])
        offsets = np.arange(0, 8 * 4096, 4096, dtype=np.int64)[::-1].copy()
        lengths = np.full(8, 4096, np.int64)
        eng.read_batch(dfd, offsets, lengths, arena.ctypes.data + offsets.astype(np.uint64))
        assert np.array_equal(arena[:8 * 4096], ddata[:8 * 4096])
        # buffered fd, one buffer outside any registered one
        other = np.zeros(100, np.uint8)
        eng.read_batch(fd, [1, 5000], [100, 5000], [other.ctypes.data, arena.ctypes.data + 40 * 4096])
        assert np.array_equal(other, data[1:101])
        assert np.array_equal(arena[40 * 4096:40 * 4096 + 5000], data[5000:10000])
        s = eng.stats
        assert s["registered_files"] == 2 and s["registered_buffers"] >= 1
        if eng.backend == "uring":
            assert s["fixed_buffer_ops"] >= 8 and s["fixed_file_ops"] >= 8
        eng.unregister_buffers()
        eng.unregister_files()
        arena[:] = 0
        eng.read_batch(dfd, offsets, lengths, arena.ctypes.data + offsets.astype(np.uint64))
        assert np.array_equal(arena[:8 * 4096], ddata[:8 * 4096])


# -- errors -----------------------------------------------------------------------------------------

def test_read_past_eof_names_path_and_offset(engine, data_file):
    path, fd, data = data_file
    buf = np.zeros(8192, np.uint8)
    with pytest.raises(IOEngineError) as ei:
        engine.read_batch(fd, [0, FILE_SIZE - 10, FILE_SIZE + 5], [10, 20, 1],
                          [buf.ctypes.data, buf.ctypes.data + 100, buf.ctypes.data + 200])
    e = ei.value
    assert isinstance(e, OSError) and e.errno == errno.ENODATA
    msg = str(e)
    assert "past end of file" in msg and path in msg and f"offset={FILE_SIZE - 10}" in msg and "request=1" in msg
    assert "failed=2 of 3" in msg and f"file_size={FILE_SIZE}" in msg
    assert e.results.tolist()[0] == 10  # the good request still landed
    assert np.array_equal(buf[:10], data[:10])
    got = engine.read_batch(fd, [FILE_SIZE - 10, FILE_SIZE], [20, 5], [buf.ctypes.data] * 2, allow_eof=True)
    assert got.tolist() == [10, 0]


def test_bad_fd_names_request(engine, data_file):
    _, fd, _ = data_file
    buf = np.zeros(64, np.uint8)
    r, w = os.pipe()
    os.close(r)
    os.close(w)  # a closed fd
    with pytest.raises(IOEngineError) as ei:
        engine.read_batch([fd, r, -1], [0, 0, 0], [8, 8, 8], [buf.ctypes.data] * 3)
    assert ei.value.errno == errno.EBADF
    assert f"fd={r}" in str(ei.value) and "request=1" in str(ei.value) and "failed=2 of 3" in str(ei.value)


def test_bad_buffer_address_is_efault_not_crash(engine, data_file):
    _, fd, _ = data_file
    with pytest.raises(IOEngineError) as ei:
        engine.read_batch(fd, [0], [4096], [8])  # the kernel refuses the address; nothing segfaults
    assert ei.value.errno == errno.EFAULT


def test_argument_checks(engine, data_file):
    _, fd, _ = data_file
    with pytest.raises(ValueError, match="allowed"):
        IOEngine(backend="io_uring")
    with pytest.raises(ValueError, match="queue_depth"):
        IOEngine(queue_depth=0)
    with pytest.raises(ValueError, match="one entry per request"):
        engine.read_batch([fd, fd], [0], [1], [1])
    with pytest.raises(TypeError, match="integers"):
        engine.read_batch(fd, [0.5], [1], [1])
    with pytest.raises(ValueError, match="out of range"):
        engine.read_batch(fd, [0], [1], [-1])


def test_close_is_clean_and_final(backend, data_file):
    _, fd, _ = data_file
    eng = make_engine(backend, queue_depth=1, threads=1)
    buf = np.zeros(4096 * 2000, np.uint8)
    offsets = np.zeros(2000, np.int64)
    t = eng.submit_reads(fd, offsets, np.full(2000, 4096), buf.ctypes.data + np.arange(2000, dtype=np.uint64) * 4096)
    eng.close()  # cancels what has not started, waits for what is in flight
    eng.close()
    with pytest.raises(ValueError, match="closed"):
        eng.wait(t)
    with pytest.raises(ValueError, match="closed"):
        eng.read_batch(fd, [0], [1], [buf.ctypes.data])


def user_threads() -> set[int]:
    """Thread ids of this process, not counting the kernel's io_uring workers (iou-wrk/iou-sqp), which
    belong to the task rather than to a ring and linger a few seconds after it is gone. Compared by identity: a
    thread an earlier test left exiting may end meanwhile, which a count would take for a change."""
    tids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("iou-"):
                    tids.add(int(tid))
        except FileNotFoundError:  # exited meanwhile
            pass
    return tids


def test_no_leaked_fds_or_threads(backend, data_file):
    _, fd, _ = data_file
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = user_threads()
    buf = np.zeros(16 * 4096, np.uint8)
    offsets = np.arange(16, dtype=np.int64) * 4096
    for _ in range(20):
        with make_engine(backend, threads=3) as eng:
            eng.read_batch(fd, [0], [10], [buf.ctypes.data])
            # a batch large enough for the page-cache pass: its helper threads start, and must end with the engine
            eng.read_batch(fd, offsets, np.full(16, 4096), buf.ctypes.data + offsets.astype(np.uint64))
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert user_threads() - threads_before == set()  # every thread the engines started has ended


def io_uring_fds() -> set[int]:
    """This process's open io_uring instances (their fds)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                fds.add(int(name))
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return fds


def sq_thread(ring_fd: int) -> int:
    """The kernel's SqThread of a ring (fdinfo): the tid of its SQPOLL thread, -1 without one."""
    with open(f"/proc/self/fdinfo/{ring_fd}") as f:
        for line in f:
            if line.startswith("SqThread:"):
                return int(line.split()[1])
    pytest.skip("this kernel's io_uring fdinfo has no SqThread line")


@pytest.mark.skipif(URING_SKIP is not None, reason=str(URING_SKIP))
def test_sqpoll(data_file):
    """SQPOLL claimed is SQPOLL in use: the ring has a kernel submission thread (iou-sqp) of this process,
    and a ring without it has none. Refused (old kernel without CAP_SYS_NICE, restricted io_uring): skip."""
    _, fd, data = data_file
    before = io_uring_fds()
    with IOEngine(backend="uring", sqpoll=True, nowait=False) as eng:
        if not eng.sqpoll:
            pytest.skip("the kernel refused IORING_SETUP_SQPOLL here; the engine runs without it")
        (ring,) = io_uring_fds() - before
        buf = np.zeros(1000, np.uint8)
        for _ in range(3):
            eng.read_batch(fd, [123], [1000], [buf.ctypes.data])
        assert np.array_equal(buf, data[123:1123])
        tid = sq_thread(ring)
        assert tid != -1, "engine says SQPOLL, the kernel's ring has no SQ thread"
        with open(f"/proc/self/task/{tid}/comm") as f:
            assert f.read().startswith("iou-sqp"), f"SqThread {tid} is not this process's iou-sqp thread"
    with IOEngine(backend="uring", sqpoll=False, nowait=False) as eng:
        (ring,) = io_uring_fds() - before
        assert not eng.sqpoll and sq_thread(ring) == -1


@pytest.mark.skipif(URING_SKIP is not None, reason=str(URING_SKIP))
def test_nowait_pass_serves_cached_reads(data_file):
    _, fd, _ = data_file
    buf = np.zeros(4096 * 10, np.uint8)
    offsets = np.arange(10, dtype=np.int64) * 4096
    with IOEngine(backend="uring") as eng:
        eng.read_batch(fd, offsets, np.full(10, 4096), buf.ctypes.data + offsets.astype(np.uint64))
        assert eng.stats["nowait_hits"] == 10  # the file was just written: it is in the page cache
    with IOEngine(backend="uring", nowait=False) as eng:
        eng.read_batch(fd, offsets, np.full(10, 4096), buf.ctypes.data + offsets.astype(np.uint64))
        assert eng.stats["nowait_hits"] == 0


@pytest.mark.skipif(URING_SKIP is not None, reason=str(URING_SKIP))
@pytest.mark.parametrize("threads", [1, 4])
def test_page_cache_pass_with_errors_and_eof_in_the_batch(data_file, threads):
    # A batch large enough for the multi-threaded pass (threads=4), or probed by the feeder alone
    # (threads=1): hits, a bad fd, a read past the end and one reaching it, each with its own result.
    path, fd, data = data_file
    n = 40
    offsets = (np.arange(n, dtype=np.int64) * 4093) % (FILE_SIZE - 4096)
    lengths = np.full(n, 4096, np.int64)
    fds = np.full(n, fd, np.int32)
    fds[7] = -1
    offsets[20], offsets[31] = FILE_SIZE + 4096, FILE_SIZE - 100
    buf = np.zeros(n * 4096, np.uint8)
    addrs = buf.ctypes.data + np.arange(n, dtype=np.uint64) * 4096
    with IOEngine(backend="uring", threads=threads) as eng:
        with pytest.raises(IOEngineError) as ei:
            eng.read_batch(fds, offsets, lengths, addrs)
        results = ei.value.results
        assert results[7] == -errno.EBADF and results[20] == -errno.ENODATA and results[31] == -errno.ENODATA
        got = eng.read_batch(fds.clip(min=fd), offsets, lengths, addrs, allow_eof=True)
        assert got[20] == 0 and got[31] == 100
        for i in set(range(n)) - {20, 31}:
            assert got[i] == 4096
            assert np.array_equal(buf[i * 4096:(i + 1) * 4096], data[offsets[i]:offsets[i] + 4096]), i
        assert eng.stats["nowait_hits"] >= 2 * (n - 3)


def _permuted_reads(n: int, size: int, seed: int, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n`` reads of ``size`` bytes at shuffled offsets, each into its own part of ``buf``: (offsets, addrs)."""
    offsets = np.random.default_rng(seed).permutation(n).astype(np.int64) * size
    return offsets, buf.ctypes.data + np.arange(n, dtype=np.uint64) * size


def _expected(data: np.ndarray, offsets: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([data[o:o + size] for o in offsets.tolist()])


@pytest.mark.parametrize("kind", ["uring", "pread"])
def test_batches_in_flight_are_copied_behind_each_other_without_engine_calls(tmp_path, kind):
    """Warm batches submitted back to back are all copied by the engine's threads with no further call: on io_uring
    each batch's page-cache pass is queued at submit and the helpers go from one to the next (before, the second
    batch's pass waited until the caller collected the first). Waiting out of order gives every byte."""
    if kind == "uring" and (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the page-cache pass has no helper threads, the waiting caller copies")
    n, size = 2048, 4096
    data = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
    path = tmp_path / "warm.bin"
    path.write_bytes(data.tobytes())  # just written: in the page cache
    fd = open_file(path)
    bufs = [np.zeros(n * size, np.uint8) for _ in range(3)]
    reads = [_permuted_reads(n, size, seed, buf) for seed, buf in enumerate(bufs)]
    try:
        with make_engine(kind, threads=4) as eng:
            tickets = [eng.submit_reads(fd, offsets, size, addrs) for offsets, addrs in reads]
            want = [_expected(data, offsets, size) for offsets, _ in reads]
            deadline = time.monotonic() + 60  # a bounded wait for an event, not a timing assertion
            while not all(np.array_equal(b, w) for b, w in zip(bufs, want)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(np.array_equal(b, w) for b, w in zip(bufs, want)), "later batches waited for an engine call"
            for t in (tickets[2], tickets[0], tickets[1]):
                assert (eng.wait(t) == size).all()
            if kind == "uring":
                assert eng.stats["nowait_hits"] == 3 * n and eng.stats["threads"] >= 2
    finally:
        os.close(fd)
    assert all(np.array_equal(b, w) for b, w in zip(bufs, want))


@pytest.mark.parametrize("kind", ["uring", "pread"])
def test_batches_in_flight_keep_their_own_eof_and_errors(tmp_path, kind):
    """Two warm batches in flight at once, waited for out of order: the one reaching the end of the file gets its
    short read (allow_eof) and its bytes, the one reading past it fails naming the file and the offset, and neither
    outcome leaks into the other batch."""
    n, size = 64, 4096
    data = np.random.default_rng(2).integers(0, 256, n * size - 100, dtype=np.uint8)  # the last block is short
    path = tmp_path / "short.bin"
    path.write_bytes(data.tobytes())
    fd = open_file(path)
    bufs = [np.zeros(n * size, np.uint8) for _ in range(2)]
    (off_a, addr_a), (off_b, addr_b) = (_permuted_reads(n, size, seed, buf) for seed, buf in enumerate(bufs))
    off_b[5] = n * size + 8192  # past the end
    try:
        with make_engine(kind, threads=4) as eng:
            ta = eng.submit_reads(fd, off_a, size, addr_a, allow_eof=True)
            tb = eng.submit_reads(fd, off_b, size, addr_b)
            with pytest.raises(IOEngineError) as ei:
                eng.wait(tb)
            got = eng.wait(ta)
    finally:
        os.close(fd)
    assert str(path) in str(ei.value) and f"offset={n * size + 8192}" in str(ei.value).replace(" ", "")
    results = ei.value.results
    assert results[5] == -errno.ENODATA and (np.delete(results, 5) == np.where(np.delete(off_b, 5) == (n - 1) * size,
                                                                                -errno.ENODATA, size)).all()
    last = int(np.flatnonzero(off_a == (n - 1) * size)[0])
    assert got[last] == size - 100 and (np.delete(got, last) == size).all()
    for j, o in enumerate(off_a.tolist()):
        assert np.array_equal(bufs[0][j * size:j * size + got[j]], data[o:o + got[j]]), j


@pytest.mark.slow
def test_request_over_one_gib_is_continued(backend, tmp_path):
    """io_uring lengths are 32-bit and pread stops at 2 GiB: one request is split and continued."""
    path = tmp_path / "sparse.bin"
    n = (1 << 30) + 3 * 4096 + 17
    with open(path, "wb") as f:
        f.truncate(n)
        f.seek(n - 5)
        f.write(b"tail!")
    fd = open_file(path)
    buf = aligned(n)
    buf[:4096] = 1
    try:
        with make_engine(backend) as eng:
            assert eng.read_batch(fd, [0], [n], [buf.ctypes.data]).tolist() == [n]
    finally:
        os.close(fd)
    assert buf[:4096].max() == 0 and bytes(buf[-5:]) == b"tail!"


# -- backend choice ---------------------------------------------------------------------------------

def run_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_env_var_forces_pread():
    code = """
        import logging; logging.basicConfig(level=logging.INFO)
        from foresight.io import IOEngine
        with IOEngine() as e: print(e.backend)
        with IOEngine(backend="pread", threads=1) as e: print(e.backend)
    """
    out = run_child(code, {"FORESIGHT_IO_BACKEND": "pread"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pread", "pread"]
    assert "foresight I/O backend: pread" in out.stderr
    bad = run_child("from foresight.io import IOEngine; IOEngine()", {"FORESIGHT_IO_BACKEND": "bogus"})
    assert bad.returncode != 0 and "allowed" in bad.stderr


SECCOMP_CHILD = """
    import ctypes, errno, logging, os
    logging.basicConfig(level=logging.INFO)
    # seccomp filter: io_uring_setup (425 on x86_64) fails with ERR, everything else allowed
    ERR = errno.{err}
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]
    insns = (Insn * 4)(Insn(0x20, 0, 0, 0), Insn(0x15, 0, 1, 425), Insn(0x06, 0, 0, 0x00050000 | ERR),
                       Insn(0x06, 0, 0, 0x7FFF0000))
    prog = Prog(4, insns)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0                       # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, os.strerror(ctypes.get_errno())  # SECCOMP_MODE_FILTER
    import numpy as np
    from foresight.errors import IOEngineError
    from foresight.io import IOEngine, open_file
    fd = open_file("/proc/self/exe")
    with IOEngine() as e:
        buf = np.zeros(4, np.uint8)
        e.read_batch(fd, [0], [4], [buf.ctypes.data])
        print(e.backend, e.fallback_reason.split(":")[0], bytes(buf[1:4]).decode())
    try:
        IOEngine(backend="uring")
    except IOEngineError as ex:
        print("uring refused", errno.errorcode[ex.errno])
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter hard-codes x86_64 syscall numbers")
@pytest.mark.skipif(URING_SKIP is not None, reason=str(URING_SKIP))
@pytest.mark.parametrize("err", ["EPERM", "ENOSYS"])
def test_fallback_when_io_uring_refused_by_seccomp(err):
    out = run_child(SECCOMP_CHILD.format(err=err))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"pread {err} ELF", f"uring refused {err}"]
    assert "io_uring unavailable" in out.stderr and "pread thread pool" in out.stderr


@pytest.mark.skipif(URING_SKIP is not None, reason=str(URING_SKIP))
def test_explicit_backend_beats_env_var():
    out = run_child("from foresight.io import IOEngine\nwith IOEngine(backend='uring') as e: print(e.backend)",
                    {"FORESIGHT_IO_BACKEND": "pread"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["uring"]


def test_registered_fd_closed_and_reused_reads_the_new_file(backend, tmp_path):
    """A registered fd number reused for another file must not read the old file through its slot."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"A" * 4096)
    b.write_bytes(b"B" * 4096)
    buf = np.zeros(16, np.uint8)
    with make_engine(backend) as eng:
        fd = open_file(a)
        eng.register_files([fd])
        eng.read_batch(fd, [0], [16], [buf.ctypes.data])
        assert bytes(buf) == b"A" * 16
        os.close(fd)
        fd2 = open_file(b)
        try:
            assert fd2 == fd  # the lowest free number comes back
            eng.read_batch(fd2, [0], [16], [buf.ctypes.data])
            assert bytes(buf) == b"B" * 16
        finally:
            os.close(fd2)


@pytest.mark.skipif(URING_SKIP is not None, reason=str(URING_SKIP))
def test_page_cache_pass_reads_through_its_rings_on_registered_files_and_buffers(tmp_path):
    """The page-cache pass's threads read a claim with one io_uring_enter on a ring of their own (RWF_NOWAIT),
    on the engine's registered files and into its registered buffers, mirrored on their rings: counted apart
    (cached_*), bytes right. Re-registering while batches are in flight waits for their passes first; after
    unregistering, the pass reads plain fds and buffers; a registered fd closed and reused reads the new file."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the page-cache pass has no helper threads, the feeding thread probes alone")
    n, size = 256, 4096
    data = np.random.default_rng(3).integers(0, 256, n * size, dtype=np.uint8)
    path, other = tmp_path / "warm.bin", tmp_path / "other.bin"
    path.write_bytes(data.tobytes())  # just written: in the page cache
    other.write_bytes(data[::-1].tobytes())
    arena = aligned(4 * n * size)
    slots = [arena[k * n * size:(k + 1) * n * size] for k in range(4)]
    fd = open_file(path)
    try:
        with IOEngine(backend="uring", threads=4) as eng:
            assert eng.stats["cached_rings"] >= 2  # the feeding thread's and at least one helper's

            def read(slot: np.ndarray, seed: int, f: int = fd) -> tuple[int, np.ndarray]:
                offsets, addrs = _permuted_reads(n, size, seed, slot)
                return eng.submit_reads(f, offsets, size, addrs), offsets

            def counts() -> tuple[int, int, int]:
                s = eng.stats
                return s["cached_ring_ops"], s["cached_fixed_buffer_ops"], s["cached_fixed_file_ops"]

            ticket, offsets = read(slots[0], 0)
            assert (eng.wait(ticket) == size).all()
            assert np.array_equal(slots[0], _expected(data, offsets, size))
            assert counts() == (n, 0, 0)

            eng.register_files([fd])
            eng.register_buffers([arena])
            ticket, offsets = read(slots[1], 1)
            eng.wait(ticket)
            assert np.array_equal(slots[1], _expected(data, offsets, size))
            assert counts() == (2 * n, n, n)

            in_flight = [read(slots[k], 10 + k) for k in range(3)]
            eng.unregister_buffers()  # collects the passes in flight before their rings change
            for (ticket, offsets), slot in zip(in_flight, slots):
                assert (eng.wait(ticket) == size).all()
                assert np.array_equal(slot, _expected(data, offsets, size))
            assert counts() == (5 * n, 4 * n, 4 * n)  # all three read into the registered buffers

            ticket, offsets = read(slots[3], 4)
            eng.wait(ticket)
            assert np.array_equal(slots[3], _expected(data, offsets, size))
            assert counts() == (6 * n, 4 * n, 5 * n)

            os.close(fd)  # still registered: the number comes back for another file
            fd2 = open_file(other)
            try:
                assert fd2 == fd
                ticket, offsets = read(slots[0], 5, fd2)
                eng.wait(ticket)
                assert np.array_equal(slots[0], _expected(data[::-1], offsets, size))
                assert counts() == (7 * n, 4 * n, 5 * n)  # not through the old file's slot
            finally:
                eng.unregister_files()
                os.close(fd2)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


@pytest.mark.parametrize("backend", ["pread", "uring"])
def test_an_engine_is_refused_in_a_forked_child_and_still_serves_its_parent(tmp_path, backend):
    """A fork is seen by the at-fork counter (no getpid per call): the child gets the clear error, the parent's
    engine keeps reading."""
    if backend == "uring" and uring_unavailable():
        pytest.skip(uring_unavailable())
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 16)
    fd = open_file(str(path))
    buf = np.zeros(4096, np.uint8)
    with IOEngine(backend=backend) as engine:
        read = lambda: engine.read_batch(fd, [0], [4096], [buf.ctypes.data])  # noqa: E731
        read()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what the engine did, exit without running the parent's cleanups
            try:
                read()
                message = b"read"
            except RuntimeError as e:
                message = str(e).encode()
            os.write(w, message)
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as child:
            assert b"cannot be used after fork()" in child.read()
        buf[:] = 0
        assert read()[0] == 4096 and bytes(buf[:256]) == bytes(range(256))
    os.close(fd)
