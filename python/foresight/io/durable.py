"""Durability helpers shared by every atomic writer (shards, plans, checkpoints).

The pattern everywhere is: write into a temp directory, fsync the files, :func:`fsync_dir` the temp directory,
rename it into place, :func:`fsync_dir` the parent, so that a crash leaves the old state or the new one.

Example::

    fsync_dir("/data/.out.partial")
    os.rename("/data/.out.partial", "/data/out")
    fsync_dir("/data")
"""
from __future__ import annotations

import os

__all__ = ["fsync_dir", "fsync_path"]


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
