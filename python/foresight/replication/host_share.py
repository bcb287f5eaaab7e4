"""Per-host sharing of restore reads: the ranks of one host read each hot checkpoint file once, not once per rank.

At a synchronized restart every rank reads the same hot files (the DCP ``.metadata``, the replicated tensors).
With 8 ranks per host, 7 of every 8 of those reads cross the network for bytes the host already has. A
:class:`HostShare` elects, per file, one process of the host to fetch it (an ``flock`` on ``<file>.lock`` in a
host-local directory, ``/dev/shm`` by default: no daemon) into ``.tmp-<pid>-<thread>-<file>``; it verifies the bytes and
renames the file into place, the rename being the completion marker. The other processes wait for that name and map
the file (copy-on-write, so tensors can view it), verifying it as the fetcher did. A fetcher killed mid-write
releases its lock with its death and never renamed its torn file, so the next waiter takes the lock, removes the
torn file and fetches again. Replication hints (:mod:`foresight.replication.hint_client`) spread the remaining
fan-out, one read per host, over the copies across hosts.

Each process opens the share for the restore (a shared lock on ``<key>.users``) and closes it after; the last one
out removes the files. A process that opens it after that fetches again (correct, one more read); open it before
the restore's first read (e.g. before the load's first collective) so the host's ranks overlap.

:class:`SharedReplicaReader` is a :class:`~foresight.replication.hint_client.ReplicaReader` front: hot files through
the share, the rest straight through; ``ForesightStorageReader(path, host_share=...)`` shares the DCP reader's hot
files the same way.

Example::

    with HostShare("job-7/step-100") as share, ReplicaReader(ep, job="job-7", token=tok) as replicas:
        reader = SharedReplicaReader(replicas, share, hot={".metadata", "__0_hot_data.bin"})
        meta = reader.read("job-7/step-100", ".metadata")      # one read per host, a mapped copy for the rest
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from foresight.checksum import xxh3_many
from foresight.errors import CheckpointError

log = logging.getLogger("foresight.replication.host_share")
DEFAULT_DIR = "/dev/shm/foresight-host-share" if os.path.isdir("/dev/shm") else None
_POLL_MAX_S = 0.01  # longest sleep between looks at a file another process is fetching


class ShareSpaceError(CheckpointError):
    """The host-local directory has no room for a file: the caller reads it directly (logged and counted)."""


def xxh3_check(size: int, xxh3: int | str, *, file: str) -> Callable[[memoryview], None]:
    """A check for :meth:`HostShare.get`: the bytes are ``size`` long and their xxh3 is ``xxh3`` (int or hex)."""
    want = int(xxh3, 16) if isinstance(xxh3, str) else int(xxh3)

    def check(view: memoryview) -> None:
        got = int(xxh3_many(view, np.zeros(1, np.int64), np.array([size], np.int64))[0]) if size else 0
        if len(view) != size or (size and got != want):
            raise CheckpointError("shared copy failed verification (size or xxh3)", file=file, size=len(view),
                                  expected_size=size)

    return check


def _safe(name: str) -> str:
    """A file name for ``name`` (checkpoint files may sit in sub-directories); names that had to change carry a
    digest of the original, so two names never share a file."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return safe if safe == name else f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


class HostShare:
    """A host's shared copies of one restore's hot files; one instance per process (or per simulated rank).

    Args:
        key: what is restored (the checkpoint's name or path): processes with the same key share.
        directory: host-local directory (default ``/dev/shm/foresight-host-share``, else the temp directory).
        timeout: longest wait for another process's fetch before CheckpointError names the file and the holder.
    """

    def __init__(self, key: str, *, directory: str | None = None, timeout: float = 300.0) -> None:
        import tempfile

        base = directory or DEFAULT_DIR or os.path.join(tempfile.gettempdir(), "foresight-host-share")
        os.makedirs(base, exist_ok=True)
        tag = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.key, self.timeout = key, float(timeout)
        self.users_path = os.path.join(base, f"{tag}.users")
        self.dir = os.path.join(base, tag)
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.stats = {"fetched": 0, "fetched_bytes": 0, "mapped": 0, "mapped_bytes": 0, "takeovers": 0,
                      "bad_copies": 0, "fallbacks": 0, "cleaned": 0}
        self._users_fd: int | None = self._join()

    # -- session ---------------------------------------------------------------------------------------------
    def _join(self) -> int:
        """A shared lock on the users file that is still the one at its path (the last user may be removing it)."""
        while True:
            fd = os.open(self.users_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(self.users_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.makedirs(self.dir, exist_ok=True)
                return fd
            os.close(fd)

    def close(self) -> None:
        """Leave the share; the last process out removes its files (maps already handed out stay valid)."""
        with self._lock:
            fd, self._users_fd = self._users_fd, None
            self._maps = []  # tensors that view a map keep it alive; the rest are unmapped when collected
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # converts our shared lock: only if no one else holds one
        except BlockingIOError:
            os.close(fd)
            return
        try:
            tomb = f"{self.dir}.gone-{os.getpid()}-{threading.get_ident()}"
            try:
                os.rename(self.dir, tomb)
            except FileNotFoundError:
                tomb = None
            if tomb is not None:
                shutil.rmtree(tomb, ignore_errors=True)
            os.unlink(self.users_path)
            self.stats["cleaned"] += 1
        finally:
            os.close(fd)  # a newcomer blocked on the old users file sees it unlinked and makes a new one

    def __enter__(self) -> "HostShare":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- files -----------------------------------------------------------------------------------------------
    def get(self, name: str, size: int, fill: Callable[[memoryview], None],
            check: Callable[[memoryview], None] | None = None) -> memoryview:
        """The bytes of ``name`` (``size`` long): fetched here by ``fill(buffer)`` if this process is elected,
        else mapped from the copy another process of the host fetched. ``check(view)`` (e.g. :func:`xxh3_check`)
        runs on the fetched bytes before they are published and on every mapped copy; it raises on bad bytes.
        The view is writable copy-on-write memory (writes stay private to this process)."""
        if self._users_fd is None:
            raise CheckpointError("host share is closed", key=self.key, file=name)
        if size == 0:
            view = memoryview(bytearray(0))
            if check is not None:
                check(view)
            return view
        final = os.path.join(self.dir, _safe(name))
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while True:
            view = self._map(final, size, check, name)
            if view is not None:
                return view
            fd = os.open(final + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another process fetches it: look again shortly
                    if time.monotonic() > deadline:
                        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                        raise CheckpointError("timed out waiting for another process's fetch of a shared file",
                                              file=name, path=final, holder_pid=holder,
                                              timeout=self.timeout) from None
                    time.sleep(pause)
                    pause = min(2 * pause, _POLL_MAX_S)
                    continue
                if os.path.exists(final):  # published between our look and the lock
                    continue
                return self._fetch(fd, final, name, size, fill, check)
            finally:
                os.close(fd)  # releases the lock

    def _map(self, final: str, size: int, check: Callable[[memoryview], None] | None,
             name: str) -> memoryview | None:
        try:
            fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY) if st.st_size else None
        finally:
            os.close(fd)
        view = memoryview(mm) if mm is not None else memoryview(bytearray(0))
        try:
            if st.st_size != size:
                raise CheckpointError("shared copy has the wrong size", file=name, path=final, size=st.st_size,
                                      expected=size)
            if check is not None:
                check(view)
        except CheckpointError as e:  # left by an earlier restore of other bytes, or damaged: fetch it again
            view.release()
            log.warning("shared copy failed verification; fetching it again",
                        extra={"file": name, "path": final, "error": str(e)[:200]})
            with self._lock:
                self.stats["bad_copies"] += 1
            self._remove_if(final, st.st_ino)
            return None
        with self._lock:
            self._maps.append(mm)
            self.stats["mapped"] += 1
            self.stats["mapped_bytes"] += size
        return view

    def _remove_if(self, final: str, ino: int) -> None:
        """Unlink ``final`` under its lock if it is still the file we found bad (another may have replaced it)."""
        fd = os.open(final + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(final).st_ino == ino:
                    os.unlink(final)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)

    def _fetch(self, lock_fd: int, final: str, name: str, size: int, fill: Callable[[memoryview], None],
               check: Callable[[memoryview], None] | None) -> memoryview:
        """Elected (``lock_fd`` held): fill a temp file, verify it, rename it into place."""
        os.pwrite(lock_fd, f"{os.getpid():<31}\n".encode(), 0)  # who holds it, for a timeout's message
        torn = re.compile(rf"\.tmp-\d+-\d+-{re.escape(os.path.basename(final))}")
        stale = [f for f in os.listdir(self.dir) if torn.fullmatch(f)]
        for f in stale:  # torn by a fetcher that died: its lock went with it
            os.unlink(os.path.join(self.dir, f))
        if stale:
            with self._lock:
                self.stats["takeovers"] += 1
            log.warning("took over a shared fetch a dead process left", extra={"file": name, "torn": len(stale)})
        st = os.statvfs(self.dir)
        if st.f_bavail * st.f_frsize < size:
            raise ShareSpaceError("no room in the host share for the file", file=name, path=self.dir, size=size,
                                  free=st.f_bavail * st.f_frsize)
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{threading.get_ident()}-{os.path.basename(final)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)
            view = memoryview(mm)
            fill(view)
            if check is not None:
                check(view)
            os.rename(tmp, final)  # the completion marker: only verified bytes ever carry the final name
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        with self._lock:
            self._maps.append(mm)
            self.stats["fetched"] += 1
            self.stats["fetched_bytes"] += size
        return view

    def get_or_read(self, name: str, size: int, fill: Callable[[memoryview], None],
                    check: Callable[[memoryview], None] | None = None) -> memoryview:
        """:meth:`get`, or with no room in the share a private read (logged, counted in ``stats['fallbacks']``)."""
        try:
            return self.get(name, size, fill, check)
        except (ShareSpaceError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("host share full: reading the file privately", extra={"file": name, "error": str(e)[:200]})
            with self._lock:
                self.stats["fallbacks"] += 1
            view = memoryview(bytearray(size))
            fill(view)
            if check is not None:
                check(view)
            return view


class SharedReplicaReader:
    """A :class:`~foresight.replication.hint_client.ReplicaReader` whose ``hot`` files are read once per host.

    ``read`` returns the file's bytes (a read-only view of the shared copy for hot files); every byte verified
    against the xxh3 the copy list records, both by the fetcher and by each process that maps the copy.
    """

    def __init__(self, replicas: Any, share: HostShare, *, hot: Collection[str]) -> None:
        self.replicas, self.share, self.hot = replicas, share, frozenset(hot)

    def read(self, checkpoint: str, file: str) -> bytes | memoryview:
        if file not in self.hot:
            return self.replicas.read(checkpoint, file)
        recs = self.replicas.copies(checkpoint).get(file)
        if not recs:
            raise CheckpointError("no live copy of the file is registered", checkpoint=checkpoint, file=file)
        rec = next(iter(recs.values()))

        def fill(buf: memoryview) -> None:
            data = self.replicas.read(checkpoint, file)  # verified there against the same record
            buf[:len(data)] = data

        view = self.share.get_or_read(f"{checkpoint}/{file}", int(rec["size"]), fill,
                                      xxh3_check(int(rec["size"]), rec["xxh3"], file=file))
        return view.toreadonly()


__all__ = ["HostShare", "SharedReplicaReader", "ShareSpaceError", "xxh3_check"]
