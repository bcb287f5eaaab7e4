"""A replica data file as the receiving site writes it: units of a save in progress with O_DIRECT.

While a save is being written, the site must take its units in as fast as the writer writes them (100 MB/s and
more), or they pile up and are still to arrive at the commit. A buffered write copies every byte into page-cache
pages the kernel must first find and map; on the WAN bed's VM that copy ran at 65-220 MB/s into fresh pages
(``copy_folio_from_iter_atomic``: 83% of the receiving node's CPU in a replicated save, 0.9-1.0 CPU-s per 128 MiB
against the sender's 0.27), and the windows received at once waited for each other's writes to the one file (0.3-0.7
s per 8 MiB unit): at a 100 MB/s save a third of the checkpoint was still to arrive at the commit (docs/wan_bed.md).
O_DIRECT from an aligned bounce buffer costs a memcpy: 0.015-0.03 CPU-s per 128 MiB there, and the whole receiving
node used 0.36 CPU-s in the same save.

The price: the verification at the commit reads those units from the disk, not from the page cache (0.1-0.4 s per
128 MiB here), so the units of a committed checkpoint (nothing to keep pace with; its transfer is judged start ->
replica ready) and those sent after the source's commit go through the page cache: the sender says which
(``direct`` in the ``replica.units`` command).

With ``direct``, the writes go through :class:`~foresight.io.direct_write.CacheWriter` (as the bucket cache does)
(the same cost, found on the same VM): the 4 KiB-aligned middle of a write of at least 1 MiB with O_DIRECT through a
reused aligned bounce buffer, an unaligned head or tail and small writes buffered, everything buffered on a file
system that refuses O_DIRECT (a log line, ``counts["fallbacks"]``). One ``fdatasync`` of the file makes both kinds
durable (one inode; O_DIRECT writes into the preallocated blocks leave only the extent conversion to commit).

Example::

    f = ReplicaFile("/eval/job/.replica-step-100/data-00000.bin", size, direct=True)
    f.pwrite(memoryview(body), offset)
    f.sync(); f.close()
    f.counts   # {"direct_bytes": ..., "buffered_bytes": ..., "fallbacks": 0}
"""
from __future__ import annotations

import os

import numpy as np

from foresight.io.direct_write import CacheWriter
from foresight.errors import CheckpointError


class ReplicaFile:
    """Data file ``path`` of a replica (``size`` bytes, blocks allocated up front), open for one window's units;
    the writes go through :class:`~foresight.io.direct_write.CacheWriter` (``direct=False``: all buffered)."""

    def __init__(self, path: str, size: int, *, direct: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(self.fd).st_size != size:
                _preallocate(self.fd, size, path)
        except BaseException:
            os.close(self.fd)
            raise
        self._writer = CacheWriter([path], [self.fd], direct=direct)

    @property
    def counts(self) -> dict[str, int]:
        """Bytes written ``direct_bytes`` and ``buffered_bytes``; ``fallbacks``: O_DIRECT refused (logged)."""
        return self._writer.stats

    def pwrite(self, view: memoryview, pos: int) -> None:
        """Write ``view`` (bytes) at ``pos``: its aligned middle with O_DIRECT (when large), the rest buffered."""
        data = np.frombuffer(view, dtype=np.uint8)
        done = 0
        while done < len(data):
            got = self._writer.pwrite(0, data[done:], pos + done)
            if got <= 0:
                raise CheckpointError("the replica file took no more bytes (disk full?)", path=self.path,
                                      offset=pos + done)
            done += got

    def sync(self) -> None:
        os.fdatasync(self.fd)  # the inode: the buffered pages and the O_DIRECT writes' extent conversions

    def close(self) -> None:
        self._writer.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _preallocate(fd: int, size: int, path: str) -> None:
    """Give the replica file its size with its blocks allocated up front (units land anywhere in it, in any order;
    writes into allocated blocks are faster than filling a sparse file, and a full disk shows now, by name)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise CheckpointError(f"cannot allocate the replica file: {e.strerror}", path=path, size=size) from e
