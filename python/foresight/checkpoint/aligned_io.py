"""Large aligned reads and writes between page-aligned host buffers and checkpoint files, and file copies.

All I/O goes through foresight's C I/O engine (io_uring, or its pread/pwrite thread pool where io_uring is
missing or refused). A region is split into ``chunk_bytes`` pieces submitted together, so the device sees a
deep queue of large sequential requests.
O_DIRECT is used where the file system supports it (buffers and offsets are 4096-aligned by the layout).

Example::

    fio = FileIO()
    fd = fio.open(path, write=True)
    fio.write(fd, buffer_view, file_offset=0)
    copy_file(src, dst, fio)               # one file to another tier, fsynced
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from foresight.errors import CheckpointError
from foresight.io import IOEngine

DEFAULT_CHUNK = 8 << 20
_BOUNCE = 64 << 20  # bytes of the aligned bounce buffer of copy_file
PIECES_AHEAD = 3  # pieces of a reported write in flight at once (FileIO.write_reporting)


def buffer_address(view: memoryview) -> int:
    """Address of a writable, C-contiguous buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class FileIO:
    """Chunked, parallel region I/O; ``backend`` says which implementation is in use."""

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK, threads: int = 4, backend: str = "auto") -> None:
        if chunk_bytes <= 0 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        # Keep enough large requests in flight to saturate the device.
        self._engine = IOEngine(backend=backend, queue_depth=64, threads=threads,
                                max_inflight_bytes=16 * chunk_bytes)
        self.backend = f"engine:{self._engine.backend}"

    def close(self) -> None:
        self._engine.close()

    # -- files -------------------------------------------------------------------------------------
    def open(self, path: str, *, write: bool = False, direct: bool = True) -> tuple[int, bool]:
        """Open ``path`` (created/truncated when writing); return ``(fd, direct_in_use)``."""
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        flags |= os.O_CLOEXEC
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise CheckpointError(f"cannot open: {e.strerror}", path=path) from e
        try:
            return os.open(path, flags, 0o644), False
        except OSError as e:
            raise CheckpointError(f"cannot open: {e.strerror}", path=path) from e

    # -- data --------------------------------------------------------------------------------------
    def write(self, fd: int, view: memoryview, *, file_offset: int = 0, path: str | None = None) -> None:
        """Write all of ``view`` at ``file_offset``."""
        self._run(fd, view, file_offset, write=True, path=path)

    def write_reporting(self, fd: int, view: memoryview, ends: Sequence[int], on_written: Callable[[int], None], *,
                        path: str | None = None, ahead: int | None = None, depth: int = PIECES_AHEAD,
                        before: Callable[[int], Any] | None = None) -> None:
        """Write all of ``view`` at offset 0 in pieces ending at ``ends`` (increasing, the last ``len(view)``;
        4 KiB-aligned for direct I/O), calling ``on_written(end)`` as each lands, in file order: what a replicated
        save reports so its units leave while the rest is written. At most ``depth`` pieces and ``ahead`` bytes
        (default ``8 * chunk_bytes``; at least one piece) are in flight: with the whole file submitted at once the
        device shares itself among all of it and the first piece lands only when most of the file has (its unit
        then leaves late; 60 ms into a 128 MiB save here). ``before(end)`` is called before a piece ending at
        ``end`` is submitted (a snapshot still being copied: it waits for those bytes). A failure waits for the
        writes still in flight (the buffer may be reused) and raises the first."""
        total = len(view)
        if not ends or ends[-1] != total or any(b <= a for a, b in zip([0, *ends], ends)):
            raise ValueError(f"piece ends must increase from 0 to the {total} bytes written, got {list(ends)[:8]}...")
        ahead = 8 * self.chunk_bytes if ahead is None else ahead
        pieces = list(zip([0, *ends[:-1]], ends))
        flying: deque[tuple[int, int, Any]] = deque()  # (end, bytes, token), oldest first
        nxt = in_flight = 0
        try:
            while flying or nxt < len(pieces):
                while nxt < len(pieces) and (not flying or (len(flying) < depth and
                                                            in_flight + pieces[nxt][1] - pieces[nxt][0] <= ahead)):
                    off, end = pieces[nxt]
                    if before is not None:
                        before(end)
                    flying.append((end, end - off, self.submit_write(fd, view[off:end], file_offset=off, path=path)))
                    in_flight += end - off
                    nxt += 1
                end, n, token = flying.popleft()
                in_flight -= n
                self.wait(token)
                on_written(end)
        except BaseException:
            for _, _, rest in flying:  # never leave writes in flight into a buffer about to be reused
                try:
                    self.wait(rest)
                except CheckpointError:
                    pass  # the first failure is the one reported
            raise

    def read(self, fd: int, view: memoryview, *, file_offset: int = 0, path: str | None = None) -> None:
        """Fill all of ``view`` from ``file_offset``; a short file raises :class:`CheckpointError`."""
        self._run(fd, view, file_offset, write=False, path=path)

    def submit_write(self, fd: int, view: memoryview, *, file_offset: int = 0, path: str | None = None) -> Any:
        """Start writing all of ``view`` at ``file_offset``; pass the returned token to :meth:`wait`."""
        return self._start(fd, view, file_offset, write=True, path=path)

    def submit_read(self, fd: int, view: memoryview, *, file_offset: int = 0, path: str | None = None) -> Any:
        """Start filling ``view`` from ``file_offset``; pass the returned token to :meth:`wait`."""
        return self._start(fd, view, file_offset, write=False, path=path)

    def wait(self, token: Any) -> None:
        """Finish a :meth:`submit_read`; raises :class:`CheckpointError` naming the file on failure."""
        kind, handle, lengths, write, path = token
        what = "write" if write else "read"
        if kind == "none":
            return
        try:
            got = self._engine.wait(handle)
        except OSError as e:
            raise CheckpointError(f"{what} failed: {e}", path=path) from e
        if not write and np.any(np.asarray(got) != lengths):
            raise CheckpointError("file is shorter than its index says", path=path)

    def _run(self, fd: int, view: memoryview, file_offset: int, *, write: bool, path: str | None) -> None:
        self.wait(self._start(fd, view, file_offset, write=write, path=path))

    def _start(self, fd: int, view: memoryview, file_offset: int, *, write: bool, path: str | None) -> Any:
        n = len(view)
        if n == 0:
            return ("none", None, None, write, path)
        starts = np.arange(0, n, self.chunk_bytes, dtype=np.int64)
        lengths = np.minimum(self.chunk_bytes, n - starts)
        fds = np.full(len(starts), fd, dtype=np.int32)
        addrs = np.uint64(buffer_address(view)) + starts.astype(np.uint64)
        submit = self._engine.submit_writes if write else self._engine.submit_reads
        try:
            ticket = submit(fds, starts + file_offset, lengths, addrs)
        except OSError as e:
            raise CheckpointError(f"{'write' if write else 'read'} failed: {e}", path=path) from e
        return ("engine", ticket, lengths, write, path)


def copy_file(src: str, dst: str, fio: FileIO | None) -> None:
    """Copy one file and fsync it; large page-multiple files go through an aligned bounce buffer with O_DIRECT
    (buffered writes + fsync run at a fraction of the disk's speed here). Used by the tier drains of the
    Checkpointer and of the DCP writer."""
    size = os.stat(src).st_size
    if fio is None or size < (1 << 20) or size % 4096:
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        return
    bounce = mmap.mmap(-1, min(_BOUNCE, size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    rfd, _ = fio.open(src)
    try:
        wfd, _ = fio.open(dst, write=True)
        try:
            os.posix_fallocate(wfd, 0, size)
            pos = 0
            while pos < size:
                n = min(len(bounce), size - pos)
                view = memoryview(bounce)[:n]
                fio.read(rfd, view, file_offset=pos, path=src)
                fio.write(wfd, view, file_offset=pos, path=dst)
                view.release()
                pos += n
            os.fsync(wfd)
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)
        bounce.close()
