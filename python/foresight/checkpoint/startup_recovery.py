"""Start-up recovery of checkpoint roots: the writer locks, what dead writers left, unfinished drains.

A :class:`~foresight.checkpoint.Checkpointer` calls these, in this order, before it accepts a save:
:func:`lock_roots` (one writer per root, in any process), :func:`recover_roots` (stale temp dirs removed,
``step-N`` dirs without COMMIT moved aside with a warning), :func:`undrained` (local commits that a killed
predecessor never finished copying to the slower tiers, to be drained again).

Example::

    locks = lock_roots(["/nvme/ckpt", "/shared/ckpt"])
    moved = recover_roots(["/nvme/ckpt", "/shared/ckpt"])
    todo = undrained(["/nvme/ckpt", "/shared/ckpt"])   # [(Commit, {1}), ...]
    release(locks)
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from foresight.checkpoint import store
from foresight.checkpoint.reader import verify_uncommitted
from foresight.checkpoint.store import RootLock
from foresight.errors import CheckpointError


def lock_roots(roots: list[str]) -> list[RootLock]:
    """Create every root and take its writer lock; all or none."""
    locks: list[RootLock] = []
    try:
        for root in roots:
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"cannot create checkpoint root: {e.strerror}", path=root) from e
            lock = RootLock(root)
            if not lock.held:
                warnings.warn(f"foresight.checkpoint: {root} does not support file locks; make sure no other "
                              "Checkpointer writes there", RuntimeWarning, stacklevel=3)
            locks.append(lock)
    except BaseException:
        release(locks)
        raise
    return locks


def release(locks: list[RootLock]) -> None:
    for lock in locks:
        lock.release()


def recover_roots(roots: list[str]) -> list[str]:
    """Clean up after dead writers and quarantine uncommitted step dirs; return the quarantine paths."""
    moved = []
    for root in roots:
        store.cleanup_stale(root)
        for path in store.uncommitted_step_dirs(root):
            problem = verify_uncommitted(path)
            dst = store.quarantine(path)
            moved.append(dst)
            state = "its index and data verify" if problem is None else f"it does not verify ({problem})"
            warnings.warn(f"foresight.checkpoint: {path} has no COMMIT marker, so it is not a committed "
                          f"checkpoint; {state}. Moved aside to {dst} instead of deleting it.",
                          RuntimeWarning, stacklevel=3)
    return moved


def undrained(roots: list[str], commits_of: Callable[[str], list[store.Commit]] = store.commits,
              ) -> list[tuple[store.Commit, set[int]]]:
    """Local commits (oldest first) with the slower tiers that still lack them (``commits_of(root)`` lists a
    tier's commits: a bucket tier's come from its listing).

    Drains run in commit order, so a slower tier holds every local commit up to its own newest one,
    except those its retention deleted on purpose; a local commit newer than that never arrived.
    """
    if len(roots) < 2:
        return []
    newest = [max((c.order for c in commits_of(r) if c.error is None), default=None) for r in roots[1:]]
    out = []
    for c in commits_of(roots[0]):
        behind = {tier for tier, n in enumerate(newest, start=1) if n is None or c.order > n}
        if c.error is None and behind:
            out.append((c, behind))
    return out


def holds_commit(root: str, step: int, marker: dict[str, Any]) -> bool:
    """Whether ``root`` already holds this very commit of ``step`` (same sequence and index)."""
    path = store.step_dir(root, step)
    if not store.is_committed(path):
        return False
    try:
        there = store.read_marker(path)
    except CheckpointError:
        return False  # damaged there: replace it with the good copy
    return there.get("seq") == marker.get("seq") and there["index_xxh3"] == marker["index_xxh3"]
