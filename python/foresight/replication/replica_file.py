"""A replica data file as the receiving site writes it: units of a save in progress with O_DIRECT.

While a save is being written, the site must take its units in as fast as the writer writes them (100 MB/s and
more), or they pile up and are still to arrive at the commit. A buffered write copies every byte into page-cache
pages the kernel must first find and map; on the WAN bed's VM that copy ran at 65-220 MB/s into fresh pages
(``copy_folio_from_iter_atomic``: 83% of the receiving node's CPU in a replicated save, 0.9-1.0 CPU-s per 128 MiB
against the sender's 0.27), and the windows received at once waited for each other's writes to the one file (0.3-0.7
s per 8 MiB unit): at a 100 MB/s save a third of the checkpoint was still to arrive at the commit (docs/wan_bed.md).
O_DIRECT from an aligned bounce buffer that stays mapped (one per receiving thread, so its pages are warm) costs a
memcpy: 0.015-0.03 CPU-s per 128 MiB there, and 0.36 CPU-s for the whole receiving node in the same save.

The price: the verification at the commit reads those units from the disk, not from the page cache (0.1-0.4 s per
128 MiB here), so the units of a committed checkpoint (nothing to keep pace with; its transfer is judged start ->
replica ready) and those sent after the source's commit go through the page cache: the sender says which
(``direct`` in the ``replica.units`` command).

With ``direct``, the 4 KiB-aligned part of each piece goes with O_DIRECT through the bounce buffer; an unaligned head
or tail (a file's last unit, a sender's odd chunking) is a buffered write, and so is everything on a file system that
refuses O_DIRECT (a log line, and ``counts["refused"]``). One ``fdatasync`` of the file makes both kinds durable (one
inode; O_DIRECT writes into the preallocated blocks leave only the extent conversion to commit).

Example::

    f = ReplicaFile("/eval/job/.replica-step-100/data-00000.bin", size, direct=True)
    f.pwrite(memoryview(body), offset)
    f.sync(); f.close()
    f.counts   # {"direct": ..., "buffered": ..., "refused": 0}
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading

from foresight.errors import CheckpointError

log = logging.getLogger("foresight.replicate")

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses (the logical block size of the disks in use)
BOUNCE = 4 << 20  # bytes of a receiving thread's aligned bounce buffer (reused: its pages stay mapped)
_local = threading.local()
_refusal_logged = threading.Event()


def _bounce() -> memoryview:
    """This thread's aligned bounce buffer (an anonymous mapping: page-aligned), made once."""
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = mmap.mmap(-1, BOUNCE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(buf)


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], pos + done)


class ReplicaFile:
    """Data file ``path`` of a replica (``size`` bytes, blocks allocated up front), open for one window's units;
    ``direct=False``: every write buffered."""

    def __init__(self, path: str, size: int, *, direct: bool = True) -> None:
        self.path = path
        self.counts = {"direct": 0, "buffered": 0, "refused": 0}
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.dfd = -1
        try:
            if os.fstat(self.fd).st_size != size:
                _preallocate(self.fd, size, path)
            if direct:
                try:
                    self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise CheckpointError(f"cannot open the replica file: {e.strerror}", path=path) from e
                    self._refused(e)
        except BaseException:
            os.close(self.fd)
            raise

    def pwrite(self, view: memoryview, pos: int) -> None:
        """Write ``view`` (bytes) at ``pos``: its aligned middle with O_DIRECT, the rest buffered."""
        head = min(len(view), -pos % ALIGN)
        body = (len(view) - head) // ALIGN * ALIGN if self.dfd >= 0 else 0
        if head and body:
            self._buffered(view[:head], pos)
        elif not body:
            self._buffered(view, pos)
            return
        self._direct(view[head:head + body], pos + head)
        if head + body < len(view):
            self._buffered(view[head + body:], pos + head + body)

    def sync(self) -> None:
        os.fdatasync(self.fd)  # the inode: the buffered pages and the O_DIRECT writes' extent conversions

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1

    def _buffered(self, view: memoryview, pos: int) -> None:
        _pwrite_all(self.fd, view, pos)
        self.counts["buffered"] += len(view)

    def _direct(self, view: memoryview, pos: int) -> None:
        bounce = _bounce()
        for off in range(0, len(view), len(bounce)):
            n = min(len(bounce), len(view) - off)
            bounce[:n] = view[off:off + n]
            try:
                _pwrite_all(self.dfd, bounce[:n], pos + off)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._refused(e)  # the file system took the open, not the write: the rest goes buffered
                self._buffered(view[off:], pos + off)
                return
            self.counts["direct"] += n

    def _refused(self, e: OSError) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1
        self.counts["refused"] += 1
        if not _refusal_logged.is_set():
            _refusal_logged.set()
            log.warning("O_DIRECT refused for replica files; units are written through the page cache",
                        extra={"path": self.path, "error": str(e)})


def _preallocate(fd: int, size: int, path: str) -> None:
    """Give the replica file its size with its blocks allocated up front (units land anywhere in it, in any order;
    writes into allocated blocks are faster than filling a sparse file, and a full disk shows now, by name)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise CheckpointError(f"cannot allocate the replica file: {e.strerror}", path=path, size=size) from e
