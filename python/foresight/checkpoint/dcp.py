"""``torch.distributed.checkpoint`` storage plug-ins that write and read through foresight's I/O path (the
writer here; the reader, :class:`~foresight.checkpoint.dcp_reader.ForesightStorageReader`, in ``dcp_reader``).

``dcp.save``/``dcp.async_save``/``dcp.load`` (with resharding on load) work unchanged with
``storage_writer=ForesightStorageWriter(path)`` and ``storage_reader=ForesightStorageReader(path)``. Each
rank packs all its items into one data file with foresight's layout (small items densely, big ones at
4096-byte boundaries), writes it with large O_DIRECT requests through the C I/O engine, and records a
per-item xxh3 in the metadata; the reader coalesces the extents it needs into few large aligned reads
and verifies each item. ``.metadata`` is written last (fsynced, then renamed), so a checkpoint without
it is incomplete; with ``use_collectives=False`` each rank writes its own ``__<rank>.metadata``, as
PyTorch's ``FileSystemWriter`` does. The writer is also an ``AsyncStager`` that stages into a CPU copy
allocated once and reused by every ``dcp.async_save`` (``cache_staged_state_dict=True``) until the state
dict's structure changes. Quantized tensors are stored with ``torch.save`` as PyTorch's writer stores
them; every other dtype as raw bytes (see :data:`foresight.checkpoint.layout.DTYPES`).

A checkpoint path may be a bucket (``s3://bucket/prefix/step-100``): each rank's packed buffer is uploaded
straight from memory as one multipart object (parts sent concurrently; no local copy: the buffer is already whole
in memory), checked by size and ETag, and the ETag recorded in the metadata; the coordinator checks every rank's
object again and writes ``.metadata`` last, so a checkpoint without it in the bucket is incomplete. The reader
fetches the extents a rank needs in coalesced ranged GETs pinned to the recorded ETags. ``drain_to`` may be a
bucket too: the finished local directory is uploaded there, ``.metadata`` last. See docs/buckets.md.

PyTorch's ``FileSystemReader`` (what ``dcp.load(checkpoint_id=path)`` picks: DCP's storage detection has
no way to register another reader) cannot decode these files and says so, naming this module's reader;
this reader names PyTorch's for a checkpoint PyTorch's writer made.

Example::

    import torch.distributed.checkpoint as dcp
    from foresight.checkpoint import ForesightStorageWriter, ForesightStorageReader

    dcp.save(model.state_dict(), storage_writer=ForesightStorageWriter("/ckpt/step-100"))
    dcp.load(model.state_dict(), storage_reader=ForesightStorageReader("/ckpt/step-100"))
"""
from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from foresight.bucket.multipart import abort_left_open
from foresight.bucket.objects import BucketPrefix
from foresight.bucket.url import is_bucket_url
from foresight.checkpoint import store
from foresight.checkpoint.aligned_io import FileIO, copy_file
from foresight.checkpoint.layout import ALIGN, REFUSED, TORCH_SAVE, align_up, dtype_info, plan_layout
from foresight.checkpoint.state_tree import structure_key
from foresight.checksum import xxh3_many
from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir

METADATA = ".metadata"
_BYTES = "bytes"
# prefix of the recorded dtype of an item stored whole by torch.save ("torch.save:torch.qint8"), so that
# code that views items as raw bytes of their dtype finds an unknown dtype instead of misreading them
_SERIALIZED = f"{TORCH_SAVE}:"
_THIS_WRITER = "foresight.checkpoint.ForesightStorageWriter"
_THIS_READER = "storage_reader=foresight.checkpoint.ForesightStorageReader(path)"
# the storage info other writers record per item -> (that writer, the reader that loads its checkpoints)
_OTHER_WRITERS = {
    "torch.distributed.checkpoint.filesystem._StorageInfo": (
        "PyTorch's torch.distributed.checkpoint.FileSystemWriter",
        "torch.distributed.checkpoint.FileSystemReader(path) (dcp.load(..., checkpoint_id=path) picks it)"),
}


def metadata_name(rank: int | None) -> str:
    """``.metadata``, or ``__<rank>.metadata`` for a rank that saved with ``use_collectives=False``."""
    return METADATA if rank is None else f"__{rank}{METADATA}"


@dataclass
class ForesightStorageInfo:
    """Where one DCP item lives: file, byte range, how to view it, and its xxh3."""

    relative_path: str
    offset: int
    length: int
    dtype: str  # "torch.bfloat16" (raw bytes of that dtype), "bytes", or "torch.save:torch.qint8"
    shape: tuple[int, ...]
    xxh3: int
    etag: str | None = None  # the data object's ETag, for a checkpoint in a bucket (read with getattr: older
    #                          pickles lack it)

    @property
    def transform_descriptors(self) -> None:
        # Only PyTorch's FileSystemReader asks for this (dcp.load(checkpoint_id=...) picks that reader for
        # any directory). It cannot decode raw items, so tell its user which reader can.
        raise CheckpointError(f"this checkpoint was written by {_THIS_WRITER}; PyTorch's FileSystemReader "
                              f"cannot read it: load it with {_THIS_READER}", file=self.relative_path)


@dataclass
class _Prefix:
    prefix: str
    save: str = ""  # the coordinator's save id, handed to every rank (a replicating writer names its aborts by it)


def _bytes_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _other_writer_error(storage_data: Any, path: str) -> CheckpointError | None:
    """The error for metadata whose items another writer recorded (None when foresight wrote them all)."""
    infos = storage_data.values() if isinstance(storage_data, dict) else [storage_data]
    other = next((v for v in infos if not isinstance(v, ForesightStorageInfo)), None)
    if other is None:
        return None
    cls = f"{type(other).__module__}.{type(other).__qualname__}"
    writer, reader = _OTHER_WRITERS.get(cls, (f"a writer that records {cls}", "that writer's StorageReader"))
    return CheckpointError(f"this checkpoint was written by {writer}, not {_THIS_WRITER}: load it with {reader}",
                           path=path)


def _aligned_buffer(nbytes: int) -> torch.Tensor:
    mm = mmap.mmap(-1, max(align_up(nbytes), ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8)


class _DirectoryCheckpoint:
    """What DCP asks of a storage writer and reader alike: the checkpoint is the directory (or bucket prefix)
    ``self.path``."""

    path: str
    bucket_options: dict[str, Any] | None = None
    _bucket: BucketPrefix | None = None
    _bucket_path: str | None = None

    @property
    def in_bucket(self) -> bool:
        return is_bucket_url(self.path)

    def _objects(self) -> BucketPrefix:
        """The bucket prefix of an ``s3://`` checkpoint (one client per path, made on first use)."""
        if self._bucket is None or self._bucket_path != self.path:  # reset() may have moved the checkpoint
            self.close()
            self._bucket = BucketPrefix(self.path, **(self.bucket_options or {}))
            self._bucket_path = self.path
        return self._bucket

    def close(self) -> None:
        """Close the bucket client, if one was made (its threads end with it)."""
        if self._bucket is not None:
            self._bucket.close()
            self._bucket = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_bucket"] = None  # a client is not pickled: the copy makes its own
        return state

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class ForesightStorageWriter(_DirectoryCheckpoint, BlockingAsyncStager, StorageWriter):
    """DCP ``StorageWriter`` over foresight's packed, aligned, checksummed data files.

    Args:
        path: the checkpoint directory (one per checkpoint, as with ``FileSystemWriter``).
        direct: O_DIRECT writes where the file system supports them.
        cache_staged_state_dict: for ``dcp.async_save``, stage into one CPU copy reused across saves.
        drain_to: a slower, durable tier: after each checkpoint is finished, the coordinator copies the
            whole directory to ``drain_to/<name>`` in the background (temp dir + atomic rename, like the
            fast tier; to a bucket ``s3://...``: multipart uploads, ``.metadata`` last). A drain failure is
            raised by :meth:`wait_drain` or by the next ``finish``. Needs ``use_collectives=True`` (the
            default): only then does one rank know all are done.
        bucket_options: for an ``s3://`` ``path`` or ``drain_to``: keyword arguments of
            :class:`foresight.bucket.objects.BucketPrefix` (``options``, ``retry``, ``part_bytes``, ...).
    """

    def __init__(self, path: str | os.PathLike, *, direct: bool = True, cache_staged_state_dict: bool = True,
                 io_threads: int = 4, drain_to: str | os.PathLike | None = None,
                 bucket_options: dict[str, Any] | None = None) -> None:
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.drain_to = os.fspath(drain_to) if drain_to is not None else None
        self._drain_thread: threading.Thread | None = None
        self._drain_error: BaseException | None = None
        StorageWriter.__init__(self)
        self.path = os.fspath(path)
        self.bucket_options = bucket_options
        if drain_to is not None and self.in_bucket:
            raise ValueError(f"drain_to applies to a local checkpoint path, not {self.path}")
        self.direct = direct
        self.io_threads = io_threads
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.use_collectives = True
        self._buffer: torch.Tensor | None = None  # packing buffer, grown when needed, reused across saves
        self._staged_key: tuple | None = None  # structure_key of the state dict state_dict_cache copies

    def stage(self, state_dict: Any) -> Any:
        """A training-safe CPU copy of ``state_dict`` for ``dcp.async_save`` (pinned only with CUDA).

        Values other than tensors (numpy arrays, sets, objects) are deep-copied, as PyTorch's own stager
        does. The cached copy is rebuilt when keys, shapes, dtypes or placements changed (copying into
        the old one would fail, or broadcast and convert without a word).
        """
        from torch.distributed._state_dict_utils import (
            _copy_state_dict,
            _create_cpu_state_dict,
        )

        if not self.cache_staged_state_dict:
            return _copy_state_dict(state_dict, _create_cpu_state_dict(state_dict), type_check=False)
        key = structure_key(state_dict)
        if self.state_dict_cache is None or key != self._staged_key:
            self.state_dict_cache = None  # free the old copy before allocating the new one
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._staged_key = key
        return _copy_state_dict(state_dict, self.state_dict_cache, type_check=False)

    # -- protocol ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:  # refuse before any file is written
            info = dtype_info(item.tensor_data.properties.dtype) if item.tensor_data is not None else None
            if info is not None and info.stored == REFUSED:
                raise CheckpointError(f"{info.name} tensors cannot be saved: {info.why}", item=item.index.fqn)
        if not self.use_collectives and self.drain_to is not None:
            raise CheckpointError("drain_to needs use_collectives=True: without collectives no rank knows when "
                                  "the others have finished the checkpoint", path=self.path)
        if not self.in_bucket:
            os.makedirs(self.path, exist_ok=True)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_Prefix(f"__{i}_", self.save_id)) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix if plan.storage_data is not None else f"__{self.rank or 0}_"
        name = f"{prefix}data.bin"
        items = list(plan.items)
        srcs: list[torch.Tensor] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                t = _bytes_tensor(data.getvalue() if isinstance(data, io.BytesIO) else bytes(data))
                dtypes.append(_BYTES)
            else:
                t = data.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                if dtype_info(t.dtype).stored == TORCH_SAVE:
                    dtypes.append(f"{_SERIALIZED}{t.dtype}")
                    blob = io.BytesIO()
                    torch.save(t, blob)
                    t = _bytes_tensor(blob.getvalue())
                else:
                    dtypes.append(str(t.dtype))
            srcs.append(t)
            shapes.append(tuple(t.shape))
        nbytes = [t.numel() * t.element_size() for t in srcs]
        layout = plan_layout(nbytes, [t.element_size() for t in srcs])
        # the packing buffer lives as long as the writer: reuse one writer across saves to avoid paying
        # for fresh memory (page faults) every time
        if self._buffer is None or self._buffer.numel() < layout.total:
            self._buffer = None
            self._buffer = _aligned_buffer(layout.total)
        buf = self._buffer
        views = [buf[o:o + n].view(t.dtype).view(t.shape)
                 for o, n, t in zip(layout.offsets.tolist(), nbytes, srcs)]
        if views:
            with torch.no_grad():
                torch._foreach_copy_(views, srcs)
        view = memoryview(buf.numpy())[:layout.total]
        sums = xxh3_many(view, layout.offsets, layout.nbytes)
        # the file's tensor chunks before a byte is written (a replicating subclass ships them: merge on arrival)
        self._layout_rows = [
            [item.index.fqn, name, o, n, dt, list(shape), list(item.tensor_data.chunk.offsets),
             list(item.tensor_data.size)]
            for item, o, n, dt, shape in zip(items, layout.offsets.tolist(), nbytes, dtypes, shapes)
            if item.type != WriteItemType.BYTE_IO and not dt.startswith(_SERIALIZED)]
        etag = None
        if self.in_bucket:
            try:  # straight from the packing buffer: one multipart object, checked by size and ETag
                etag = self._objects().put(name, view).etag
            finally:
                view.release()
        else:
            self._write_local(name, view, layout.total)
        results = [
            WriteResult(index=item.index, size_in_bytes=n,
                        storage_data=ForesightStorageInfo(name, o, n, dt, shape, int(h), etag))
            for item, o, n, dt, shape, h in zip(items, layout.offsets.tolist(), nbytes, dtypes, shapes,
                                                sums.tolist())
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_local(self, name: str, view: memoryview, total: int) -> None:
        """Write this rank's packed buffer to its data file, fsynced."""
        fio = FileIO(threads=self.io_threads)
        path = os.path.join(self.path, name)
        try:
            fd, _ = fio.open(path, write=True, direct=self.direct)
            try:
                if total:
                    os.posix_fallocate(fd, 0, total)
                self._write_file(fio, fd, view, path)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            view.release()
            fio.close()

    def _write_file(self, fio: FileIO, fd: int, view: memoryview, path: str) -> None:
        """Write this rank's packed data file (a subclass may report progress as it goes)."""
        fio.write(fd, view, path=path)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.wait_drain()  # one drain at a time; surfaces an earlier drain's failure
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        # without collectives every rank finishes on its own: one metadata file each, or they would race
        name = metadata_name(None if self.use_collectives else self.rank)
        if self.in_bucket:
            self._finish_in_bucket(name, metadata)
            return
        tmp = os.path.join(self.path, name + ".tmp")
        store.write_small_file(tmp, pickle.dumps(metadata))
        os.replace(tmp, os.path.join(self.path, name))
        fsync_dir(self.path)
        if self.drain_to is not None:
            # not a daemon: the interpreter waits for a drain in progress before exiting
            self._drain_thread = threading.Thread(target=self._drain, args=(self.path,), name="foresight-dcp-drain")
            self._drain_thread.start()

    def _finish_in_bucket(self, name: str, metadata: Metadata) -> None:
        """Check that every data object the metadata names is in the bucket as written, then put the metadata."""
        objects = self._objects()
        written: dict[str, tuple[int, str | None]] = {}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            size, etag = written.get(info.relative_path, (0, getattr(info, "etag", None)))
            written[info.relative_path] = (max(size, end), etag)
        for rel, (needed, etag) in written.items():
            ref = objects.head(rel)
            if ref.size < needed or (etag and ref.etag != etag):
                raise CheckpointError(f"DCP data object is not as written ({ref.size} bytes, ETag {ref.etag}; "
                                      f"expected at least {needed} bytes, ETag {etag})", path=str(ref.url))
        objects.put(name, pickle.dumps(metadata))  # last: a checkpoint without it is incomplete
        # a create retried after its reply was lost left an upload open (empty) for one of these objects; only
        # theirs: without collectives the other ranks' objects are not this finish's
        abort_left_open(objects.fetcher, [*written, name], options=(self.bucket_options or {}).get("options"))

    def wait_drain(self) -> None:
        """Wait for the background copy to ``drain_to``; raise CheckpointError if it failed."""
        if self._drain_thread is not None:
            self._drain_thread.join()
            self._drain_thread = None
        if self._drain_error is not None:
            err, self._drain_error = self._drain_error, None
            raise CheckpointError(f"drain to durable tier failed: {err}", path=self.drain_to) from err

    def _drain(self, src: str) -> None:
        if is_bucket_url(self.drain_to):
            self._drain_to_bucket(src)
            return
        try:
            os.makedirs(self.drain_to, exist_ok=True)
            name = os.path.basename(os.path.normpath(src))
            tmp = os.path.join(self.drain_to, f".tmp-{name}.{uuid.uuid4().hex[:8]}")
            os.makedirs(tmp)
            fio = FileIO(threads=self.io_threads)
            try:
                for f in sorted(os.listdir(src), key=lambda n: n == METADATA):  # .metadata last
                    if not f.endswith(".tmp"):
                        copy_file(os.path.join(src, f), os.path.join(tmp, f), fio)
            finally:
                fio.close()
            fsync_dir(tmp)
            store.publish_dir(tmp, os.path.join(self.drain_to, name))
        except BaseException as e:  # noqa: BLE001 - reported by wait_drain
            self._drain_error = e

    def _drain_to_bucket(self, src: str) -> None:
        """Upload the finished directory ``src`` to ``drain_to/<name>/``: data files (multipart, concurrently),
        then ``.metadata`` last, each checked by size and ETag."""
        try:
            name = os.path.basename(os.path.normpath(src))
            with BucketPrefix(f"{self.drain_to.rstrip('/')}/{name}", **(self.bucket_options or {})) as objects:
                files = [f for f in os.listdir(src) if not f.endswith(".tmp")]
                data = [f for f in files if not f.endswith(METADATA)]
                objects.fetcher.map(lambda f: objects.put(f, os.path.join(src, f)), data)
                for f in files:
                    if f.endswith(METADATA):
                        objects.put(f, os.path.join(src, f))
                abort_left_open(objects.fetcher, files, options=(self.bucket_options or {}).get("options"))
        except BaseException as e:  # noqa: BLE001 - reported by wait_drain
            self._drain_error = e

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


__all__ = ["ForesightStorageInfo", "ForesightStorageWriter"]
