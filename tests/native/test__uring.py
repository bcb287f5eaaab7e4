"""foresight._uring, the raw cffi layer: C return codes, argument backstops and batch mechanics.

These call the C API directly (no Python wrapper), on both backends, against real files.
"""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from foresight._uring import ffi, lib

BACKENDS = {"uring": lib.FS_BACKEND_URING, "pread": lib.FS_BACKEND_PREAD}


@pytest.fixture(params=sorted(BACKENDS))
def eng(request):
    opts = ffi.new("struct fs_engine_opts *")
    opts.backend = BACKENDS[request.param]
    opts.queue_depth = 4
    out = ffi.new("struct fs_engine **")
    ret = lib.fs_engine_create(opts, out)
    if ret < 0 and request.param == "uring":  # not compiled in (-ENOSYS) or refused by the kernel
        pytest.skip(f"io_uring unavailable here: {os.strerror(-ret)}")
    assert ret == 0
    yield out[0]
    lib.fs_engine_destroy(out[0])


@pytest.fixture
def file_fd(tmp_path):
    data = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    yield fd, data
    os.close(fd)


class Batch:
    """A struct fs_batch over numpy arrays that stay alive with this object."""

    def __init__(self, op, fds, offsets, lengths, addrs, flags=0):
        self.arrays = [np.ascontiguousarray(fds, np.int32), np.ascontiguousarray(offsets, np.int64),
                       np.ascontiguousarray(lengths, np.int64), np.ascontiguousarray(addrs, np.uint64)]
        self.results = np.full(len(self.arrays[1]), -12345, np.int64)
        self.c = ffi.new("struct fs_batch *")
        self.c.op, self.c.flags, self.c.n = op, flags, len(self.results)
        self.keep = [ffi.from_buffer(t, a) for t, a in zip(("int32_t[]", "int64_t[]", "int64_t[]", "uint64_t[]"),
                                                             self.arrays)]
        self.keep.append(ffi.from_buffer("int64_t[]", self.results, require_writable=True))
        self.c.fds, self.c.offsets, self.c.lengths, self.c.addrs, self.c.results = self.keep


def test_constants_and_build():
    assert lib.fs_io_have_liburing() in (0, 1)
    assert lib.FS_OP_READ != lib.FS_OP_WRITE
    assert lib.FS_DIRECT_ALIGN == 512
    assert lib.FS_MAX_REGISTERED_BUFFER == 1 << 30


def test_zeroed_options_mean_defaults():
    out = ffi.new("struct fs_engine **")
    assert lib.fs_engine_create(ffi.NULL, out) == 0
    info = ffi.new("struct fs_engine_info *")
    assert lib.fs_engine_info(out[0], info) == 0
    assert info.backend in (lib.FS_BACKEND_URING, lib.FS_BACKEND_PREAD)
    if info.backend == lib.FS_BACKEND_URING:
        assert info.queue_depth == 64 and info.nowait == 1
    lib.fs_engine_destroy(out[0])
    lib.fs_engine_destroy(ffi.NULL)  # a no-op, like free(NULL)


@pytest.mark.parametrize("field,value", [("backend", 7), ("queue_depth", 5000), ("threads", 1000)])
def test_create_rejects_bad_options(field, value):
    opts = ffi.new("struct fs_engine_opts *")
    setattr(opts, field, value)
    out = ffi.new("struct fs_engine **")
    assert lib.fs_engine_create(opts, out) == -errno.EINVAL
    assert out[0] == ffi.NULL


def test_run_returns_failed_count_and_per_request_results(eng, file_fd):
    fd, data = file_fd
    buf = np.zeros(300, np.uint8)
    a = buf.ctypes.data
    b = Batch(lib.FS_OP_READ, [fd, fd, -1, fd, fd], [0, 1000, 0, len(data) - 2, 5],
              [100, 100, 1, 10, 0], [a, a + 100, a, a + 200, 0])
    assert lib.fs_engine_run(eng, b.c) == 2
    assert b.results.tolist() == [100, 100, -errno.EBADF, -errno.ENODATA, 0]
    assert np.array_equal(buf[:100], data[:100]) and np.array_equal(buf[100:200], data[1000:1100])
    b = Batch(lib.FS_OP_READ, [fd], [len(data) - 2], [10], [a], flags=lib.FS_BATCH_ALLOW_EOF)
    assert lib.fs_engine_run(eng, b.c) == 0 and b.results.tolist() == [2]


def test_request_checks(eng, file_fd):
    fd, _ = file_fd
    buf = np.zeros(16, np.uint8)
    a = buf.ctypes.data
    b = Batch(lib.FS_OP_READ, [fd, fd, fd, fd], [-1, 0, 2**63 - 2, 0], [1, -1, 8, 4], [a, a, a, 0])
    assert lib.fs_engine_run(eng, b.c) == 4
    assert b.results.tolist() == [-errno.EINVAL, -errno.EINVAL, -errno.EINVAL, -errno.EFAULT]


def test_batch_backstops(eng):
    b = ffi.new("struct fs_batch *")
    b.op, b.n = 9, 0
    assert lib.fs_engine_run(eng, b) == -errno.EINVAL
    b.op, b.n = lib.FS_OP_READ, -1
    assert lib.fs_engine_run(eng, b) == -errno.EINVAL
    b.n = 3  # arrays NULL
    assert lib.fs_engine_run(eng, b) == -errno.EINVAL
    b.n, b.flags = 0, 0x80
    assert lib.fs_engine_run(eng, b) == -errno.EINVAL
    b.flags = 0
    assert lib.fs_engine_run(eng, b) == 0
    assert lib.fs_engine_run(eng, ffi.NULL) == -errno.EINVAL


def test_tickets(eng, file_fd):
    fd, data = file_fd
    buf = np.zeros(4096 * 64, np.uint8)
    offsets = np.arange(64, dtype=np.int64) * 4096
    batches = [Batch(lib.FS_OP_READ, np.full(64, fd), offsets, np.full(64, 4096),
                     buf.ctypes.data + offsets.astype(np.uint64)) for _ in range(2)]
    tickets = []
    for b in batches:
        t = ffi.new("uint64_t *")
        assert lib.fs_engine_submit(eng, b.c, t) == 0
        tickets.append(t[0])
    assert tickets[0] != tickets[1]
    assert lib.fs_engine_poll(eng, tickets[1]) in (0, 1)
    assert lib.fs_engine_wait(eng, tickets[1]) == 0
    assert lib.fs_engine_wait(eng, tickets[0]) == 0
    assert lib.fs_engine_wait(eng, tickets[0]) == -errno.ENOENT
    assert lib.fs_engine_poll(eng, tickets[0]) == -errno.ENOENT
    assert np.array_equal(buf, data[: len(buf)])
    info = ffi.new("struct fs_engine_info *")
    lib.fs_engine_info(eng, info)
    assert info.requests == 128 and info.bytes == 128 * 4096 and info.failed == 0


def test_write_and_fsync(eng, file_fd):
    fd, data = file_fd
    src = np.full(5000, 7, np.uint8)
    b = Batch(lib.FS_OP_WRITE, [fd], [len(data)], [5000], [src.ctypes.data])
    assert lib.fs_engine_run(eng, b.c) == 0 and b.results.tolist() == [5000]
    assert lib.fs_fsync(fd, 0) == 0 and lib.fs_fsync(fd, 1) == 0
    assert os.pread(fd, 5000, len(data)) == bytes(src)
    assert lib.fs_fsync(-1, 0) == -errno.EBADF


def test_registration_backstops(eng, file_fd):
    fd, _ = file_fd
    z = ffi.new("uint64_t[1]", [0])
    one = ffi.new("uint64_t[1]", [4096])
    assert lib.fs_engine_register_buffers(eng, z, one, 1) == -errno.EINVAL  # NULL address
    assert lib.fs_engine_register_buffers(eng, one, z, 1) == -errno.EINVAL  # zero length
    assert lib.fs_engine_register_buffers(eng, ffi.NULL, ffi.NULL, 1) == -errno.EINVAL
    assert lib.fs_engine_register_buffers(eng, ffi.NULL, ffi.NULL, 0) == 0
    fds = ffi.new("int32_t[2]", [fd, fd])
    assert lib.fs_engine_register_files(eng, fds, 2) == 0
    assert lib.fs_engine_register_files(eng, fds, 2) == 0  # replaces
    assert lib.fs_engine_register_files(eng, ffi.NULL, 0) == 0
    assert lib.fs_engine_register_files(eng, ffi.NULL, 3) == -errno.EINVAL


def test_destroy_with_batches_outstanding(file_fd):
    """Destroy cancels requests not started and waits for those in flight; nothing leaks or crashes."""
    fd, _ = file_fd
    for backend in BACKENDS.values():
        opts = ffi.new("struct fs_engine_opts *")
        opts.backend, opts.queue_depth, opts.threads, opts.disable_nowait = backend, 1, 1, 1
        out = ffi.new("struct fs_engine **")
        ret = lib.fs_engine_create(opts, out)
        if ret < 0 and backend == lib.FS_BACKEND_URING:
            continue  # io_uring unavailable here; the pread backend was still checked
        assert ret == 0
        buf = np.zeros(4096 * 500, np.uint8)
        offsets = np.zeros(500, np.int64)
        b = Batch(lib.FS_OP_READ, np.full(500, fd), offsets, np.full(500, 4096),
                  buf.ctypes.data + np.arange(500, dtype=np.uint64) * 4096)
        t = ffi.new("uint64_t *")
        assert lib.fs_engine_submit(out[0], b.c, t) == 0
        lib.fs_engine_destroy(out[0])
        assert set(np.unique(b.results).tolist()) <= {4096, -errno.ECANCELED}


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("sanitizer", ["address,undefined", "thread"])
def test_c_program_under_sanitizers(tmp_path, sanitizer):
    """tests/c/test_fs_io.c on both backends under ASan+LSan+UBSan, then TSan: leaks, races, UB."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    io = os.path.join(ROOT, "csrc", "io")
    uring = os.path.exists("/usr/include/liburing.h")
    exe = str(tmp_path / "test_fs_io")
    cmd = ["gcc", "-g", "-O1", f"-fsanitize={sanitizer}", "-D_GNU_SOURCE", f"-I{io}",
           *[os.path.join(io, f) for f in ("fs_io.c", "fs_uring.c", "fs_pool.c", "fs_cached.c")],
           os.path.join(ROOT, "tests", "c", "test_fs_io.c"), "-lpthread", "-o", exe]
    if uring:
        cmd[4:4] = ["-DFS_HAVE_LIBURING=1"]
        cmd.append("-luring")
    build = subprocess.run(cmd, capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"compiler lacks -fsanitize={sanitizer}")
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1"})
    if run.returncode == 77:
        pytest.skip("io_uring is not available here (pread backend passed)")
    assert run.returncode == 0, run.stderr
