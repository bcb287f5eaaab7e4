"""Durability helpers shared by every atomic writer (shards, plans, checkpoints).

The pattern everywhere is: write into a temp directory, fsync the files, :func:`fsync_dir` the temp directory,
rename it into place, :func:`fsync_dir` the parent, so that a crash leaves the old state or the new one.

An overwrite renames the old directory aside (:func:`aside_path`) before renaming the new one in and removing the
old one; a crash between those two renames leaves only the old copy, which :func:`recover_overwrite` (run by the
openers and writers of datasets and plans) renames back.

Example::

    fsync_dir("/data/.out.partial")
    os.rename("/data/.out.partial", "/data/out")
    fsync_dir("/data")
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable

from foresight.errors import FormatError

__all__ = ["aside_path", "fsync_dir", "fsync_path", "pid_alive", "recover_overwrite"]

log = logging.getLogger("foresight.io")


def fsync_path(path: str | os.PathLike, *, directory: bool = False) -> None:
    """fsync a file, or a directory's entries (``directory=True``), by path."""
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fsync_path(path, directory=True)


def aside_path(path: str | os.PathLike) -> str:
    """Where an overwrite moves the old ``path`` meanwhile: ``.NAME.old-<pid>-<rand>`` beside it (the pid tells a
    later :func:`recover_overwrite` whether that overwrite may still be running)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.old-{os.getpid()}-{secrets.token_hex(4)}")


def recover_overwrite(path: str | os.PathLike, complete: Callable[[str], bool], *,
                      legacy_inner: str | None = None) -> str | None:
    """Finish what a crashed overwrite of the directory ``path`` left; return the old copy renamed back, if any.

    Without ``path``, the one complete old copy of a writer that is gone is renamed back (two of them, or one of
    a writer still running, raise :class:`FormatError` naming where the data is). Beside a complete ``path``
    (``complete(path)``), old copies of writers that are gone are removed. ``legacy_inner``: an earlier layout
    kept the old copy one level down, as ``<aside>/<legacy_inner>``.

    >>> recover_overwrite("/data/ds", lambda d: os.path.isfile(os.path.join(d, "manifest.json")))
    """
    parent, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(r"^\." + re.escape(name) + r"\.old-(?:(\d+)-)?[0-9A-Za-z_]+$")
    try:
        entries = sorted(os.listdir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return None
    live, dead = [], []
    for entry in entries:
        m = pattern.match(entry)
        if m:
            aside = os.path.join(parent, entry)
            (live if m.group(1) and pid_alive(int(m.group(1))) else dead).append(aside)
    if not (live or dead):
        return None
    target = os.path.join(parent, name)
    if os.path.lexists(target):
        if complete(target):  # the crash came after the new copy was in place: the old ones are garbage
            for aside in dead:
                shutil.rmtree(aside, ignore_errors=True)
        return None
    if live:  # between its two renames: putting the old copy back would make its second rename fail
        raise FormatError(f"this directory is being overwritten by process {_pid_of(live[0])}; until that "
                          f"finishes the old copy is at {live[0]}", path=target)
    copies = [c for c in (_old_copy(a, complete, legacy_inner) for a in dead) if c]
    if len(copies) > 1:
        raise FormatError("an interrupted overwrite left several old copies of this directory: rename the one to "
                          "keep to its path", path=target, copies=copies)
    if not copies:
        return None
    try:
        os.rename(copies[0], target)
    except OSError as e:
        if os.path.lexists(target):
            return None  # another process recovered it first
        raise FormatError(f"an overwrite was interrupted: the data is at {copies[0]} and could not be renamed back "
                          f"({e.strerror}); rename it to the path", path=target) from e
    fsync_dir(parent)
    for aside in dead:  # an earlier layout's container, now empty
        if aside != copies[0] and os.path.isdir(aside) and not os.listdir(aside):
            os.rmdir(aside)
    log.warning("%s: an interrupted overwrite left the old copy at %s; renamed it back", target, copies[0])
    return copies[0]


def _old_copy(aside: str, complete: Callable[[str], bool], legacy_inner: str | None) -> str | None:
    if complete(aside):
        return aside
    inner = os.path.join(aside, legacy_inner) if legacy_inner else None
    return inner if inner and complete(inner) else None


def _pid_of(aside: str) -> int:
    return int(os.path.basename(aside).rsplit(".old-", 1)[1].split("-", 1)[0])


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (someone else's counts: signal 0 is refused, not unanswered)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
