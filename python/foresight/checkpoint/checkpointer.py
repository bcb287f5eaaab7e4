"""Asynchronous checkpointing: snapshot to staging, return to training, write, commit, drain to tiers.

``save`` flattens the state dict, copies every tensor into a pinned staging slot (batched for small
tensors, multi-threaded memcpy for big ones, async D2H copies for CUDA tensors) and returns a
:class:`SaveHandle`. A writer thread then writes the slot to the fastest tier as one aligned region
(checksumming tensors meanwhile), commits atomically (:mod:`.store`), frees the slot, and hands the
committed directory to a drain thread that copies it to each slower tier. Each tier keeps at most
``keep`` checkpoints. A background failure is re-raised by ``handle.wait()`` or by the next ``save()``
(or ``close()``), whichever comes first; it is never dropped.

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
import json
import os
import queue
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from foresight.checkpoint import store
from foresight.checksum import xxh3_many
from foresight.checkpoint._fileio import FileIO
from foresight.checkpoint._recovery import holds_commit, lock_roots, recover_roots, release, undrained
from foresight.checkpoint._tree import flatten, match_targets, restore_into, unflatten
from foresight.checkpoint._workers import Workers
from foresight.checkpoint.layout import Layout, dtype_from_name, plan_layout
from foresight.checkpoint.reader import read_checkpoint
from foresight.checkpoint.staging import StagingPool, copy_into
from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir

DATA_FILE = "data-00000.bin"


@dataclass
class LoadedCheckpoint:
    """What :func:`load` returns: the restored state dict and the state saved alongside it."""

    step: int
    state_dict: Any
    extra_state: Any
    path: str
    tier: int


class SaveHandle:
    """Tracks one save. ``wait()`` blocks until it is committed (and drained, with ``durable=True``)."""

    def __init__(self, step: int, owner: Checkpointer) -> None:
        self.step = step
        self.path: str | None = None  # the committed directory on the fastest tier
        # seconds spent in each phase: "snapshot" (caller's thread), "write" (data file written and
        # fsynced), "commit" (index, marker, rename); filled in as the phases finish
        self.timings: dict[str, float] = {}
        self.nbytes = 0  # bytes of the data file
        self._owner = owner
        self._local = threading.Event()
        self._durable = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._drain_tiers: set[int] | None = None  # slower tiers to copy to (None: all)

    def done(self, *, durable: bool = True) -> bool:
        """True once written and committed (to every tier when ``durable``), or failed."""
        return (self._durable if durable else self._local).is_set()

    def wait(self, *, durable: bool = True, timeout: float | None = None) -> SaveHandle:
        """Block until done; re-raise a background failure as :class:`CheckpointError`."""
        if not (self._durable if durable else self._local).wait(timeout):
            raise CheckpointError("timed out waiting for checkpoint", step=self.step, timeout=timeout)
        self._raise()
        return self

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._local.set()
        self._durable.set()

    def _raise(self) -> None:
        if self._error is not None:
            self._reported = True
            self._owner._forget(self)
            err = self._error
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"background checkpoint write failed: {err}", step=self.step) from err


@dataclass
class _Job:
    handle: SaveHandle
    slot: Any
    layout: Layout
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    skeleton: Any
    extra_state: Any
    event: Any


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
        replicate: a :class:`foresight.checkpoint.replicate.Replication`: its ``data_written``, ``committed``
            and ``aborted`` hooks run on the writer thread (a failing hook warns; the save itself stands).

    Attributes set at start-up: ``quarantined`` (paths moved aside), ``resumed`` (handles of the drains
    resumed for a predecessor; their failures are reported like any save's).
    """

    def __init__(self, tiers: str | os.PathLike | Sequence[str | os.PathLike], *,
                 keep: int | None | Sequence[int | None] = None, staging_bytes: int | None = None,
                 slots: int = 1, on_busy: str = "block", verify: bool = True, direct: bool = True,
                 io_threads: int = 4, chunk_bytes: int = 8 << 20, replicate: Any = None) -> None:
        roots = [os.fspath(tiers)] if isinstance(tiers, (str, os.PathLike)) else [os.fspath(t) for t in tiers]
        if not roots:
            raise ValueError("tiers must name at least one directory")
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
        self._locks = lock_roots(roots)  # before touching anything in the roots
        try:
            self.quarantined = recover_roots(roots)
            self._next_seq = store.max_seq(roots) + 1  # commit order continues across restarts and tiers
            to_resume = undrained(roots)
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
            release(self._locks)
            raise
        self._fio, self._load_fio = self._fios[:2]
        self._drain_fio = self._fios[2] if len(roots) > 1 else None
        self._hash_pool = Workers(1, "hash")
        self._lock = threading.Lock()
        self._unreported: list[SaveHandle] = []
        self._pending_drain: Counter[int] = Counter()  # steps (on tier 0) still to be copied to slower tiers
        self._write_q: queue.Queue = queue.Queue()
        self._drain_q: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="foresight-ckpt-writer", daemon=True)
        self._writer.start()
        # finish queued saves at interpreter exit (daemon threads would otherwise die mid-write) and report
        # a failure there rather than lose it; a weak reference so the hook does not keep us alive
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c._close_at_exit())
        self._drainer = None
        self.resumed: list[SaveHandle] = []
        if len(roots) > 1:
            self._drainer = threading.Thread(target=self._drain_loop, name="foresight-ckpt-drain", daemon=True)
            self._drainer.start()
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
        extra = _encode_extra_state(extra_state, step)
        tensors, names, skeleton = flatten(state_dict)
        dtypes = [str(t.dtype) for t in tensors]
        shapes = [tuple(t.shape) for t in tensors]
        itemsize = [t.element_size() for t in tensors]
        nbytes = [t.numel() * isz for t, isz in zip(tensors, itemsize)]
        layout = plan_layout(nbytes, itemsize)
        if self._staging_bytes is None and (self._pool is None or layout.total > self._pool.slot_bytes):
            # automatic sizing: (re)allocate with headroom once the in-flight writes are done with the old pool
            self._write_q.join()
            if self._pool is not None:
                self._pool.close()
            self._pool = StagingPool(max(layout.total + layout.total // 8, 4096), slots=self.slots,
                                     on_busy=self.on_busy)
        slot = self._pool.acquire(layout.total)
        handle = SaveHandle(step, self)
        try:
            views = slot.views((tuple(dtypes), tuple(shapes)), layout, dtypes, shapes)
            big = [i for i, n in enumerate(nbytes) if n >= 1 << 20]
            small = [i for i, n in enumerate(nbytes) if n < 1 << 20]
            event = copy_into(views, tensors, small=small, big=big)
        except BaseException:
            self._pool.release(slot)
            raise
        handle.timings["snapshot"] = time.perf_counter() - t0
        handle.nbytes = layout.total
        with self._lock:
            self._unreported.append(handle)
        self._write_q.put(_Job(handle, slot, layout, names, dtypes, [list(s) for s in shapes], skeleton, extra,
                               event))
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
                        fio=self._load_fio, direct=self.direct, _buffer=slot.buffer if slot else None)
        finally:
            if slot is not None:
                self._pool.release(slot)

    def steps(self) -> list[int]:
        """Committed steps on any tier, ascending."""
        return sorted(set().union(*(store.committed_steps(r) for r in self.tiers)))

    def wait(self) -> None:
        """Wait for every queued save and drain; raise any unreported failure."""
        self._write_q.join()
        self._drain_q.join()
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
            self._write_q.put(None)
            if self._drainer is not None:
                self._drain_q.put(None)
            self._writer.join()
            if self._drainer is not None:
                self._drainer.join()
            if self._pool is not None:
                self._pool.close()
            self._hash_pool.shutdown()
            for fio in self._fios:
                fio.close()
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

    def _writer_loop(self) -> None:
        while True:
            job = self._write_q.get()
            try:
                if job is None:
                    return
                self._write_one(job)
            finally:
                self._write_q.task_done()

    def _write_one(self, job: _Job) -> None:
        h = job.handle
        root = self.tiers[0]
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
            sums = self._hash_pool.submit(xxh3_many, view, job.layout.offsets, job.layout.nbytes)
            fd, _ = self._fio.open(data_path, write=True, direct=self.direct)
            try:
                if total:
                    try:
                        os.posix_fallocate(fd, 0, total)  # no extending writes: they serialise in ext4 DIO
                    except OSError as e:
                        raise CheckpointError(f"cannot allocate data file: {e.strerror}", path=data_path) from e
                self._write_data(fd, view, total, data_path, h.step, tmp)
                os.fsync(fd)
            except OSError as e:
                raise CheckpointError(f"cannot write data file: {e.strerror}", path=data_path) from e
            finally:
                os.close(fd)
            digests = sums.result()
            t1 = time.perf_counter()
            h.timings["write"] = t1 - t0
            self._pool.release(job.slot)
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
            with self._lock:
                if len(self.tiers) > 1:
                    self._pending_drain[h.step] += 1
            try:
                h.path = store.publish(tmp, root, h.step)
            except OSError as e:
                with self._lock:
                    self._pending_drain[h.step] -= 1
                raise CheckpointError(f"cannot commit checkpoint: {e.strerror}", path=tmp) from e
            tmp = None
            h.timings["commit"] = time.perf_counter() - t1
            self._replication_hook("committed", h.step, h.path)  # only now may a replica be published
            h._local.set()
            if len(self.tiers) > 1:
                self._drain_q.put(h)
            else:
                h._durable.set()
                self._forget_if_ok(h)
            _retain(root, self.keep[0], self._protected())  # housekeeping, after the handle is done
        except BaseException as e:  # noqa: BLE001 - surfaced through the handle, never lost
            if not released:
                self._pool.release(job.slot)
            if tmp is not None:
                _rmtree_quiet(tmp)
            self._replication_hook("aborted", h.step)
            h._fail(e if isinstance(e, CheckpointError) else
                    CheckpointError(f"checkpoint write failed: {e}", step=h.step, tier=root))

    def _write_data(self, fd: int, view: memoryview, total: int, path: str, step: int, tmp: str) -> None:
        """Write the data file; for a step being replicated, in pieces of a transfer unit (all submitted at once),
        reporting each piece as it lands so its unit leaves while the rest is written (send while saving)."""
        piece = getattr(self.replicate, "progress_bytes", 0) if self.replicate is not None else 0
        piece -= piece % 4096  # direct I/O: pieces start aligned
        if piece <= 0 or total <= piece or not self.replicate.wants(step):
            self._fio.write(fd, view, path=path)
            return
        self._replication_hook("data_started", step, tmp, [(DATA_FILE, total)])
        self._fio.write_reporting(fd, view, piece, lambda end: self._replication_hook(
            "data_progress", step, {DATA_FILE: end}), path=path)

    def _replication_hook(self, name: str, *args: Any, **kwargs: Any) -> None:
        if self.replicate is None:
            return
        try:
            getattr(self.replicate, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a replica is an extra: its failure never fails the save
            warnings.warn(f"foresight.checkpoint: replication {name} failed: {e}", RuntimeWarning, stacklevel=1)

    def _forget_if_ok(self, h: SaveHandle) -> None:
        if h._error is None:
            self._forget(h)

    def _protected(self) -> set[int]:
        with self._lock:
            return {step for step, n in self._pending_drain.items() if n > 0}

    def _drain_loop(self) -> None:
        while True:
            h = self._drain_q.get()
            try:
                if h is None:
                    return
                root = self.tiers[0]
                try:
                    marker = store.read_marker(h.path)
                    for tier, (root, keep) in enumerate(zip(self.tiers[1:], self.keep[1:]), start=1):
                        if h._drain_tiers is not None and tier not in h._drain_tiers:
                            continue
                        if not holds_commit(root, h.step, marker):  # a resumed drain may find it there
                            copy_checkpoint(h.path, root, h.step, fio=self._drain_fio)
                        _retain(root, keep, ())
                except BaseException as e:  # noqa: BLE001
                    h._fail(e if isinstance(e, CheckpointError) else
                            CheckpointError(f"drain failed: {e}", step=h.step, tier=root))
                finally:
                    with self._lock:
                        self._pending_drain[h.step] -= 1
                    _retain(self.tiers[0], self.keep[0], self._protected())
                h._durable.set()
                self._forget_if_ok(h)
            finally:
                self._drain_q.task_done()

    def _resume_drain(self, commit: store.Commit, tiers: set[int]) -> None:
        """Queue the drain of a local commit that a killed predecessor never finished copying to ``tiers``."""
        h = SaveHandle(commit.step, self)
        h.path = commit.path
        h._drain_tiers = tiers
        h._local.set()
        with self._lock:
            self._unreported.append(h)
            self._pending_drain[commit.step] += 1
        self.resumed.append(h)
        self._drain_q.put(h)


def _encode_extra_state(extra_state: Any, step: int) -> dict[str, Any]:
    """Index fields for ``extra_state``: plain JSON as ``extra_state`` (what other tools read) and, when
    JSON alone would change it (int keys, tuples, nan), an exact encoding as ``extra_state_exact``."""
    try:
        tensors, names, tree = flatten(extra_state)
    except CheckpointError as e:
        if "key" in e.context:
            what = f"the key {e.context['key']}"
        elif "type" in e.context:
            what = f"a value of type {e.context['type']}"
        else:
            raise CheckpointError(f"extra_state is not JSON-serialisable: {e}", step=step) from None
        raise CheckpointError(f"extra_state is not JSON-serialisable: it holds {what} (dicts, lists, tuples and "
                              "str/int/float/bool/None can be saved exactly)", step=step,
                              at=e.context.get("at")) from None
    if tensors:
        raise CheckpointError("extra_state holds a tensor; put tensors in the state dict", step=step,
                              at=names[0] or "<root>")
    try:
        plain = json.loads(json.dumps(extra_state))  # a deep copy, and what JSON makes of it
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state is not JSON-serialisable: {e}", step=step) from e
    return {"extra_state": plain} if plain == extra_state else {"extra_state": plain, "extra_state_exact": tree}


def _decode_extra_state(index: dict[str, Any]) -> Any:
    tree = index.get("extra_state_exact")
    return index.get("extra_state") if tree is None else unflatten(tree, [])


def _retain(root: str, keep: int | None, protect: Any) -> None:
    """Apply retention; a failure to delete an old checkpoint is a warning, never a failed save."""
    try:
        store.apply_retention(root, keep, protect=protect)
    except OSError as e:
        warnings.warn(f"foresight.checkpoint: retention in {root} failed: {e}", RuntimeWarning, stacklevel=1)


def _rmtree_quiet(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def copy_checkpoint(src: str, root: str, step: int, *, fio: FileIO | None = None) -> str:
    """Copy the committed checkpoint dir ``src`` into tier ``root`` with the same atomic commit."""
    os.makedirs(root, exist_ok=True)
    tmp = store.new_tmp_dir(root, step)
    try:
        names = sorted(os.listdir(src), key=lambda n: n == store.COMMIT)  # COMMIT last
        for name in names:
            _copy_file(os.path.join(src, name), os.path.join(tmp, name), fio)
        fsync_dir(tmp)
        return store.publish(tmp, root, step)
    except BaseException as e:
        _rmtree_quiet(tmp)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise CheckpointError(f"cannot copy checkpoint: {e.strerror}", path=src, tier=root) from e
        raise


_BOUNCE = 64 << 20


def _copy_file(src: str, dst: str, fio: FileIO | None) -> None:
    """Copy one file; large page-multiple files go through an aligned bounce buffer with O_DIRECT
    (buffered writes + fsync run at a fraction of the disk's speed here)."""
    size = os.stat(src).st_size
    if fio is None or size < (1 << 20) or size % 4096:
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        return
    import mmap

    bounce = mmap.mmap(-1, min(_BOUNCE, size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    rfd, _ = fio.open(src)
    try:
        wfd, _ = fio.open(dst, write=True)
        try:
            os.posix_fallocate(wfd, 0, size)
            pos = 0
            while pos < size:
                n = min(len(bounce), size - pos)
                view = memoryview(bounce)[:n]
                fio.read(rfd, view, file_offset=pos, path=src)
                fio.write(wfd, view, file_offset=pos, path=dst)
                view.release()
                pos += n
            os.fsync(wfd)
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)
        bounce.close()


# -- module-level convenience --------------------------------------------------------------------------

_default: dict[tuple[str, ...], Checkpointer] = {}


def _tiers_of(root: Any, tiers: Any) -> list[str]:
    if (root is None) == (tiers is None):
        raise ValueError("pass exactly one of root= or tiers=")
    if root is not None:
        return [os.fspath(root)]
    return [os.fspath(tiers)] if isinstance(tiers, (str, os.PathLike)) else [os.fspath(t) for t in tiers]


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
    key = tuple(_tiers_of(root, tiers))
    ckpt = _default.get(key)
    if ckpt is None or ckpt._closed:
        ckpt = _default[key] = Checkpointer(list(key), **config)
    return ckpt.save(state_dict, step, extra_state=extra_state)


def load(step: int | str = "latest", *, root: str | os.PathLike | None = None,
         tiers: Sequence[str | os.PathLike] | None = None, into: Any = None, verify: bool = True,
         fio: FileIO | None = None, direct: bool = True, _buffer: Any = None) -> LoadedCheckpoint:
    """Restore a committed checkpoint, preferring the fastest tier that holds a complete copy.

    ``step`` is an int (its newest commit first) or ``"latest"``: the most recent commit (commit order,
    not the largest step; see :mod:`.store`), and only copies of that commit. With ``into`` (a state dict
    of existing tensors), tensors whose shape and dtype match are filled in place and the rest replaced;
    ``state_dict`` of the result is ``into`` itself then. Without it, the tensors are fresh CPU tensors (views of one read buffer).
    A corrupt copy on one tier falls back to the next tier holding the step; if none is readable the
    first :class:`CheckpointError` (naming file and tensor) is raised.

    Example::

        ck = foresight.checkpoint.load("latest", root="/ckpt", into=model.state_dict())
        loader.load_state_dict(ck.extra_state)
    """
    roots = _tiers_of(root, tiers)
    per_tier = [store.commits(r) for r in roots]
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
    errors: list[CheckpointError] = []
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

            tensors, index = read_checkpoint(path, verify=verify, fio=fio, direct=direct, buffer=_buffer,
                                             targets=pick_targets if into is not None else None)
        except CheckpointError as e:
            errors.append(e)
            continue
        if into is not None:
            state = restore_into(into, index["skeleton"], tensors, clone_new=_buffer is not None, copied=targets)
        else:
            state = unflatten(index["skeleton"], tensors)
        return LoadedCheckpoint(step=step, state_dict=state, extra_state=_decode_extra_state(index), path=path,
                                tier=tier)
    if errors:
        raise errors[0]
    raise CheckpointError("checkpoint step not found on any tier", step=step, tiers=roots)


def latest_step(*, root: str | os.PathLike | None = None,
                tiers: Sequence[str | os.PathLike] | None = None) -> int | None:
    """The step of the most recent commit on any tier (what ``load("latest")`` restores), or ``None``."""
    roots = _tiers_of(root, tiers)
    newest = _newest_commit([store.commits(r) for r in roots])
    return None if newest is None else newest.step


def _newest_commit(per_tier: list[list[store.Commit]]) -> store.Commit | None:
    """The most recent readable commit over all tiers; warns about unreadable markers it had to pass over."""
    good = [c for cs in per_tier for c in cs if c.error is None]
    for c in (c for cs in per_tier for c in cs if c.error is not None):
        warnings.warn(f"foresight.checkpoint: ignoring {c.path} when looking for the latest checkpoint: "
                      f"{c.error}", RuntimeWarning, stacklevel=3)
    return max(good, key=lambda c: c.order, default=None)
