"""Batched file I/O through foresight's C engine: io_uring, or a pread/pwrite thread pool.

One call moves a whole batch of extents (numpy arrays of fds, offsets, lengths and buffer
addresses); the C side keeps ``queue_depth`` requests in flight and refills as they complete, with
the GIL released throughout. ``submit_reads``/``wait`` let a scheduler keep several batches in
flight. Every failed request raises :class:`~foresight.errors.IOEngineError` naming the file path,
offset, length, request index and errno.

Example::

    import numpy as np
    from foresight.io import IOEngine, open_file

    fd = open_file("shard-00000.bin")
    buf = np.empty(3 * 4096, np.uint8)
    offsets = np.array([0, 81920, 4096], np.int64)
    lengths = np.full(3, 4096, np.int64)
    addrs = buf.ctypes.data + np.arange(3, dtype=np.uint64) * 4096
    with IOEngine() as eng:                      # backend="auto": io_uring where it works
        got = eng.read_batch(fd, offsets, lengths, addrs)   # bytes per request
        t = eng.submit_reads(fd, offsets, lengths, addrs)   # ... compute ...
        eng.wait(t)

Backends: ``"uring"`` (registered files, fixed buffers, optional SQPOLL, and a
``preadv2(RWF_NOWAIT)`` pass that serves page-cache hits without the ring), ``"pread"`` (thread
pool), ``"auto"`` (io_uring unless it is missing or refused, e.g. EPERM from a seccomp profile; the
``FORESIGHT_IO_BACKEND`` environment variable overrides ``"auto"``). ``engine.backend`` says which
one runs, and the choice is logged once per process.

O_DIRECT (``open_file(path, direct=True)``): offsets, lengths and buffer addresses must be multiples
of the device's logical block size (use 4096); misaligned requests fail with EINVAL naming the
request, nothing falls back silently to buffered I/O. Transfers rounded up past the end of a file
pass ``needed=`` (or ``allow_eof=True``) so a short final read is accepted.

Threads: an engine may be shared (calls are serialized by a mutex in C), but a thread waiting on
the io_uring backend blocks other callers of that engine; use one engine per thread for parallel
I/O. Don't use an engine in a child process after ``fork``. Buffers and registered fds must stay
valid until the batch is waited for, or the engine is closed (``close`` waits for I/O in flight).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from foresight._closing import Closing
from foresight._native import load
from foresight.errors import IOEngineError, check

_uring = load("_uring")
ffi, lib = _uring.ffi, _uring.lib

log = logging.getLogger("foresight.io")

BACKENDS = {"auto": lib.FS_BACKEND_AUTO, "uring": lib.FS_BACKEND_URING, "pread": lib.FS_BACKEND_PREAD}
_BACKEND_NAMES = {lib.FS_BACKEND_URING: "uring", lib.FS_BACKEND_PREAD: "pread"}
ENV_BACKEND = "FORESIGHT_IO_BACKEND"
DIRECT_ALIGN = 4096  # what we ask of O_DIRECT callers; C checks the 512-byte minimum up front

_logged: set[tuple[str, int]] = set()
_log_lock = threading.Lock()

# Forks of this process so far, as seen by a child: an engine made before a fork is refused in the child. A counter
# bumped at fork is read per call for free, where os.getpid() is a system call on every engine call.
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


def get_backend(name: str) -> int:
    """The C constant for a backend name; ValueError lists the allowed names."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown I/O backend {name!r}; allowed: {sorted(BACKENDS)}") from None


def _resolve_backend(backend: str) -> str:
    get_backend(backend)
    if backend == "auto":
        forced = os.environ.get(ENV_BACKEND, "").strip()
        if forced:
            try:
                get_backend(forced)
            except ValueError:
                raise ValueError(f"{ENV_BACKEND}={forced!r} is not a backend; allowed: {sorted(BACKENDS)}") from None
            return forced
    return backend


def _uring_unavailable(err: int) -> str:
    """Why io_uring could not be used, in words."""
    if not lib.fs_io_have_liburing():
        return "io_uring unavailable: foresight was built without liburing (apt-get install liburing-dev, rebuild)"
    return (f"io_uring unavailable ({errno.errorcode.get(err, err)}: {os.strerror(err)}; a seccomp profile, "
            "kernel.io_uring_disabled or an old kernel can refuse it)")


def _log_choice(name: str, uring_errno: int, sqpoll_wanted: bool, sqpoll_on: bool) -> None:
    with _log_lock:
        key = (name, uring_errno)
        if key in _logged:
            return
        _logged.add(key)
    if uring_errno:
        log.warning("foresight I/O: %s, using the pread thread pool", _uring_unavailable(uring_errno))
    else:
        log.info("foresight I/O backend: %s", name)
    if sqpoll_wanted and not sqpoll_on and name == "uring":
        log.warning("foresight I/O: SQPOLL was refused by the kernel; running without it")


def _error(message: str, err: int, **context: Any) -> IOEngineError:
    return IOEngineError(message, errno_=err, **context)


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _is_direct(fd: int) -> bool:
    try:
        import fcntl

        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except OSError:
        return False


def _int_array(name: str, values: Any, dtype: type, n: int | None) -> np.ndarray:
    """Contiguous array of ``dtype``; scalars broadcast to ``n``; integer input only, range-checked."""
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        return values  # what the checks below return for it, without their calls (the per-step case)
    a = np.asarray(values)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
    if a.ndim == 0:
        if n is None:
            raise ValueError(f"{name} must be a 1-D array")
        a = np.full(n, a, dtype=dtype)
    elif a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.dtype != dtype:
        info = np.iinfo(dtype)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise ValueError(f"{name} out of range for {np.dtype(dtype).name}")
        a = a.astype(dtype)
    return np.ascontiguousarray(a)


@dataclass
class _Batch:
    """A submitted batch: keeps every array C points into alive until it is waited for."""

    op: str
    fds: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    addrs: np.ndarray
    results: np.ndarray
    needed: np.ndarray | None
    cdata: Any  # the struct fs_batch and the cffi buffers


class IOEngine(Closing):
    """Batched reads and writes; see the module docstring. Keyword-only options.

    Args:
        backend: ``"auto"``, ``"uring"`` or ``"pread"``. ``"uring"`` raises if io_uring fails here.
        queue_depth: requests in flight on the io_uring backend (1..4096).
        threads: workers of the pread backend (1..256); on io_uring, the threads (at most one per CPU, the
            caller's included) that serve a batch's page-cache hits before the ring (``nowait``).
        sqpoll: ask io_uring for a kernel submission thread (falls back to none if refused).
        nowait: serve page-cache hits of buffered reads with ``preadv2(RWF_NOWAIT)`` first. Batches of 8 requests
            or 2 MiB are served on helper threads behind :meth:`submit_reads` (``wait`` takes part), so warm reads
            copy at the pread pool's speed while the caller does other work; each batch's pass is queued at submit,
            so with several batches in flight the helpers copy one after the other without waiting for a call.
        max_inflight_bytes: cap on bytes in flight, so large extents don't need a deep queue.
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        queue_depth: int = 64,
        threads: int = 4,
        sqpoll: bool = False,
        nowait: bool = True,
        max_inflight_bytes: int = 64 << 20,
    ) -> None:
        name = _resolve_backend(backend)
        if not 1 <= int(queue_depth) <= 4096:
            raise ValueError(f"queue_depth must be in 1..4096, got {queue_depth}")
        if not 1 <= int(threads) <= 256:
            raise ValueError(f"threads must be in 1..256, got {threads}")
        if int(max_inflight_bytes) < 1:
            raise ValueError(f"max_inflight_bytes must be positive, got {max_inflight_bytes}")
        opts = ffi.new("struct fs_engine_opts *")
        opts.backend = BACKENDS[name]
        opts.queue_depth = int(queue_depth)
        opts.threads = int(threads)
        opts.sqpoll = 1 if sqpoll else 0
        opts.disable_nowait = 0 if nowait else 1
        opts.max_inflight_bytes = int(max_inflight_bytes)
        out = ffi.new("struct fs_engine **")
        ret = lib.fs_engine_create(opts, out)
        if ret < 0 and name == "uring":
            raise _error(_uring_unavailable(-ret), -ret, backend=name)
        check(ret, "fs_engine_create", backend=name)
        self._ptr = out[0]
        self._pid = os.getpid()
        self._forks = _forks[0]
        # _enter/_leave take the plain lock (a C call); close() waits on the condition over it
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._active = 0
        self._pending: dict[int, _Batch] = {}
        self._orphans: list[_Batch] = []
        self._registered: list[Any] = []
        info = self._info()
        self.backend: str = _BACKEND_NAMES[info.backend]
        self.fallback_reason: str | None = (
            f"{errno.errorcode.get(info.uring_errno, info.uring_errno)}: {os.strerror(info.uring_errno)}"
            if info.uring_errno else None
        )
        self.queue_depth = int(info.queue_depth)
        self.sqpoll = bool(info.sqpoll)
        _log_choice(self.backend, info.uring_errno, bool(sqpoll), self.sqpoll)

    # -- lifetime ------------------------------------------------------------------------------------
    def _enter(self):
        with self._lock:
            if self._ptr is None:
                raise ValueError("I/O engine is closed")
            if _forks[0] != self._forks and os.getpid() != self._pid:
                raise RuntimeError("an I/O engine cannot be used after fork(); create one in the child")
            self._active += 1
            return self._ptr

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._ptr is None:  # close() waits for the calls inside C
                self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        """Cancel requests not started, wait for those in flight, free the ring/threads. Idempotent."""
        with self._cv:
            if self._ptr is None:
                return
            ptr, self._ptr = self._ptr, None  # new calls fail from here on
            while self._active:  # calls already inside C finish first
                self._cv.wait()
        if os.getpid() == self._pid:  # a forked child must not join its parent's threads
            lib.fs_engine_destroy(ptr)
        self._pending.clear()
        self._orphans.clear()
        self._registered.clear()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"queue_depth={self.queue_depth}"
        return f"IOEngine(backend={self.backend!r}, {state})"

    # -- batches --------------------------------------------------------------------------------------
    def read_batch(self, fds, offsets, lengths, addrs, *, allow_eof: bool = False, needed=None) -> np.ndarray:
        """Read every extent into its address; returns bytes read per request (int64).

        ``fds`` may be one int for all requests. With ``needed`` (per-request minimum, e.g. the
        coalescer's ``t_needed``) or ``allow_eof``, a read may stop early at end of file.
        """
        batch = self._make("read", fds, offsets, lengths, addrs, allow_eof, needed)
        return self._run(batch)

    def write_batch(self, fds, offsets, lengths, addrs) -> np.ndarray:
        """Write every extent from its address; returns bytes written per request (int64)."""
        batch = self._make("write", fds, offsets, lengths, addrs, False, None)
        return self._run(batch)

    def submit_reads(self, fds, offsets, lengths, addrs, *, allow_eof: bool = False, needed=None) -> int:
        """Start a read batch and return its ticket for :meth:`poll`/:meth:`wait`."""
        return self._submit(self._make("read", fds, offsets, lengths, addrs, allow_eof, needed))

    def submit_writes(self, fds, offsets, lengths, addrs) -> int:
        """Start a write batch and return its ticket for :meth:`poll`/:meth:`wait`."""
        return self._submit(self._make("write", fds, offsets, lengths, addrs, False, None))

    def poll(self, ticket: int) -> bool:
        """Make progress without blocking; True once the batch is complete (then call :meth:`wait`)."""
        ptr = self._enter()
        try:
            if ticket not in self._pending:
                raise KeyError(f"unknown ticket {ticket}")
            ret = lib.fs_engine_poll(ptr, ticket)
        finally:
            self._leave()
        return bool(check(ret, "fs_engine_poll", ticket=ticket))

    def wait(self, ticket: int) -> np.ndarray:
        """Block until the batch is done; returns bytes per request or raises IOEngineError."""
        ptr = self._enter()
        try:
            batch = self._pending.get(ticket)
            if batch is None:
                raise KeyError(f"unknown ticket {ticket} (already waited for?)")
            failed = lib.fs_engine_wait(ptr, ticket)
        finally:
            self._leave()
        if failed >= 0 or failed == -errno.ENOENT:
            self._pending.pop(ticket, None)
        # otherwise the ticket is still live in C (engine failure, or another thread waits for it):
        # its arrays stay referenced until close() has drained it
        return self._finish(batch, failed)

    def _make(self, op, fds, offsets, lengths, addrs, allow_eof, needed) -> _Batch:
        offsets = _int_array("offsets", offsets, np.int64, None)
        n = offsets.shape[0]  # 1-D arrays from here on: shapes, not len() calls (this runs once per step)
        lengths = _int_array("lengths", lengths, np.int64, n)
        fds = _int_array("fds", fds, np.int32, n)
        addrs = _int_array("addrs", addrs, np.uint64, n)
        if not fds.shape[0] == lengths.shape[0] == addrs.shape[0] == n:
            raise ValueError(
                f"fds, offsets, lengths and addrs must have one entry per request: got {len(fds)}, {n}, "
                f"{len(lengths)}, {len(addrs)}"
            )
        if needed is not None:
            needed = _int_array("needed", needed, np.int64, n)
            if needed.shape[0] != n:
                raise ValueError(f"needed must have {n} entries, got {len(needed)}")
        results = np.empty(n, dtype=np.int64)
        b = ffi.new("struct fs_batch *")
        b.op = lib.FS_OP_READ if op == "read" else lib.FS_OP_WRITE
        b.flags = lib.FS_BATCH_ALLOW_EOF if (allow_eof or needed is not None) else 0
        b.n = n
        keep = [b]
        if n:
            bufs = [ffi.from_buffer("int32_t[]", fds), ffi.from_buffer("int64_t[]", offsets),
                    ffi.from_buffer("int64_t[]", lengths), ffi.from_buffer("uint64_t[]", addrs),
                    ffi.from_buffer("int64_t[]", results, require_writable=True)]
            b.fds, b.offsets, b.lengths, b.addrs, b.results = bufs
            keep += bufs
        return _Batch(op, fds, offsets, lengths, addrs, results, needed, keep)

    def _run(self, batch: _Batch) -> np.ndarray:
        ptr = self._enter()
        try:
            failed = lib.fs_engine_run(ptr, batch.cdata[0])
            if failed < 0:  # the batch may still be queued in C: keep its arrays until close()
                self._orphans.append(batch)
        finally:
            self._leave()
        return self._finish(batch, failed)

    def _submit(self, batch: _Batch) -> int:
        ticket = ffi.new("uint64_t *")
        ptr = self._enter()
        try:
            ret = lib.fs_engine_submit(ptr, batch.cdata[0], ticket)
            check(ret, "fs_engine_submit", requests=len(batch.offsets))
            t = int(ticket[0])
            self._pending[t] = batch
        finally:
            self._leave()
        return t

    def _finish(self, batch: _Batch, failed: int) -> np.ndarray:
        check(failed, "fs_engine_wait", requests=len(batch.offsets))
        results = batch.results
        if failed:
            bad = np.flatnonzero(results < 0)
            self._raise(batch, int(bad[0]), len(bad), -int(results[bad[0]]))
        if batch.needed is not None:
            short = results < batch.needed
            if short.any():  # the rare case pays for the indices
                short = np.flatnonzero(short)
                self._raise(batch, int(short[0]), len(short), errno.ENODATA)
        return results

    def _raise(self, batch: _Batch, i: int, nbad: int, err: int) -> None:
        fd, off, length = int(batch.fds[i]), int(batch.offsets[i]), int(batch.lengths[i])
        path = _fd_path(fd)
        ctx: dict[str, Any] = {}
        if err == errno.ENODATA and batch.op == "read":
            msg = "read past end of file"
            try:
                ctx["file_size"] = os.fstat(fd).st_size
            except OSError:
                pass
        elif err == errno.EINVAL and _is_direct(fd):
            msg = (f"O_DIRECT {batch.op} not aligned: offset, length and buffer address must be multiples of the "
                   f"device block size (use {DIRECT_ALIGN})")
            ctx["addr"] = hex(int(batch.addrs[i]))
        elif err == errno.ECANCELED:
            msg = f"{batch.op} cancelled: the engine was closed first"
        else:
            msg = f"{batch.op} failed: {os.strerror(err)}"
        exc = _error(
            msg, err, path=path, fd=fd, offset=off, length=length, request=i,
            failed=f"{nbad} of {len(batch.offsets)}", **ctx,
        )
        exc.results = batch.results  # every request's outcome, for callers that want more than the first
        raise exc

    # -- registration -------------------------------------------------------------------------------
    def register_files(self, fds) -> None:
        """Register fds with the ring (requests keep naming plain fds; the engine uses the slots).

        They must stay open while registered: call :meth:`unregister_files` before closing them.
        """
        fds = _int_array("fds", fds, np.int32, None)
        ptr = self._enter()
        try:
            ret = lib.fs_engine_register_files(ptr, ffi.from_buffer("int32_t[]", fds), len(fds))
        finally:
            self._leave()
        check(ret, "fs_engine_register_files", files=len(fds))

    def unregister_files(self) -> None:
        ptr = self._enter()
        try:
            ret = lib.fs_engine_register_files(ptr, ffi.NULL, 0)
        finally:
            self._leave()
        check(ret, "fs_engine_register_files")

    def register_buffers(self, buffers: Iterable[Any]) -> None:
        """Register memory for READ_FIXED/WRITE_FIXED: ``(addr, nbytes)`` pairs or buffer objects.

        Buffer objects (numpy arrays, mmaps) are kept alive while registered; with raw addresses the
        caller must keep the memory mapped until :meth:`unregister_buffers` or :meth:`close`.
        Replaces any earlier registration.
        """
        addrs, lens, keep = [], [], []
        for b in buffers:
            if isinstance(b, tuple):
                addr, nbytes = (int(x) for x in b)
            else:
                cbuf = ffi.from_buffer(b, require_writable=True)
                addr, nbytes = int(ffi.cast("uintptr_t", cbuf)), len(cbuf)
                keep.append((b, cbuf))
            if addr <= 0 or nbytes <= 0:
                raise ValueError(f"buffer needs a positive address and size, got ({addr:#x}, {nbytes})")
            addrs.append(addr)
            lens.append(nbytes)
        a = np.asarray(addrs, dtype=np.uint64)
        n = np.asarray(lens, dtype=np.uint64)
        ptr = self._enter()
        try:
            ret = lib.fs_engine_register_buffers(
                ptr, ffi.from_buffer("uint64_t[]", a), ffi.from_buffer("uint64_t[]", n), len(a))
        finally:
            self._leave()
        if ret == -errno.ENOMEM:
            raise _error("registering buffers failed: out of locked memory (raise `ulimit -l`)",
                         errno.ENOMEM, buffers=len(a), nbytes=int(n.sum()))
        check(ret, "fs_engine_register_buffers", buffers=len(a), nbytes=int(n.sum()))
        self._registered = keep

    def unregister_buffers(self) -> None:
        ptr = self._enter()
        try:
            ret = lib.fs_engine_register_buffers(ptr, ffi.NULL, ffi.NULL, 0)
        finally:
            self._leave()
        check(ret, "fs_engine_register_buffers")
        self._registered = []

    # -- introspection --------------------------------------------------------------------------------
    def _info(self):
        info = ffi.new("struct fs_engine_info *")
        check(lib.fs_engine_info(self._ptr, info), "fs_engine_info")
        return info

    def _live_info(self):
        """The engine's counters read while it is open (``_info`` is for the constructor, before any use)."""
        ptr = self._enter()
        try:
            info = ffi.new("struct fs_engine_info *")
            check(lib.fs_engine_info(ptr, info), "fs_engine_info")
        finally:
            self._leave()
        return info

    def page_cache_counts(self) -> tuple[int, int]:
        """``(requests, nowait_hits)`` so far: requests completed, and those the page-cache pass served whole (a
        cheap pair for a caller deciding per batch, where :attr:`stats` builds the whole dict)."""
        info = self._live_info()
        return int(info.requests), int(info.nowait_hits)

    @property
    def stats(self) -> dict[str, Any]:
        """Backend, settings and counters (requests, bytes, nowait hits, fixed ops, requeues...)."""
        info = self._live_info()
        out: dict[str, Any] = {name: int(getattr(info, name)) for name, _ in ffi.typeof(info[0]).fields}
        out["backend"] = _BACKEND_NAMES[info.backend]
        return out


def open_file(path: str | os.PathLike, *, direct: bool = False, write: bool = False) -> int:
    """Open a file for the engine and return its fd (close it with ``os.close``).

    ``write=True`` opens read-write and creates the file if needed (no truncation). ``direct=True``
    adds O_DIRECT; a file system that refuses it raises IOEngineError naming the path.
    """
    flags = os.O_CLOEXEC | ((os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY)
    if direct:
        flags |= os.O_DIRECT
    try:
        return os.open(path, flags, 0o644)
    except OSError as e:
        if direct and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            raise _error("O_DIRECT is not supported by this file system", e.errno, path=os.fspath(path)) from e
        raise


def fsync(fd: int) -> None:
    """fsync(2), EINTR retried; IOEngineError names the file."""
    check(lib.fs_fsync(int(fd), 0), "fsync", path=_fd_path(int(fd)), fd=fd)


def fdatasync(fd: int) -> None:
    """fdatasync(2), EINTR retried; IOEngineError names the file."""
    check(lib.fs_fsync(int(fd), 1), "fdatasync", path=_fd_path(int(fd)), fd=fd)


__all__ = ["IOEngine", "open_file", "fsync", "fdatasync", "get_backend", "BACKENDS", "ENV_BACKEND"]
