"""Eviction pins shared by every process of a host: the samples a reader is about to read, or is reading, are never
evicted by anyone.

A cache directory shared by the ranks of a host has one pin file, ``.foresight-cache/pins``, whose byte ``i``
stands for sample ``i`` (the file stays empty: locks may lie past its end). A reader pins a sample by holding a
shared lock on its byte; an evictor may punch a sample only while it holds an exclusive lock on that byte, which
it asks for without waiting, so a pinned sample is skipped, never waited for. The locks are Linux's open file
description locks (``F_OFD_SETLK``, Linux 3.15+), not classic POSIX record locks, for two reasons:

- they belong to one open of the file, not to the process: a reader and an evictor of the same process conflict
  as two processes do (a POSIX lock of the process would silently take over its own pins), and closing some other
  descriptor of the file in the process does not drop them;
- the kernel drops them when the last descriptor of that open is closed, so a killed reader's pins vanish with
  it: no pid is recorded, nothing to clean up, nothing that can leak. (A child forked while pins are held shares
  the open: its pins then last until the child exits too.)

An evictor's exclusive lock is held only while it unmarks and punches; a reader pinning a sample then waits that
long, and afterwards finds it absent and fetches it again (pin first, then make present, then read). An evictor
that stops while it holds one (SIGSTOP, a stuck disk) is waited for at most ``wait_s`` without progress, then a
``lock_timeout`` names the pin file (:mod:`foresight.bucket.lockwait`).

Example::

    pins = SamplePins(cache_dir)              # one per reader (a PlanPrefetcher's window)
    pins.hold(np.array([3, 17, 42]))          # exactly these pinned now (new ones first, then the rest let go)
    ds.lookup(np.array([3, 17, 42]))          # present, and stays present until let go
    with claim_unpinned(fd, ids) as free:     # an evictor: the ids no reader pins, locked while it punches them
        ...
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
from typing import Callable, Hashable, Iterator

import numpy as np

from .lockwait import LOCK_WAIT_S, wait_for_lock

__all__ = ["SamplePins", "PINS_NAME", "open_pin_file", "claim_unpinned", "id_runs"]

PINS_NAME = "pins"


def id_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``ids`` as runs of consecutive values: (starts, lengths)."""
    if not ids.size:
        return ids, ids
    cut = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.r_[0, cut]]
    ends = ids[np.r_[cut - 1, ids.size - 1]] + 1
    return starts, ends - starts


def _ofd_lock(fd: int, kind: int, start: int, n: int, *, wait: bool) -> bool:
    """An OFD lock (``kind``: F_RDLCK, F_WRLCK or F_UNLCK) on bytes ``[start, start + n)``; False when ``wait`` is
    off and another open holds a conflicting one."""
    flock = struct.pack("@hhqqi4x", kind, os.SEEK_SET, start, n, 0)  # struct flock; l_pid must be 0 for OFD locks
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, flock)
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def open_pin_file(index_dir: str) -> int:
    """A new open (its own lock owner) of ``index_dir``'s pin file, created when missing."""
    return os.open(os.path.join(index_dir, PINS_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


class SamplePins:
    """One reader's pins on a shared cache's samples (see the module doc); thread-safe, ``close()`` lets all go.
    A pin waits on an evictor at most ``wait_s`` in which ``progress()`` (the cache's marks) stays the same: an
    evictor stopped while it holds a sample is a ``lock_timeout`` naming the pin file, never a hang
    (:mod:`foresight.bucket.lockwait`)."""

    def __init__(self, index_dir: str, *, wait_s: float = LOCK_WAIT_S,
                 progress: Callable[[], Hashable] = lambda: None) -> None:
        self._path = os.path.join(index_dir, PINS_NAME)
        self._fd = open_pin_file(index_dir)
        self._ids = np.zeros(0, dtype=np.int64)
        self._lock = threading.Lock()
        self._wait_s = float(wait_s)
        self._progress = progress

    @property
    def ids(self) -> np.ndarray:
        """The samples pinned now (sorted)."""
        return self._ids

    def hold(self, ids: np.ndarray) -> None:
        """Pin exactly ``ids``: the new ones first (waiting only while an evictor punches one of them), then the
        ones no longer wanted let go, so a sample in both sets is never unpinned in between."""
        want = np.unique(np.asarray(ids, dtype=np.int64))
        with self._lock:
            if self._fd < 0:
                raise ValueError("pins closed")
            got: list[tuple[int, int]] = []
            try:
                for start, n in zip(*id_runs(np.setdiff1d(want, self._ids, assume_unique=True))):
                    start, n = int(start), int(n)
                    wait_for_lock(lambda: _ofd_lock(self._fd, fcntl.F_RDLCK, start, n, wait=False), fd=self._fd,
                                  path=self._path, wait_s=self._wait_s, progress=self._progress,
                                  what=f"a pin on sample{f's {start}-{start + n - 1}' if n > 1 else f' {start}'}" +
                                  f" (another process is evicting {'them' if n > 1 else 'it'})")
                    got.append((start, n))
            except BaseException:  # the pins held before stay; none of the new ones is left half taken
                for start, n in got:
                    _ofd_lock(self._fd, fcntl.F_UNLCK, start, n, wait=False)
                raise
            for start, n in zip(*id_runs(np.setdiff1d(self._ids, want, assume_unique=True))):
                _ofd_lock(self._fd, fcntl.F_UNLCK, int(start), int(n), wait=False)
            self._ids = want

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)  # the kernel drops every pin of this open
                self._fd = -1
            self._ids = np.zeros(0, dtype=np.int64)


@contextlib.contextmanager
def claim_unpinned(fd: int, ids: np.ndarray) -> Iterator[np.ndarray]:
    """The samples of sorted unique ``ids`` that no reader pins, each held exclusively through the ``with`` (no
    reader can pin it meanwhile) on ``fd`` (an evictor's own :func:`open_pin_file`). Never waits: a run of ids
    that meets a pin is claimed sample by sample, and the pinned ones left out."""
    got = np.zeros(ids.size, dtype=bool)
    held: list[tuple[int, int]] = []
    try:
        starts, counts = id_runs(ids)
        at = np.searchsorted(ids, starts)
        for start, n, i in zip(starts.tolist(), counts.tolist(), at.tolist()):
            if _ofd_lock(fd, fcntl.F_WRLCK, start, n, wait=False):
                held.append((start, n))
                got[i:i + n] = True
                continue
            for j in range(n):  # only a run that meets a pin is tried per sample
                if _ofd_lock(fd, fcntl.F_WRLCK, start + j, 1, wait=False):
                    held.append((start + j, 1))
                    got[i + j] = True
        yield ids[got]
    finally:
        for start, n in held:
            _ofd_lock(fd, fcntl.F_UNLCK, start, n, wait=False)
