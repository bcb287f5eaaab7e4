"""Load: restore a committed checkpoint from the fastest tier that holds a complete, verifying copy.

``load`` picks the copies of the requested commit ("latest" follows commit order, not step numbers; see
:mod:`.store`), reads one (:func:`~.reader.read_checkpoint`), falls back to the next tier when a copy does not
verify, and rebuilds the state dict (in place into ``into`` when given). ``latest_step`` says what "latest" is.

Example::

    ck = load("latest", tiers=["/nvme/ckpt", "/shared/ckpt"], into=model.state_dict())
    loader.load_state_dict(ck.extra_state)
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from foresight.checkpoint import store
from foresight.checkpoint.aligned_io import FileIO
from foresight.checkpoint.bucket_tier import READ_ERRORS, BucketTier, close_tiers, open_tiers, tier_commits
from foresight.checkpoint.layout import dtype_from_name
from foresight.checkpoint.reader import read_checkpoint
from foresight.checkpoint.state_tree import decode_extra_state, match_targets, restore_into, unflatten
from foresight.errors import CheckpointError


@dataclass
class LoadedCheckpoint:
    """What :func:`load` returns: the restored state dict and the state saved alongside it."""

    step: int
    state_dict: Any
    extra_state: Any
    path: str
    tier: int


def tiers_of(root: Any, tiers: Any) -> list[str]:
    """The tier roots named by exactly one of ``root=`` (one tier) or ``tiers=`` (fastest first)."""
    if (root is None) == (tiers is None):
        raise ValueError("pass exactly one of root= or tiers=")
    if root is not None:
        return [os.fspath(root)]
    return [os.fspath(tiers)] if isinstance(tiers, (str, os.PathLike)) else [os.fspath(t) for t in tiers]


def load(step: int | str = "latest", *, root: str | os.PathLike | None = None,
         tiers: Sequence[str | os.PathLike] | None = None, into: Any = None, verify: bool = True,
         fio: FileIO | None = None, direct: bool = True, bucket_options: dict[str, Any] | None = None,
         _buffer: Any = None, _buckets: dict[str, BucketTier] | None = None) -> LoadedCheckpoint:
    """Restore a committed checkpoint, preferring the fastest tier that holds a complete copy.

    ``step`` is an int (its newest commit first) or ``"latest"``: the most recent commit (commit order,
    not the largest step; see :mod:`.store`), and only copies of that commit. With ``into`` (a state dict
    of existing tensors), tensors whose shape and dtype match are filled in place and the rest replaced;
    ``state_dict`` of the result is ``into`` itself then. Without it, the tensors are fresh CPU tensors (views of one read buffer).
    A corrupt copy on one tier falls back to the next tier holding the step; if none is readable the
    first :class:`CheckpointError` (naming file and tensor) is raised. A tier may be a bucket (``s3://bucket/prefix``,
    see :mod:`.bucket_tier`; ``bucket_options`` such as ``retry`` go to its client): read with coalesced ranged GETs,
    each tensor checked as from disk; a bucket copy that fails (:class:`~foresight.errors.BucketError`) also falls
    back to the next tier.

    Example::

        ck = foresight.checkpoint.load("latest", root="/ckpt", into=model.state_dict())
        loader.load_state_dict(ck.extra_state)
    """
    roots = tiers_of(root, tiers)
    buckets = _buckets if _buckets is not None else open_tiers(roots, bucket_options)
    try:
        return _load(step, roots, buckets, into, verify, fio, direct, _buffer)
    finally:
        if _buckets is None:
            close_tiers(buckets)


def _load(step: int | str, roots: list[str], buckets: dict[str, BucketTier], into: Any, verify: bool,
          fio: FileIO | None, direct: bool, _buffer: Any) -> LoadedCheckpoint:
    per_tier = [tier_commits(r, buckets) for r in roots]
    if step == "latest":
        newest = _newest_commit(per_tier)
        if newest is None:
            unreadable = [c.error for cs in per_tier for c in cs if c.error is not None]
            if unreadable:
                raise unreadable[0]
            raise CheckpointError("no committed checkpoint found", tiers=roots)
        step = newest.step
        # copies of that very commit only: an older save that reused the step number is not "latest"
        candidates = [(tier, c) for tier, cs in enumerate(per_tier) for c in cs
                      if c.step == step and c.error is None and c.seq == newest.seq]
    elif isinstance(step, int) and not isinstance(step, bool):
        # the newest commit of that step first (a rollback may have re-saved it), then the faster tier
        candidates = sorted(((tier, c) for tier, cs in enumerate(per_tier) for c in cs if c.step == step),
                            key=lambda tc: (tc[1].error is not None, tuple(-x for x in tc[1].order), tc[0]))
    else:
        raise ValueError(f"step must be an int or 'latest', got {step!r}")
    errors: list[Exception] = []
    for tier, commit in candidates:
        path = commit.path
        if commit.error is not None:
            errors.append(commit.error)
            continue
        try:
            targets: dict[int, torch.Tensor] = {}

            def pick_targets(index: dict[str, Any]) -> dict[int, torch.Tensor]:
                meta = index["tensors"]
                targets.update(match_targets(into, index["skeleton"], meta["shape"],
                                             [dtype_from_name(d) for d in meta["dtype"]]))
                return targets

            if roots[tier] in buckets:
                tensors, index = buckets[roots[tier]].read_checkpoint(
                    commit, verify=verify, targets=pick_targets if into is not None else None)
            else:
                tensors, index = read_checkpoint(path, verify=verify, fio=fio, direct=direct, buffer=_buffer,
                                                 targets=pick_targets if into is not None else None)
        except READ_ERRORS as e:
            errors.append(e)
            continue
        if into is not None:
            state = restore_into(into, index["skeleton"], tensors, clone_new=_buffer is not None, copied=targets)
        else:
            state = unflatten(index["skeleton"], tensors)
        return LoadedCheckpoint(step=step, state_dict=state, extra_state=decode_extra_state(index), path=path,
                                tier=tier)
    if errors:
        raise errors[0]
    raise CheckpointError("checkpoint step not found on any tier", step=step, tiers=roots)


def latest_step(*, root: str | os.PathLike | None = None, tiers: Sequence[str | os.PathLike] | None = None,
                bucket_options: dict[str, Any] | None = None) -> int | None:
    """The step of the most recent commit on any tier (what ``load("latest")`` restores), or ``None``."""
    roots = tiers_of(root, tiers)
    buckets = open_tiers(roots, bucket_options)
    try:
        newest = _newest_commit([tier_commits(r, buckets) for r in roots])
    finally:
        close_tiers(buckets)
    return None if newest is None else newest.step


def _newest_commit(per_tier: list[list[store.Commit]]) -> store.Commit | None:
    """The most recent readable commit over all tiers; warns about unreadable markers it had to pass over."""
    good = [c for cs in per_tier for c in cs if c.error is None]
    for c in (c for cs in per_tier for c in cs if c.error is not None):
        warnings.warn(f"foresight.checkpoint: ignoring {c.path} when looking for the latest checkpoint: "
                      f"{c.error}", RuntimeWarning, stacklevel=3)
    return max(good, key=lambda c: c.order, default=None)
