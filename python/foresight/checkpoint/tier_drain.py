"""Tier drain: copy each committed step from the fastest tier to the slower ones, then apply retention.

A :class:`TierDrain` runs one thread (only when there is more than one tier) that takes the committed
handles (:class:`~foresight.checkpoint.save_handle.SaveHandle`) in commit order, copies the step directory to every
slower tier with the same atomic commit (:func:`copy_checkpoint`; to a bucket tier :meth:`.BucketTier.upload`:
multipart uploads, COMMIT last), and marks the handle durable. Steps still
to be copied are protected from the fastest tier's retention (:meth:`TierDrain.protected`).

Example::

    copy_checkpoint("/nvme/ckpt/step-00000100", "/shared/ckpt", 100)   # one step, by hand
"""
from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from foresight.checkpoint import store
from foresight.checkpoint.aligned_io import FileIO, copy_file
from foresight.checkpoint.bucket_tier import BucketTier
from foresight.checkpoint.queue_worker import QueueWorker
from foresight.checkpoint.save_handle import SaveHandle
from foresight.checkpoint.startup_recovery import holds_commit
from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir


class TierDrain:
    """The drain thread of a Checkpointer (none for a single tier) and the steps it still has to copy.

    ``on_done(handle)`` runs once a handle is durable (the Checkpointer forgets it unless it failed). ``buckets``
    maps the ``s3://`` tiers to their :class:`~foresight.checkpoint.bucket_tier.BucketTier`.
    """

    def __init__(self, tiers: list[str], keep: list[int | None], fio: FileIO | None,
                 on_done: Callable[[SaveHandle], None], *, buckets: dict[str, BucketTier] | None = None) -> None:
        self.tiers, self.keep = tiers, keep
        self._buckets = buckets or {}
        self._fio = fio
        self._on_done = on_done
        self._lock = threading.Lock()
        self._pending: Counter[int] = Counter()  # steps (on tier 0) still to be copied to slower tiers
        self._worker = QueueWorker(self._drain_one, "foresight-ckpt-drain") if len(tiers) > 1 else None

    @property
    def active(self) -> bool:
        """Whether there are slower tiers to drain to."""
        return self._worker is not None

    def reserve(self, step: int) -> None:
        """Protect ``step`` on the fastest tier until its drain finishes (called before it is published)."""
        with self._lock:
            self._pending[step] += 1

    def unreserve(self, step: int) -> None:
        with self._lock:
            self._pending[step] -= 1

    def protected(self) -> set[int]:
        """Steps the fastest tier's retention must keep: their copies to slower tiers are not done."""
        with self._lock:
            return {step for step, n in self._pending.items() if n > 0}

    def put(self, handle: SaveHandle) -> None:
        """Queue a committed (and reserved) step for copying (only when :attr:`active`)."""
        self._worker.put(handle)

    def join(self) -> None:
        """Wait until every queued step is drained."""
        if self._worker is not None:
            self._worker.join()

    def stop(self) -> None:
        """End the thread (after the queued drains)."""
        if self._worker is not None:
            self._worker.stop()

    def _drain_one(self, h: SaveHandle) -> None:
        root = self.tiers[0]
        try:
            marker = store.read_marker(h.path)
            for tier, (root, keep) in enumerate(zip(self.tiers[1:], self.keep[1:]), start=1):
                if h._drain_tiers is not None and tier not in h._drain_tiers:
                    continue
                bucket = self._buckets.get(root)
                if bucket is not None:
                    if not bucket.holds_commit(h.step, marker):
                        bucket.upload(h.path, h.step)
                    retain_bucket(bucket, keep)
                    continue
                if not holds_commit(root, h.step, marker):  # a resumed drain may find it there
                    copy_checkpoint(h.path, root, h.step, fio=self._fio)
                retain(root, keep, ())
        except BaseException as e:  # noqa: BLE001
            h._fail(e if isinstance(e, CheckpointError) else
                    CheckpointError(f"drain failed: {e}", step=h.step, tier=root))
        finally:
            self.unreserve(h.step)
            retain(self.tiers[0], self.keep[0], self.protected())
        h._durable.set()
        self._on_done(h)


def retain(root: str, keep: int | None, protect: Any) -> None:
    """Apply retention; a failure to delete an old checkpoint is a warning, never a failed save."""
    try:
        store.apply_retention(root, keep, protect=protect)
    except OSError as e:
        warnings.warn(f"foresight.checkpoint: retention in {root} failed: {e}", RuntimeWarning, stacklevel=1)


def retain_bucket(bucket: BucketTier, keep: int | None) -> None:
    """Retention on a bucket tier; a failure to delete is a warning, never a failed save (the commit is in)."""
    try:
        bucket.retain(keep)
    except OSError as e:  # BucketError included: one line, no credentials
        warnings.warn(f"foresight.checkpoint: retention in {bucket.root} failed: {e}", RuntimeWarning, stacklevel=1)


def copy_checkpoint(src: str, root: str, step: int, *, fio: FileIO | None = None) -> str:
    """Copy the committed checkpoint dir ``src`` into tier ``root`` with the same atomic commit."""
    os.makedirs(root, exist_ok=True)
    tmp = store.new_tmp_dir(root, step)
    try:
        names = sorted(os.listdir(src), key=lambda n: n == store.COMMIT)  # COMMIT last
        for name in names:
            copy_file(os.path.join(src, name), os.path.join(tmp, name), fio)
        fsync_dir(tmp)
        return store.publish(tmp, root, step)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise CheckpointError(f"cannot copy checkpoint: {e.strerror}", path=src, tier=root) from e
        raise
