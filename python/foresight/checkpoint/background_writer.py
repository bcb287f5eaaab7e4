"""The writer thread of a Checkpointer and its queue: staged snapshot -> data file -> COMMIT on the fastest tier.

Each queued :class:`WriteJob` (a staging slot that ``save`` filled, its layout and the index fields) is written as
one aligned data file while a hash worker checksums every tensor (xxh3), fsynced, indexed and committed atomically
(:mod:`.store`), its slot freed, and its handle passed to the :class:`~.tier_drain.TierDrain` (or marked durable
when there is one tier). Replication hooks (``data_started``, ``data_progress``, ``data_written``, ``committed``,
``aborted``) run on this thread; a failing hook warns and the save stands.

Example::

    writer = BackgroundWriter(root, keep, fio, direct=True, replicate=None, drain=drain, on_done=forget, next_seq=1)
    writer.put(WriteJob(handle, pool, slot, layout, names, dtypes, shapes, skeleton, extra_fields, event))
    writer.join()
"""
from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from foresight.checkpoint import store
from foresight.checkpoint.aligned_io import FileIO
from foresight.checkpoint.exit_safe_pool import ExitSafePool
from foresight.checkpoint.layout import Layout
from foresight.checkpoint.queue_worker import QueueWorker
from foresight.checkpoint.save_handle import SaveHandle
from foresight.checkpoint.staging import StagedPrefix, StagingPool
from foresight.checkpoint.tier_drain import TierDrain, retain
from foresight.checksum import xxh3_many
from foresight.errors import CheckpointError

DATA_FILE = "data-00000.bin"


@dataclass
class WriteJob:
    """One snapshot waiting for the writer: the slot it sits in (of ``pool``) and its index fields."""

    handle: SaveHandle
    pool: StagingPool
    slot: Any
    layout: Layout
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    skeleton: Any
    extra_state: Any
    event: Any  # the CUDA event of the snapshot's device-to-host copies, or None
    staged: StagedPrefix | None = None  # how much of the slot the snapshot has copied (None: all of it)


class BackgroundWriter:
    """Writes and commits queued snapshots on one thread, in order; the only thread that commits on ``root``,
    so the commit sequence (from ``next_seq`` on) stays monotonic."""

    def __init__(self, root: str, keep: int | None, fio: FileIO, *, direct: bool, replicate: Any, drain: TierDrain,
                 on_done: Callable[[SaveHandle], None], next_seq: int) -> None:
        self.root, self.keep = root, keep
        self.direct = direct
        self.replicate = replicate
        self._fio = fio
        self._drain = drain
        self._on_done = on_done
        self._next_seq = next_seq
        self._hash_pool = ExitSafePool(1, "hash")
        self._worker = QueueWorker(self._write_one, "foresight-ckpt-writer")

    def put(self, job: WriteJob) -> None:
        self._worker.put(job)

    def join(self) -> None:
        """Wait until every queued snapshot is written (committed or failed)."""
        self._worker.join()

    def stop(self) -> None:
        """End the thread (after the queued writes) and the hash worker."""
        self._worker.stop()
        self._hash_pool.shutdown()

    def _write_one(self, job: WriteJob) -> None:
        h = job.handle
        root = self.root
        tmp = None
        released = False
        try:
            if job.event is not None:
                job.event.synchronize()
            t0 = time.perf_counter()
            tmp = store.new_tmp_dir(root, h.step)
            data_path = os.path.join(tmp, DATA_FILE)
            total = job.layout.total
            view = job.slot.memoryview(total)
            staged = job.staged
            sums = self._hash_pool.submit(_hash_staged, staged, view, job.layout.offsets, job.layout.nbytes)
            fd, _ = self._fio.open(data_path, write=True, direct=self.direct)
            try:
                if total:
                    try:
                        os.posix_fallocate(fd, 0, total)  # no extending writes: they serialise in ext4 DIO
                    except OSError as e:
                        raise CheckpointError(f"cannot allocate data file: {e.strerror}", path=data_path) from e
                self._write_data(fd, view, total, data_path, h.step, tmp, staged)
                os.fsync(fd)
            except OSError as e:
                raise CheckpointError(f"cannot write data file: {e.strerror}", path=data_path) from e
            finally:
                os.close(fd)
                if staged is not None and staged.error is not None:
                    sums.exception()  # the hash worker let go of the slot too (it raised at the failed snapshot)
            digests = sums.result()
            t1 = time.perf_counter()
            h.timings["write"] = t1 - t0
            job.pool.release(job.slot)
            released = True
            self._replication_hook("data_written", h.step, tmp, nbytes=total)  # sends while we commit
            index = {
                "format": store.FORMAT, "version": store.VERSION, "step": h.step, "created": time.time(),
                "torch": torch.__version__,
                "files": [{"name": DATA_FILE, "bytes": total}],
                "tensors": {
                    "name": job.names, "file": [0] * len(job.names), "offset": job.layout.offsets.tolist(),
                    "nbytes": job.layout.nbytes.tolist(), "dtype": job.dtypes, "shape": job.shapes,
                    "xxh3": [f"{d:016x}" for d in digests.tolist()],
                },
                "skeleton": job.skeleton,
                **job.extra_state,
            }
            seq = self._next_seq  # only this thread commits, so the sequence stays monotonic
            self._next_seq += 1
            store.write_index_and_commit(tmp, index, seq=seq)
            if self._drain.active:
                self._drain.reserve(h.step)
            try:
                h.path = store.publish(tmp, root, h.step)
            except OSError as e:
                if self._drain.active:
                    self._drain.unreserve(h.step)
                raise CheckpointError(f"cannot commit checkpoint: {e.strerror}", path=tmp) from e
            tmp = None
            h.timings["commit"] = time.perf_counter() - t1
            self._replication_hook("committed", h.step, h.path)  # only now may a replica be published
            h._local.set()
            if self._drain.active:
                self._drain.put(h)
            else:
                h._durable.set()
                self._on_done(h)
            retain(root, self.keep, self._drain.protected())  # housekeeping, after the handle is done
        except BaseException as e:  # noqa: BLE001 - surfaced through the handle, never lost
            if not released:
                job.pool.release(job.slot)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self._replication_hook("aborted", h.step)
            h._fail(e if isinstance(e, CheckpointError) else
                    CheckpointError(f"checkpoint write failed: {e}", step=h.step, tier=root))

    def _write_data(self, fd: int, view: memoryview, total: int, path: str, step: int, tmp: str,
                    staged: StagedPrefix | None) -> None:
        """Write the data file; for a step being replicated, in pieces ending where its transfer units end (all
        a few in flight at once), reporting each piece as it lands so its unit leaves while the rest is written (send
        while saving; the first units are small, so the first leaves early, and so are the last, so little is left to
        send at the commit)."""
        wanted = self.replicate is not None and self.replicate.wants(step)
        ends = self.replicate.progress_ends(total) if wanted else []
        if len(ends) <= 1:
            if staged is not None:
                staged.wait(total)
            self._fio.write(fd, view, path=path)
            return
        # the sequence this save gets if it commits (only this thread assigns them): a bucket site names it so
        self._replication_hook("data_started", step, tmp, [(DATA_FILE, total)], seq=self._next_seq)
        self._fio.write_reporting(fd, view, ends, lambda end: self._replication_hook(
            "data_progress", step, {DATA_FILE: end}), path=path, before=None if staged is None else staged.wait)

    def _replication_hook(self, name: str, *args: Any, **kwargs: Any) -> None:
        if self.replicate is None:
            return
        try:
            getattr(self.replicate, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a replica is an extra: its failure never fails the save
            warnings.warn(f"foresight.checkpoint: replication {name} failed: {e}", RuntimeWarning, stacklevel=1)


def _hash_staged(staged: StagedPrefix | None, view: memoryview, offsets: Any, nbytes: Any) -> Any:
    """The tensors' xxh3 once the snapshot has copied them all (the hash worker waits for it, not the writer)."""
    if staged is not None:
        staged.wait(len(view))
    return xxh3_many(view, offsets, nbytes)
