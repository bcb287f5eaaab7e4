"""On-disk checkpoint directories: naming, the atomic commit, commit order, retention, recovery, the lock.

A checkpoint is ``<root>/step-00000100/`` holding ``data-00000.bin``, ``index.json`` and ``COMMIT``. It
is built in ``<root>/.tmp-step-00000100.<host>.<pid>.<nonce>/``; the data file, the index and the COMMIT
marker (which carries the xxh3 of the index, a commit sequence number and an xxh3 of itself) are fsynced,
then the directory, then one ``rename`` makes it visible and the root is fsynced. A directory counts as
committed only if its name is ``step-<digits>`` and it holds a COMMIT marker, so a crash at any moment
leaves either the old set of checkpoints or the old set plus the complete new one. Re-saving an existing
step moves the old copy to ``.trash-...`` first; a crash between the two renames is undone by
:func:`cleanup_stale`.

Commit order: each COMMIT carries ``seq``, one more than the highest ``seq`` on any tier when it was
written (a drained copy keeps its ``seq``). "Latest" and retention follow ``seq``, not the step number, so
a rollback (saving step 5 after step 20) makes step 5 the newest checkpoint, and retention deletes the
oldest *commits*: the checkpoint a ``wait()`` just acknowledged is never the one deleted. Markers written
before ``seq`` existed count as older than every sequenced commit, ordered by step among themselves.

Retention renames a checkpoint to ``.retired-...`` in one step before deleting it, so a ``step-N``
directory without COMMIT is never ours to delete: :func:`quarantine` moves it aside to
``quarantined-step-N.<nonce>`` and reports it. One writer per root: :class:`RootLock` (``flock`` on
``<root>/.foresight.lock``) is held for a Checkpointer's lifetime.

Example::

    steps = committed_steps(root)            # [100, 200]
    newest = commits(root)[-1]               # Commit(step=200, seq=7, ...), in commit order
    index = read_index(step_dir(root, 200))  # verified against COMMIT
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir, pid_alive

INDEX = "index.json"
COMMIT = "COMMIT"
LOCK = ".foresight.lock"
FORMAT = "foresight-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d+)\.(.+)\.(\d+)\.[0-9a-f]+$")
_TRASH_RE = re.compile(r"^\.trash-step-(\d+)\.[0-9a-f]+$")
_RETIRED_RE = re.compile(r"^\.retired-step-(\d+)\.[0-9a-f]+$")
QUARANTINE_PREFIX = "quarantined-"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def new_tmp_dir(root: str, step: int) -> str:
    path = os.path.join(root, f".tmp-{step_name(step)}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(path)
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint directory: {e.strerror}", path=path) from e
    return path


def write_small_file(path: str, data: bytes) -> None:
    """Write and fsync a small file (index, marker)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _marker_digest(marker: dict[str, Any]) -> str:
    """xxh3 of a marker's fields other than its own digest (canonical JSON), so a damaged COMMIT is told
    apart from a damaged index."""
    fields = {k: v for k, v in marker.items() if k != "marker_xxh3"}
    return f"{xxhash.xxh3_64_intdigest(json.dumps(fields, sort_keys=True, separators=(',', ':')).encode()):016x}"


def write_index_and_commit(tmp: str, index: dict[str, Any], *, seq: int | None = None) -> None:
    """Write ``index.json`` then the ``COMMIT`` marker (xxh3 of the index, commit ``seq``), both fsynced,
    then the dir."""
    body = json.dumps(index, separators=(",", ":")).encode()
    write_small_file(os.path.join(tmp, INDEX), body)
    marker: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": index["step"],
                              "index_bytes": len(body), "index_xxh3": f"{xxhash.xxh3_64_intdigest(body):016x}"}
    if seq is not None:
        marker["seq"] = seq
    marker["marker_xxh3"] = _marker_digest(marker)
    write_small_file(os.path.join(tmp, COMMIT), json.dumps(marker).encode())
    fsync_dir(tmp)


def read_marker(path: str) -> dict[str, Any]:
    """The verified COMMIT marker of the step directory ``path``; errors name the COMMIT file."""
    marker_path = os.path.join(path, COMMIT)
    try:
        with open(marker_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise CheckpointError("checkpoint is not committed (no COMMIT marker)", path=path) from e
    except OSError as e:
        raise CheckpointError(f"cannot read COMMIT marker: {e.strerror}", path=marker_path) from e
    return parse_marker(raw, marker_path)


def parse_marker(raw: bytes, marker_path: str) -> dict[str, Any]:
    """A COMMIT marker's bytes, checked (JSON, its own xxh3, its sequence); errors name ``marker_path``."""
    try:
        marker = json.loads(raw)
        if not isinstance(marker, dict):
            raise TypeError("not an object")
        str(marker["index_xxh3"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"COMMIT marker is corrupt (unreadable: {e})", path=marker_path) from e
    if "marker_xxh3" in marker and marker["marker_xxh3"] != _marker_digest(marker):
        raise CheckpointError("COMMIT marker is corrupt (its own checksum does not match)", path=marker_path,
                              expected=marker["marker_xxh3"], got=_marker_digest(marker))
    seq = marker.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
        raise CheckpointError("COMMIT marker is corrupt (bad commit sequence)", path=marker_path, seq=seq)
    return marker


def sealed_marker(marker: dict[str, Any], **fields: Any) -> bytes:
    """``marker`` with ``fields`` added and its own xxh3 recomputed, as the bytes of a COMMIT marker."""
    out = {k: v for k, v in marker.items() if k != "marker_xxh3"}
    out.update(fields)
    out["marker_xxh3"] = _marker_digest(out)
    return json.dumps(out).encode()


def publish(tmp: str, root: str, step: int) -> str:
    """Atomically rename a fully written ``tmp`` dir to ``step-N`` (replacing an older copy) and fsync root."""
    return publish_dir(tmp, step_dir(root, step))


def publish_dir(tmp: str, final: str) -> str:
    """Rename the complete directory ``tmp`` to ``final``; an existing ``final`` goes to the trash first."""
    root = os.path.dirname(final)
    trash = None
    if os.path.lexists(final):
        trash = os.path.join(root, f".trash-{os.path.basename(final)}.{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMIT))


def _step_dirs(root: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [(int(m.group(1)), os.path.join(root, name)) for name in names if (m := _STEP_RE.match(name))]


def committed_steps(root: str) -> list[int]:
    """Sorted steps of the complete checkpoints under ``root`` (missing root: none)."""
    return sorted(step for step, path in _step_dirs(root) if is_committed(path))


@dataclass(frozen=True)
class Commit:
    """One committed checkpoint directory as listed by :func:`commits`."""

    step: int
    seq: int | None  # None: a marker from before commit sequences
    path: str
    error: CheckpointError | None = None  # the marker could not be read: order unknown

    @property
    def order(self) -> tuple[int, int]:
        """Sort key of commit order: ``seq``, unsequenced markers first (by step)."""
        return (-1 if self.seq is None else self.seq, self.step)


def commits(root: str) -> list[Commit]:
    """The committed checkpoints under ``root``, oldest commit first; unreadable markers come last,
    with ``error`` set (their place in the order is unknown)."""
    good, bad = [], []
    for step, path in _step_dirs(root):
        if not is_committed(path):
            continue
        try:
            good.append(Commit(step, read_marker(path).get("seq"), path))
        except CheckpointError as e:
            bad.append(Commit(step, None, path, e))
    return sorted(good, key=lambda c: c.order) + sorted(bad, key=lambda c: c.step)


def max_seq(roots: Iterable[str]) -> int:
    """The highest commit sequence on any of ``roots`` (-1 if none)."""
    return max((c.seq for r in roots for c in commits(r) if c.seq is not None), default=-1)


def cleanup_stale(root: str) -> list[str]:
    """Remove temp dirs of dead local writers and retired checkpoints; undo an interrupted replace.

    Returns the paths removed. Uncommitted ``step-N`` directories are left alone (see
    :func:`uncommitted_step_dirs` and :func:`quarantine`).
    """
    removed = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return removed
    host = socket.gethostname()
    for name in names:
        path = os.path.join(root, name)
        m = _TMP_RE.match(name)
        if m and m.group(2) == host and not pid_alive(int(m.group(3))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        if _RETIRED_RE.match(name):  # retention renamed it away, then died before deleting it
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        m = _TRASH_RE.match(name)
        if m:
            final = step_dir(root, int(m.group(1)))
            if not os.path.lexists(final) and is_committed(path):
                os.rename(path, final)  # crash between the two renames of publish(): put the old copy back
            else:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def uncommitted_step_dirs(root: str) -> list[str]:
    """``step-N`` directories that look like ours (an index and data files) but have no COMMIT marker."""
    return sorted(path for _, path in _step_dirs(root) if _is_ours_uncommitted(path))


def _is_ours_uncommitted(path: str) -> bool:
    """Ours (only an index and data files) and uncommitted; never touches other tools' ``step-*`` dirs."""
    try:
        names = os.listdir(path)
    except (NotADirectoryError, FileNotFoundError):
        return False
    return (INDEX in names and COMMIT not in names
            and all(n == INDEX or (n.startswith("data-") and n.endswith(".bin")) for n in names))


def quarantine(path: str) -> str:
    """Move the step directory ``path`` aside to ``quarantined-step-N.<nonce>`` (same root); return it."""
    dst = os.path.join(os.path.dirname(path), f"{QUARANTINE_PREFIX}{os.path.basename(path)}.{uuid.uuid4().hex[:8]}")
    os.rename(path, dst)
    fsync_dir(os.path.dirname(path))
    return dst


def apply_retention(root: str, keep: int | None, *, protect: Iterable[int] = ()) -> list[int]:
    """Delete the oldest commits beyond the newest ``keep`` (commit order, see the module docstring).

    The newest commit is never deleted, nor a step in ``protect``, nor one whose marker is unreadable
    (its age is unknown). Returns the steps deleted.
    """
    if keep is None:
        return []
    keep = max(1, keep)
    ordered = [c for c in commits(root) if c.error is None]
    protected = set(protect)
    doomed = [c.step for c in ordered[:-keep] if c.step not in protected]
    for s in doomed:
        # one rename takes it out of the committed set, so a crash mid-delete leaves nothing that looks
        # like a checkpoint (or like a lost COMMIT); cleanup_stale finishes the deletion
        retired = os.path.join(root, f".retired-{step_name(s)}.{uuid.uuid4().hex[:8]}")
        try:
            os.rename(step_dir(root, s), retired)
        except FileNotFoundError:
            continue
        shutil.rmtree(retired, ignore_errors=True)
    return doomed


def parse_index(body: bytes, index_path: str) -> dict[str, Any]:
    """Parse an index file's bytes and check its format; raise CheckpointError naming ``index_path``."""
    try:
        index = json.loads(body)
    except ValueError as e:
        raise CheckpointError("index is not valid JSON", path=index_path) from e
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        get = index.get if isinstance(index, dict) else (lambda _k: None)
        raise CheckpointError("unknown checkpoint format", path=index_path,
                              format=get("format"), version=get("version"))
    return index


def read_index(path: str) -> dict[str, Any]:
    """Read and verify ``path/index.json`` against ``path/COMMIT``; raise CheckpointError naming the file
    at fault (COMMIT when the marker is damaged, the index when it does not match an intact marker)."""
    marker = read_marker(path)
    index_path = os.path.join(path, INDEX)
    try:
        with open(index_path, "rb") as f:
            body = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read index: {e.strerror}", path=index_path) from e
    return check_index(body, marker, index_path, os.path.join(path, COMMIT))


def check_index(body: bytes, marker: dict[str, Any], index_path: str, marker_path: str) -> dict[str, Any]:
    """The index ``body`` parsed, once it matches the verified ``marker``'s xxh3 and size."""
    expected = marker["index_xxh3"]
    got = f"{xxhash.xxh3_64_intdigest(body):016x}"
    if got != expected or len(body) != marker.get("index_bytes", len(body)):
        if "marker_xxh3" in marker:  # the marker proved itself intact: the index is at fault
            raise CheckpointError("index checksum mismatch: index is corrupt", path=index_path,
                                  expected=expected, got=got)
        raise CheckpointError("index checksum mismatch: the index or its COMMIT marker (an older marker "
                              "without its own checksum) is corrupt", path=index_path, marker=marker_path,
                              expected=expected, got=got)
    return parse_index(body, index_path)


class RootLock:
    """An exclusive ``flock`` on ``<root>/.foresight.lock``: one writing Checkpointer per root.

    Held until :meth:`release` (or the process dies: the kernel drops it, so a SIGKILLed writer never
    leaves a stale lock). A second holder, in this process or any other sharing the file system, gets a
    :class:`CheckpointError` naming the root and the holder. ``held`` is False where the file system does
    not support locks (a warning is the caller's to give).

    Example::

        lock = RootLock("/ckpt")
        ...
        lock.release()
    """

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK)
        self.held = False
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot open the root's lock file: {e.strerror}", path=self.path) from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = self._holder()
                os.close(self._fd)
                raise CheckpointError(
                    "checkpoint root is in use by another Checkpointer (one writer per root: give each rank "
                    "its own tier directories, or close the other one first)",
                    path=root, lock=self.path, holder=holder) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(self._fd)
                raise CheckpointError(f"cannot lock checkpoint root: {e.strerror}", path=self.path) from e
            return  # no locks on this file system: held stays False
        self.held = True
        _held_locks.add(self)
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, info, 0)

    def _holder(self) -> str:
        try:
            info = json.loads(os.pread(self._fd, 4096, 0))
            return f"pid {info['pid']} on {info['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "unknown"

    def release(self) -> None:
        if self._fd >= 0:
            if self.held:
                fcntl.flock(self._fd, fcntl.LOCK_UN)  # also for copies of the descriptor a fork made
            os.close(self._fd)
            self._fd = -1
            self.held = False
        _held_locks.discard(self)

    def _drop_in_child(self) -> None:
        # a forked child (e.g. a DataLoader worker) must not keep the parent's lock alive after the parent
        # dies; closing its copy does not unlock the parent's
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.held = False


_held_locks: weakref.WeakSet[RootLock] = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [lock._drop_in_child() for lock in list(_held_locks)])
