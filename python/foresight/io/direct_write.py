"""Writes of received bytes into files, large ones past the page cache (O_DIRECT): the bucket cache's GETs and
a replication site's units of a save in progress.

A buffered write of a GET's bytes copies them into new page-cache pages: on the bench's VM that copy was most of
foresight's CPU on media (160 MB written: 0.25-0.95 CPU-s, against 0.01 CPU-s for the same bytes written
O_DIRECT, whose DMA takes no CPU copy; the host's first touch of fresh guest pages is what costs), more than
``obstore.get_ranges`` spends on the whole epoch. So the 4 KiB-aligned middle of a write of at least
``DIRECT_MIN`` bytes goes through an O_DIRECT descriptor, copied first into one of a few reused aligned bounce
buffers (O_DIRECT needs an aligned source; the client's buffers are not), and the unaligned head and tail (at
most 4 KiB each) are written buffered. Small writes (a token sample's GET) stay buffered: a synchronous disk
write each would cost more than the copy. The kernel keeps the two paths coherent (a direct write flushes and
drops the page-cache pages it covers), and every byte written is the object's own, so a neighbour sharing a
page is rewritten with its own bytes. A file system that refuses O_DIRECT (at the open or at the first write)
falls back to buffered writes (one WARNING line, ``stats["fallbacks"]``).

A buffered write goes in pieces of at most ``BUFFERED_PIECE`` bytes, cut at multiples of it in the file: the
kernel sizes the page-cache folios it allocates for a write by the write's length (ext4's large folios, up to
several MiB), and a folio of several MiB takes a whole high-order free block, which on a VM that reports free
memory to its host (virtio-balloon free page reporting, as the bench's Firecracker VM) is memory the host took
back: the copy into it paid the host's faults. Measured on the bench's VM (64 MiB written into a new file,
medians of 5-6): 16 MiB writes 2.8-5.1 CPU-s/GB (1.0-8.2), 1 MiB pieces 0.22 (0.16-0.27), 64 KiB pieces 0.36
(a syscall per piece starts to show).

Example::

    writer = CacheWriter(paths, fds)
    wrote = writer.pwrite(shard, data, offset)   # data: uint8 array; returns the bytes written
    writer.stats                                 # {"direct_bytes", "buffered_bytes", "fallbacks"}
"""
from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from typing import Iterator, Sequence

import numpy as np

log = logging.getLogger("foresight.io")

__all__ = ["CacheWriter", "DIRECT_MIN", "ALIGN", "BUFFERED_PIECE", "pwrite_buffered"]

ALIGN = 4096
DIRECT_MIN = 1 << 20  # writes this large go O_DIRECT (their aligned middle)
BOUNCE_BYTES = 4 << 20  # one aligned bounce buffer; a write is copied and written through it piece by piece
BOUNCE_COUNT = 8  # direct writes at once (the fetcher's other threads wait for a buffer)
BUFFERED_PIECE = 1 << 20  # a buffered write's largest piece (the page-cache folios it makes are no larger)


def pwrite_buffered(fd: int, data: np.ndarray, offset: int) -> int:
    """Write ``data`` (uint8, contiguous) at ``offset`` of ``fd`` through the page cache in pieces of at most
    ``BUFFERED_PIECE`` bytes, cut at its multiples in the file (see the module doc: small folios, not the
    high-order blocks a large write's folios take); returns the bytes written (short only when the disk took
    part: full). A loop over a write's pieces (16 for a 16 MiB GET), not over samples."""
    n = int(data.size)
    view = memoryview(data)
    cuts = list(range(-(-offset // BUFFERED_PIECE) * BUFFERED_PIECE, offset + n, BUFFERED_PIECE))
    bounds = [offset] + [c for c in cuts if c > offset] + [offset + n]
    wrote = 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        got = os.pwrite(fd, view[lo - offset:hi - offset], lo)
        wrote += got
        if got != hi - lo:
            break
    return wrote


class CacheWriter:
    """Writes into the files ``paths`` (``fds``: their buffered descriptors, owned by the caller); see the module
    doc. ``direct=False`` writes everything buffered."""

    def __init__(self, paths: Sequence[str], fds: Sequence[int], *, direct: bool = True) -> None:
        self._paths = list(paths)
        self._fds = fds
        self._direct_fds: dict[int, int] = {}
        self.direct = direct
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._made = 0
        self._cv = threading.Condition(self._lock)
        self.stats = {"direct_bytes": 0, "buffered_bytes": 0, "fallbacks": 0}

    def close(self) -> None:
        with self._lock:
            for fd in self._direct_fds.values():
                os.close(fd)
            self._direct_fds.clear()
            for buf in self._free:
                buf.close()
            self._free.clear()

    def pwrite(self, shard: int, data: np.ndarray, offset: int) -> int:
        """Write ``data`` (uint8, contiguous) at ``offset`` of file ``shard``; returns the bytes written (fewer
        than ``data.size`` only when the disk took part of it: full)."""
        n = int(data.size)
        lo = -(-offset // ALIGN) * ALIGN
        hi = (offset + n) // ALIGN * ALIGN
        fd = self._direct_fd(shard) if self.direct and hi - lo >= DIRECT_MIN else None
        if fd is None:
            wrote = pwrite_buffered(self._fds[shard], data, offset)
            self._count("buffered_bytes", wrote)
            return wrote
        wrote = 0
        if lo > offset:  # the unaligned head, buffered
            wrote += os.pwrite(self._fds[shard], memoryview(data[:lo - offset]), offset)
        with self._bounce() as buf:
            for pos in range(lo, hi, BOUNCE_BYTES):  # a loop over 4 MiB pieces of one GET, not samples
                m = min(BOUNCE_BYTES, hi - pos)
                # a copy with no view of ``buf`` left in this frame: an error raised here keeps the frame (its
                # traceback), and a live view would make close()'s buf.close() raise BufferError
                buf[:m] = data[pos - offset:pos - offset + m]
                try:
                    got = os.pwrite(fd, memoryview(buf)[:m], pos)
                except OSError as e:  # opened, but the write refused (some FUSE and network file systems)
                    if e.errno != errno.EINVAL:
                        raise
                    self._refused(shard)
                    self._count("direct_bytes", pos - lo)
                    self._count("buffered_bytes", lo - offset)
                    return wrote + self.pwrite(shard, data[pos - offset:], pos)  # the rest, buffered
                wrote += got
                if got != m:
                    return wrote
        if offset + n > hi:  # the unaligned tail, buffered
            wrote += os.pwrite(self._fds[shard], memoryview(data[hi - offset:]), hi)
        self._count("direct_bytes", hi - lo)
        self._count("buffered_bytes", n - (hi - lo))
        return wrote

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.stats[key] += n

    def _direct_fd(self, shard: int) -> int | None:
        with self._lock:
            fd = self._direct_fds.get(shard)
            if fd is not None or not self.direct:
                return fd
            try:
                fd = os.open(self._paths[shard], os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._refused_locked(shard)
                return None
            self._direct_fds[shard] = fd
            return fd

    def _refused(self, shard: int) -> None:
        with self._lock:
            self._refused_locked(shard)

    def _refused_locked(self, shard: int) -> None:
        """The file system refused O_DIRECT: every later write goes buffered (one warning, counted)."""
        if self.direct:
            self.direct = False
            self.stats["fallbacks"] += 1
            log.warning("%s refuses O_DIRECT: received bytes are written through the page cache (more CPU per "
                        "byte)", os.path.dirname(self._paths[shard]))

    @contextlib.contextmanager
    def _bounce(self) -> Iterator[mmap.mmap]:
        with self._cv:
            while not self._free and self._made >= BOUNCE_COUNT:
                self._cv.wait()
            if self._free:
                buf = self._free.pop()
            else:
                buf = mmap.mmap(-1, BOUNCE_BYTES)  # page-aligned, as O_DIRECT needs
                self._made += 1
        try:
            yield buf
        finally:
            with self._cv:
                self._free.append(buf)
                self._cv.notify()
