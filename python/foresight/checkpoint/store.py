"""On-disk checkpoint directories: naming, the atomic commit, listing, retention, stale-file cleanup.

A checkpoint is ``<root>/step-00000100/`` holding ``data-00000.bin``, ``index.json`` and ``COMMIT``. It
is built in ``<root>/.tmp-step-00000100.<host>.<pid>.<nonce>/``; the data file, the index and the COMMIT
marker (which carries the xxh3 of the index) are fsynced, then the directory, then one ``rename`` makes it
visible and the root is fsynced. A directory counts as committed only if its name is ``step-<digits>``
and it holds a COMMIT marker, so a crash at any moment leaves either the old set of checkpoints or the old
set plus the complete new one. Re-saving an existing step moves the old copy to ``.trash-...`` first; a
crash between the two renames is undone by :func:`cleanup_stale`.

Example::

    steps = committed_steps(root)            # [100, 200]
    index = read_index(step_dir(root, 200))  # verified against COMMIT
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterable
from typing import Any

import xxhash

from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir

INDEX = "index.json"
COMMIT = "COMMIT"
FORMAT = "foresight-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d+)\.(.+)\.(\d+)\.[0-9a-f]+$")
_TRASH_RE = re.compile(r"^\.trash-step-(\d+)\.[0-9a-f]+$")


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


def write_index_and_commit(tmp: str, index: dict[str, Any]) -> None:
    """Write ``index.json`` then the ``COMMIT`` marker (xxh3 of the index), both fsynced, then the dir."""
    body = json.dumps(index, separators=(",", ":")).encode()
    write_small_file(os.path.join(tmp, INDEX), body)
    marker = {"format": FORMAT, "version": VERSION, "step": index["step"],
              "index_bytes": len(body), "index_xxh3": f"{xxhash.xxh3_64_intdigest(body):016x}"}
    write_small_file(os.path.join(tmp, COMMIT), json.dumps(marker).encode())
    fsync_dir(tmp)


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


def committed_steps(root: str) -> list[int]:
    """Sorted steps of the complete checkpoints under ``root`` (missing root: none)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for name in names:
        m = _STEP_RE.match(name)
        if m and is_committed(os.path.join(root, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(root: str) -> list[str]:
    """Remove temp dirs of dead local writers and half-deleted checkpoints; undo an interrupted replace.

    Returns the paths removed.
    """
    removed = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return removed
    host = socket.gethostname()
    for name in names:
        path = os.path.join(root, name)
        if _STEP_RE.match(name) and _is_half_deleted(path):
            # publish() only renames complete dirs into place, so this is retention interrupted after it
            # removed the marker: finish deleting it
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        m = _TMP_RE.match(name)
        if m and m.group(2) == host and not _pid_alive(int(m.group(3))):
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


def _is_half_deleted(path: str) -> bool:
    """Ours (only an index and data files) and uncommitted; never touches other tools' ``step-*`` dirs."""
    try:
        names = os.listdir(path)
    except (NotADirectoryError, FileNotFoundError):
        return False
    return (INDEX in names and COMMIT not in names
            and all(n == INDEX or (n.startswith("data-") and n.endswith(".bin")) for n in names))


def apply_retention(root: str, keep: int | None, *, protect: Iterable[int] = ()) -> list[int]:
    """Delete the oldest committed checkpoints beyond the newest ``keep`` (never the newest one)."""
    if keep is None:
        return []
    keep = max(1, keep)
    steps = committed_steps(root)
    protected = set(protect)
    doomed = [s for s in steps[:-keep] if s not in protected]
    for s in doomed:
        # rename first so a half-deleted directory never looks committed
        path = step_dir(root, s)
        trash = os.path.join(root, f".trash-{step_name(s)}.{uuid.uuid4().hex[:8]}")
        try:
            os.remove(os.path.join(path, COMMIT))
            os.rename(path, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def read_index(path: str) -> dict[str, Any]:
    """Read and verify ``path/index.json`` against ``path/COMMIT``; raise CheckpointError naming the file."""
    marker_path = os.path.join(path, COMMIT)
    index_path = os.path.join(path, INDEX)
    try:
        with open(marker_path, "rb") as f:
            marker = json.loads(f.read())
        expected = marker["index_xxh3"]
    except FileNotFoundError as e:
        raise CheckpointError("checkpoint is not committed (no COMMIT marker)", path=path) from e
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError("COMMIT marker is corrupt", path=marker_path) from e
    try:
        with open(index_path, "rb") as f:
            body = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read index: {e.strerror}", path=index_path) from e
    got = f"{xxhash.xxh3_64_intdigest(body):016x}"
    if got != expected or len(body) != marker.get("index_bytes", len(body)):
        raise CheckpointError("index checksum mismatch: index is corrupt", path=index_path,
                              expected=expected, got=got)
    try:
        index = json.loads(body)
    except ValueError as e:
        raise CheckpointError("index is not valid JSON", path=index_path) from e
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError("unknown checkpoint format", path=index_path,
                              format=index.get("format"), version=index.get("version"))
    return index
