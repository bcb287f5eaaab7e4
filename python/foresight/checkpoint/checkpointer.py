"""The public checkpoint API: :class:`Checkpointer` (snapshot, then write, commit and drain in the background) and
the module-level ``save``/``load``/``latest_step``.

``save`` flattens the state dict, copies every tensor into a pinned staging slot (batched for small
tensors, multi-threaded memcpy for big ones, async D2H copies for CUDA tensors) and returns a
:class:`SaveHandle`. A writer thread writes the slot to the fastest tier as one aligned region (for CPU
tensors it starts with the snapshot: a replicated step's pieces are written, and their units leave, as soon as the
copy has staged them; :class:`~.staging.StagedPrefix`), checksums the tensors once all are copied, commits
atomically (:mod:`.store`), frees the slot, and hands the committed directory to a drain thread that copies it to
each slower tier. Each tier keeps at most
``keep`` checkpoints. A background failure is re-raised by ``handle.wait()`` or by the next ``save()``
(or ``close()``), whichever comes first; it is never dropped. The parts live in their own modules:
:mod:`.save_handle` (what ``save`` returns), :mod:`.background_writer` (the writer thread and its queue),
:mod:`.tier_drain` (copies to slower tiers, retention), :mod:`.loading` (restore), :mod:`.startup_recovery`.

Which checkpoints survive: "latest" and retention follow commit order, not step numbers (see
:mod:`.store`). Saving steps 10, 20 and then 5 (a rollback) with ``keep=2`` keeps 20 and 5, and
``load("latest")`` restores 5: the save a ``wait()`` acknowledged last is never the one retention deletes.

Recovery at start-up: a Checkpointer takes each tier root's lock (a second writer on the same root, in
any process, gets a CheckpointError), removes what dead writers left, moves a ``step-N`` directory that
lost its COMMIT marker aside to ``quarantined-step-N.*`` with a warning (``quarantined``), and drains
committed local steps that a killed predecessor never finished copying to the slower tiers (``resumed``).

Example::

    ckpt = Checkpointer(["/local_nvme/ckpt", "/shared/ckpt"], keep=[2, None], staging_bytes=8 << 30)
    handle = ckpt.save(model.state_dict(), step, extra_state=loader.state_dict())
    ...                                     # keep training; the state is already snapshotted
    restored = ckpt.load("latest", into=model.state_dict())
    loader.load_state_dict(restored.extra_state)
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from foresight.checkpoint import store
from foresight.checkpoint.aligned_io import FileIO
from foresight.checkpoint.background_writer import BackgroundWriter, WriteJob
from foresight.checkpoint.bucket_tier import close_tiers, is_bucket_url, open_tiers, tier_commits
from foresight.checkpoint.layout import plan_layout
from foresight.checkpoint.loading import LoadedCheckpoint, latest_step, load, tiers_of
from foresight.checkpoint.save_handle import SaveHandle
from foresight.checkpoint.staging import StagedPrefix, StagingPool, copy_into
from foresight.checkpoint.startup_recovery import lock_roots, recover_roots, release, undrained
from foresight.checkpoint.state_tree import encode_extra_state, flatten
from foresight.checkpoint.tier_drain import TierDrain, copy_checkpoint
from foresight.errors import CheckpointError

__all__ = ["Checkpointer", "LoadedCheckpoint", "SaveHandle", "copy_checkpoint", "latest_step", "load", "save"]


class Checkpointer:
    """Configuration and background machinery for asynchronous, tiered, atomic checkpoints.

    Args:
        tiers: checkpoint roots, fastest first (node-local disk, then durable storage). A single path is
            one tier.
        keep: how many committed checkpoints each tier keeps: one int for all tiers, or one per tier
            (``None`` = unbounded): the most recent commits, by commit order and not by step number, so
            the checkpoint a ``wait()`` acknowledged last is never deleted.
        staging_bytes: bytes per staging slot, allocated once; a state dict larger than a slot raises
            CheckpointError. ``None`` sizes the pool automatically: at the first save to that state dict plus
            1/8, re-allocated (after in-flight writes finish) when a later state dict does not fit.
        slots: staging slots; with 2, one save may snapshot while the previous one is still writing.
        on_busy: when every slot is still being written, ``"block"`` until one drains or ``"raise"``.
        verify: check per-tensor checksums on load.
        direct: use O_DIRECT for data files where the file system supports it.
        replicate: a :class:`foresight.replication.Replication`: its ``data_written``, ``committed``
            and ``aborted`` hooks run on the writer thread (a failing hook warns; the save itself stands).
        bucket_options: for the ``s3://bucket/prefix`` tiers (any but the first, which the writer writes): keyword
            arguments of :class:`foresight.bucket.objects.BucketPrefix` (``options``, ``retry``, ``part_bytes``,
            ...). A bucket tier is drained to like a directory (see :mod:`.bucket_tier`); a bucket that cannot be
            listed (missing, wrong keys) fails the constructor with one line naming it.

    Attributes set at start-up: ``quarantined`` (paths moved aside), ``resumed`` (handles of the drains
    resumed for a predecessor; their failures are reported like any save's).
    """

    def __init__(self, tiers: str | os.PathLike | Sequence[str | os.PathLike], *,
                 keep: int | None | Sequence[int | None] = None, staging_bytes: int | None = None,
                 slots: int = 1, on_busy: str = "block", verify: bool = True, direct: bool = True,
                 io_threads: int = 4, chunk_bytes: int = 8 << 20, replicate: Any = None,
                 bucket_options: dict[str, Any] | None = None) -> None:
        roots = [os.fspath(tiers)] if isinstance(tiers, (str, os.PathLike)) else [os.fspath(t) for t in tiers]
        if not roots:
            raise ValueError("tiers must name at least one directory")
        if is_bucket_url(roots[0]):
            raise ValueError(f"the first tier is written by the checkpoint writer and must be a local directory, "
                             f"not {roots[0]}: give a bucket as a slower tier, e.g. ['/nvme/ckpt', '{roots[0]}']")
        local = [r for r in roots if not is_bucket_url(r)]
        keeps = list(keep) if isinstance(keep, (list, tuple)) else [keep] * len(roots)
        if len(keeps) != len(roots):
            raise ValueError(f"keep has {len(keeps)} entries for {len(roots)} tiers")
        for k in keeps:
            if k is not None and k < 1:
                raise ValueError(f"keep must be >= 1 or None, got {k}")
        if on_busy not in ("block", "raise"):
            raise ValueError(f"on_busy must be 'block' or 'raise', got {on_busy!r}")
        self.tiers = roots
        self.keep = keeps
        self.verify = verify
        self.direct = direct
        self.replicate = replicate
        self.slots = slots
        self.on_busy = on_busy
        self._staging_bytes = staging_bytes
        self._pool: StagingPool | None = None
        self._fios: list[FileIO] = []
        self._locks = lock_roots(local)  # before touching anything in the roots
        self._buckets = {}
        try:
            self._buckets = open_tiers(roots, bucket_options)
            self.quarantined = recover_roots(local)
            per_tier = {r: tier_commits(r, self._buckets) for r in roots}
            # commit order continues across restarts and tiers
            next_seq = max((c.seq for cs in per_tier.values() for c in cs if c.seq is not None), default=-1) + 1
            to_resume = undrained(roots, per_tier.__getitem__)
            if staging_bytes is not None:
                self._pool = StagingPool(staging_bytes, slots=slots, on_busy=on_busy)
            # one I/O context per thread of use: engine rings are not shared across threads
            for _ in range(3 if len(roots) > 1 else 2):
                self._fios.append(FileIO(chunk_bytes=chunk_bytes, threads=io_threads))
        except BaseException:
            for fio in self._fios:
                fio.close()
            if self._pool is not None:
                self._pool.close()
            close_tiers(self._buckets)
            release(self._locks)
            raise
        self._fio, self._load_fio = self._fios[:2]
        self._lock = threading.Lock()
        self._unreported: list[SaveHandle] = []
        self._closed = False
        self._drain = TierDrain(roots, keeps, self._fios[2] if len(roots) > 1 else None, self._forget_if_ok,
                                buckets=self._buckets)
        self._writer = BackgroundWriter(roots[0], keeps[0], self._fio, direct=direct, replicate=replicate,
                                        drain=self._drain, on_done=self._forget_if_ok, next_seq=next_seq)
        # finish queued saves at interpreter exit (daemon threads would otherwise die mid-write) and report
        # a failure there rather than lose it; a weak reference so the hook does not keep us alive
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c._close_at_exit())
        self.resumed: list[SaveHandle] = []
        for commit, behind in to_resume:
            self._resume_drain(commit, behind)

    # -- public ------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The I/O path in use for data files (``engine:uring``, ``engine:pread`` or ``pwritev``)."""
        return self._fio.backend

    @staticmethod
    def io_backend() -> str:
        """The I/O path a new Checkpointer would use, without creating one."""
        fio = FileIO(threads=1)
        try:
            return fio.backend
        finally:
            fio.close()

    @property
    def staging(self) -> StagingPool | None:
        return self._pool

    def save(self, state_dict: Any, step: int, *, extra_state: Any = None) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the write, commit and drain continue in the background.

        ``extra_state`` (e.g. the data loader's state dict: dicts, lists, tuples, str/int/float/bool/None,
        with keys of those scalar types) is committed with it and loads back exactly, int keys and tuples
        included; anything else raises :class:`CheckpointError` naming its key path at once. Raises
        :class:`CheckpointError` for an earlier save's unreported background failure.
        """
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.raise_pending()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a full collection over a big heap in the middle of the snapshot costs tens of ms
        try:
            return self._snapshot(state_dict, step, extra_state)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _snapshot(self, state_dict: Any, step: int, extra_state: Any) -> SaveHandle:
        t0 = time.perf_counter()
        extra = encode_extra_state(extra_state, step)
        tensors, names, skeleton = flatten(state_dict)
        dtypes = [str(t.dtype) for t in tensors]
        shapes = [tuple(t.shape) for t in tensors]
        itemsize = [t.element_size() for t in tensors]
        nbytes = [t.numel() * isz for t, isz in zip(tensors, itemsize)]
        layout = plan_layout(nbytes, itemsize)
        if self._staging_bytes is None and (self._pool is None or layout.total > self._pool.slot_bytes):
            # automatic sizing: (re)allocate with headroom once the in-flight writes are done with the old pool
            self._writer.join()
            if self._pool is not None:
                self._pool.close()
            self._pool = StagingPool(max(layout.total + layout.total // 8, 4096), slots=self.slots,
                                     on_busy=self.on_busy)
        slot = self._pool.acquire(layout.total)
        handle = SaveHandle(step, self)
        handle.nbytes = layout.total
        staged = StagedPrefix(layout.total)
        on_cpu = not any(t.device.type == "cuda" for t in tensors)
        job = WriteJob(handle, self._pool, slot, layout, names, dtypes, [list(s) for s in shapes], skeleton, extra,
                       None, staged)
        if on_cpu:  # the writer starts now and writes each piece once copied (its unit leaves during the snapshot)
            with self._lock:
                self._unreported.append(handle)
            self._writer.put(job)
        try:
            views = slot.views((tuple(dtypes), tuple(shapes)), layout, dtypes, shapes)
            big = [i for i, n in enumerate(nbytes) if n >= 1 << 20]
            small = [i for i, n in enumerate(nbytes) if n < 1 << 20]
            job.event = copy_into(views, tensors, small=small, big=big, offsets=layout.offsets, staged=staged)
        except BaseException as e:
            if not on_cpu:
                self._pool.release(slot)
                raise
            staged.fail(e)  # the writer gives the slot back and drops the save; the caller gets this error, not it
            self._writer.join()
            self._forget(handle)
            raise
        handle.timings["snapshot"] = time.perf_counter() - t0
        if not on_cpu:  # the writer waits for the copies' CUDA event, then writes the whole slot
            staged.advance(layout.total)
            with self._lock:
                self._unreported.append(handle)
            self._writer.put(job)
        return handle

    def load(self, step: int | str = "latest", *, into: Any = None, verify: bool | None = None) -> LoadedCheckpoint:
        """Restore ``step`` (or the newest) from the fastest tier holding a complete copy; see :func:`load`.

        With ``into``, the data is read into a free staging slot (already allocated and touched, so no
        page faults) and copied into the existing tensors from there.
        """
        slot = None
        if into is not None and self._pool is not None:
            try:
                slot = self._pool.acquire(0, timeout=0)
            except CheckpointError:
                slot = None  # all slots busy writing: fall back to a fresh buffer
        try:
            return load(step, tiers=self.tiers, into=into, verify=self.verify if verify is None else verify,
                        fio=self._load_fio, direct=self.direct, _buffer=slot.buffer if slot else None,
                        _buckets=self._buckets)
        finally:
            if slot is not None:
                self._pool.release(slot)

    def steps(self) -> list[int]:
        """Committed steps on any tier, ascending."""
        return sorted({c.step for r in self.tiers for c in tier_commits(r, self._buckets) if c.error is None})

    def wait(self) -> None:
        """Wait for every queued save and drain; raise any unreported failure."""
        self._writer.join()
        self._drain.join()
        self.raise_pending()

    def raise_pending(self) -> None:
        """Raise the first unreported background failure, if any (and mark it reported)."""
        with self._lock:
            failed = [h for h in self._unreported if h._error is not None]
        if failed:
            failed[0]._raise()

    def close(self) -> None:
        """Finish all pending work, stop the threads, free the staging pool; raise unreported failures."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.stop()
            self._drain.stop()
            if self._pool is not None:
                self._pool.close()
            for fio in self._fios:
                fio.close()
            close_tiers(self._buckets)
            release(self._locks)  # last: nothing of ours touches the roots any more

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except CheckpointError as e:
            print(f"foresight.checkpoint: unreported checkpoint failure at exit: {e}", file=sys.stderr)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background --------------------------------------------------------------------------------
    def _forget(self, handle: SaveHandle) -> None:
        with self._lock:
            if handle in self._unreported:
                self._unreported.remove(handle)

    def _forget_if_ok(self, h: SaveHandle) -> None:
        if h._error is None:
            self._forget(h)

    def _resume_drain(self, commit: store.Commit, tiers: set[int]) -> None:
        """Queue the drain of a local commit that a killed predecessor never finished copying to ``tiers``."""
        h = SaveHandle(commit.step, self)
        h.path = commit.path
        h._drain_tiers = tiers
        h._local.set()
        with self._lock:
            self._unreported.append(h)
        self._drain.reserve(commit.step)
        self.resumed.append(h)
        self._drain.put(h)


# -- module-level convenience --------------------------------------------------------------------------

_default: dict[tuple[str, ...], Checkpointer] = {}


def save(state_dict: Any, step: int, *, root: str | os.PathLike | None = None,
         tiers: Sequence[str | os.PathLike] | None = None, extra_state: Any = None, **config: Any) -> SaveHandle:
    """Asynchronously checkpoint ``state_dict`` as ``step`` under ``root`` (or ``tiers``, fastest first).

    A :class:`Checkpointer` per tier list is created on first use with ``config`` (``keep``,
    ``staging_bytes``, ``slots``, ``on_busy``, ...) and reused afterwards; it holds the roots' writer locks
    until the interpreter exits, so do not open another Checkpointer on those roots in the same job.

    Example::

        h = foresight.checkpoint.save(model.state_dict(), 100, root="/ckpt", extra_state=loader.state_dict())
        h.wait()
    """
    key = tuple(tiers_of(root, tiers))
    ckpt = _default.get(key)
    if ckpt is None or ckpt._closed:
        ckpt = _default[key] = Checkpointer(list(key), **config)
    return ckpt.save(state_dict, step, extra_state=extra_state)
