"""The ``torch.distributed.checkpoint`` storage reader of foresight's checkpoints (the writer is in
:mod:`foresight.checkpoint.dcp`).

``dcp.load(state_dict, storage_reader=ForesightStorageReader(path))``, with resharding: per data file the reader
coalesces the extents this rank's load plan needs into few large aligned reads (ranged GETs pinned to the recorded
ETags for a checkpoint in a bucket), checks each item's xxh3 and copies it into its target; files that every
rank reads whole (:func:`hot_files`) are read once per host into shared memory. Split from the writer's module
for size: the two share only the metadata types and the directory-or-bucket base they both import from it.

Example::

    import torch.distributed.checkpoint as dcp
    from foresight.checkpoint import ForesightStorageReader

    dcp.load(model.state_dict(), storage_reader=ForesightStorageReader("/ckpt/step-100"))
"""
from __future__ import annotations

import io
import os
import uuid
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from foresight.bucket.fetch import ObjectRef
from foresight.bucket.objects import BucketPrefix
from foresight.bucket.url import is_bucket_url
from foresight.checkpoint.aligned_io import FileIO
from foresight.checkpoint.dcp import (_SERIALIZED, ForesightStorageInfo, ForesightStorageWriter, _aligned_buffer,
                                      _DirectoryCheckpoint, _other_writer_error, metadata_name)
from foresight.checkpoint.layout import ALIGN, DTYPES, align_up
from foresight.checkpoint.safe_pickle import load_dcp_metadata
from foresight.checksum import xxh3_many
from foresight.errors import BucketError, CheckpointError


class ForesightStorageReader(_DirectoryCheckpoint, StorageReader):
    """DCP ``StorageReader`` for checkpoints written by :class:`ForesightStorageWriter`.

    Args:
        path: the checkpoint directory.
        verify: check each item's xxh3 (a mismatch raises CheckpointError naming file, item and offset).
        max_gap: extents closer than this are read as one request (the gap bytes are read and dropped).
        host_share: a :class:`~foresight.replication.host_share.HostShare`: ``.metadata`` and the hot files (those
            whose bytes are mostly items every rank reads: whole tensors, bytes items; or ``shared_files``) are
            read once per host and mapped by the host's other ranks, every item verified by each of them.
        shared_files: the data files to share (relative paths); default: derived from the metadata.
        bucket_options: for an ``s3://`` ``path``: keyword arguments of :class:`foresight.bucket.objects.BucketPrefix`
            (``options``, ``retry``, ...). Extents are fetched in coalesced ranged GETs (the fetcher's own gap and
            transfer caps, tuned for object storage), pinned to the ETags the writer recorded.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, direct: bool = True,
                 max_gap: int = 1 << 20, io_threads: int = 4, host_share: Any = None,
                 shared_files: Collection[str] | None = None, bucket_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.bucket_options = bucket_options
        if host_share is not None and is_bucket_url(os.fspath(path)):
            raise ValueError(f"host_share reads local files; a checkpoint in a bucket ({os.fspath(path)}) is "
                             "fetched by each rank")
        self.host_share = host_share
        self.shared_files = None if shared_files is None else set(shared_files)
        self._items_by_file: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.path = os.fspath(path)
        self.verify = verify
        self.direct = direct
        self.max_gap = max_gap
        self.io_threads = io_threads
        self.storage_data: dict[MetadataIndex, ForesightStorageInfo] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, or with ``rank=r`` the ``__r.metadata`` of a save with ``use_collectives=False``."""
        if self.in_bucket:
            metadata = self._metadata_from_bucket(metadata_name(kwargs.get("rank")))
        else:
            metadata = self._metadata_from_file(os.path.join(self.path, metadata_name(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _metadata_from_bucket(self, name: str) -> Metadata:
        objects = self._objects()
        url = f"{self.path.rstrip('/')}/{name}"
        try:
            raw = objects.get(objects.head(name))
        except BucketError as e:
            if e.reason != "not_found":
                raise
            raise CheckpointError(f"no DCP metadata: checkpoint missing or incomplete ({e})", path=url) from None
        return load_dcp_metadata(io.BytesIO(raw), source=url)

    def _metadata_from_file(self, path: str) -> Metadata:
        try:
            if self.host_share is not None:
                metadata = load_dcp_metadata(io.BytesIO(self._shared_metadata(path)), source=path)
            else:
                with open(path, "rb") as f:
                    metadata = load_dcp_metadata(f, source=path)
        except FileNotFoundError as e:
            raise CheckpointError("no DCP metadata: checkpoint missing or incomplete", path=path) from e
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointError("DCP metadata has no storage data", path=self.path)
        error = _other_writer_error(metadata.storage_data, self.path)
        if error is not None:
            raise error
        self.storage_data = metadata.storage_data
        if self.host_share is not None:
            self._items_by_file = _items_by_file(metadata)
            if self.shared_files is None:
                self.shared_files = hot_files(metadata)

    def _shared_metadata(self, path: str) -> memoryview:
        """``.metadata`` through the host share: one read per host. It records no checksum of itself, so the shared
        copy's name carries the file's inode, size and mtime: a copy left from another version is never used."""
        st = os.stat(path)
        size = st.st_size

        def fill(buf: memoryview) -> None:
            with open(path, "rb", buffering=0) as f:
                if f.readinto(buf) != size:
                    raise CheckpointError("DCP metadata changed size while read", path=path)

        version = f"@{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
        return self.host_share.get_or_read(os.path.relpath(path, self.path) + version, size, fill)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        fio = FileIO(threads=self.io_threads)
        try:
            for rel, reqs in per_file.items():
                self._read_file(fio, rel, reqs, planner)
        finally:
            fio.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, fio: FileIO, rel: str, reqs: list[Any], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, rel)
        infos = {id(r): self.storage_data[r.storage_index] for r in reqs}
        if self.in_bucket:
            self._read_object(rel, reqs, infos, planner)
            return
        if self.host_share is not None and rel in (self.shared_files or ()):
            # every item of the file was verified by the share's check
            self._load_items(path, self._shared_file(fio, rel), infos, reqs, planner, lambda offset: offset,
                             verify=False)
            return
        run_starts, run_ends = _aligned_runs(infos.values(), self.max_gap)
        sizes = run_ends - run_starts
        buf = _aligned_buffer(int(sizes.sum()))
        buf_pos = (np.cumsum(sizes) - sizes).astype(np.int64)
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise CheckpointError(f"DCP data file missing: {e.strerror}", path=path) from e
        if len(run_ends) and size < int(run_ends[-1]):
            raise CheckpointError("DCP data file is truncated", path=path, size=size, needed=int(run_ends[-1]))
        fd, _ = fio.open(path, direct=self.direct)
        try:
            mv = memoryview(buf.numpy())
            for s, n, p in zip(run_starts.tolist(), sizes.tolist(), buf_pos.tolist()):
                fio.read(fd, mv[p:p + n], file_offset=s, path=path)
        finally:
            os.close(fd)

        def where(offset: int) -> int:
            run = int(np.searchsorted(run_starts, offset, side="right")) - 1
            return int(buf_pos[run] + offset - run_starts[run])

        self._load_items(path, buf, infos, reqs, planner, where)

    def _read_object(self, rel: str, reqs: list[Any], infos: dict[int, Any], planner: LoadPlanner) -> None:
        """The items of one data object in a bucket: their aligned extents in coalesced ranged GETs (the fetcher
        merges gaps up to its own cap), pinned to the ETag the writer recorded."""
        objects = self._objects()
        ref = objects.head(rel)
        url = str(ref.url)
        recorded = {getattr(i, "etag", None) for i in infos.values()} - {None}
        if recorded and ref.etag not in recorded:
            raise CheckpointError(f"DCP data object changed since it was written (ETag {ref.etag}, recorded "
                                  f"{sorted(recorded)[0]})", path=url)
        needed = max((i.offset + i.length for i in infos.values()), default=0)
        if ref.size < needed:
            raise CheckpointError("DCP data object is truncated", path=url, size=ref.size, needed=needed)
        run_starts, run_ends = _aligned_runs(infos.values(), 0)
        run_ends = np.minimum(run_ends, ref.size)
        live = run_ends > run_starts
        if not live.any():
            got = None
        else:
            got = objects.fetch(ObjectRef(ref.url, ref.size, next(iter(recorded), ref.etag)), run_starts[live],
                                run_ends[live])
        dest = np.zeros(len(run_starts), np.int64)
        if got is not None:
            dest[live] = got.transfers.x_dest
        buf = torch.from_numpy(got.region) if got is not None else torch.empty(0, dtype=torch.uint8)

        def where(offset: int) -> int:
            run = int(np.searchsorted(run_starts, offset, side="right")) - 1
            return int(dest[run] + offset - run_starts[run])

        self._load_items(url, buf, infos, reqs, planner, where)

    def _shared_file(self, fio: FileIO, rel: str) -> torch.Tensor:
        """The whole file through the host share: fetched by one process of the host, every item of it verified
        by the fetcher before it is published and by each process that maps it."""
        path = os.path.join(self.path, rel)
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise CheckpointError(f"DCP data file missing: {e.strerror}", path=path) from e
        none = np.zeros(0, np.int64)
        offsets, lengths, sums = self._items_by_file.get(rel, (none, none, none.astype(np.uint64)))
        if len(offsets) and size < int((offsets + lengths).max()):
            raise CheckpointError("DCP data file is truncated", path=path, size=size,
                                  needed=int((offsets + lengths).max()))

        def fill(buf: memoryview) -> None:
            fd, _ = fio.open(path, direct=self.direct and size % ALIGN == 0)
            try:
                fio.read(fd, buf, path=path)
            finally:
                os.close(fd)

        def check(buf: memoryview) -> None:
            if self.verify and len(offsets):
                bad = np.flatnonzero(xxh3_many(buf, offsets, lengths) != sums)
                if len(bad):
                    raise CheckpointError("DCP item checksum mismatch: data file is corrupt", path=path,
                                          offset=int(offsets[bad[0]]), corrupt_items=len(bad))

        view = self.host_share.get_or_read(rel, size, fill, check)
        return torch.frombuffer(view, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)

    def _load_items(self, path: str, buf: torch.Tensor, infos: dict[int, Any], reqs: list[Any],
                    planner: LoadPlanner, where: Any, *, verify: bool = True) -> None:
        """Verify each item (once) and hand it to the planner; ``where(offset)`` is its position in ``buf``."""
        mv = memoryview(buf.numpy())
        verified: set[int] = set()
        for req in reqs:
            info = infos[id(req)]
            pos = where(info.offset)
            raw = buf[pos:pos + info.length]
            if pos % _MAX_ITEMSIZE:  # a fetched region places items at any byte; a dtype view needs alignment
                raw = raw.clone()
            if verify and self.verify and info.offset not in verified:
                got = int(xxh3_many(mv, np.array([pos]), np.array([info.length]))[0])
                if got != info.xxh3:
                    raise CheckpointError("DCP item checksum mismatch: data file is corrupt", path=path,
                                          item=req.storage_index.fqn, offset=info.offset)
                verified.add(info.offset)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                continue
            if info.dtype.startswith(_SERIALIZED):
                tensor = torch.load(io.BytesIO(raw.numpy().tobytes()), map_location="cpu", weights_only=True)
            elif info.dtype in DTYPES:
                tensor = raw.view(DTYPES[info.dtype].dtype).view(info.shape)
            else:
                raise CheckpointError(f"DCP item has dtype {info.dtype!r}, unknown to torch {torch.__version__}",
                                      path=path, item=req.storage_index.fqn)
            for dim, (off, ln) in enumerate(zip(req.storage_offsets, req.lengths)):
                tensor = tensor.narrow(dim, off, ln)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointError("DCP item shape does not match its target", item=req.storage_index.fqn,
                                      stored=tuple(tensor.shape), target=tuple(target.shape))
            target.copy_(tensor)
            planner.commit_tensor(req, target)


_MAX_ITEMSIZE = 16  # complex128


def _aligned_runs(infos: Any, max_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """The items' extents widened to ALIGN boundaries and merged where closer than ``max_gap`` (gap bytes read and
    dropped): (starts, ends), ascending."""
    runs: list[list[int]] = []
    for off, n in sorted({(i.offset, i.length) for i in infos}):
        lo, hi = off // ALIGN * ALIGN, align_up(off + n)
        if runs and lo - runs[-1][1] <= max_gap:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return (np.array([r[0] for r in runs], dtype=np.int64), np.array([r[1] for r in runs], dtype=np.int64))


def _items_by_file(metadata: Metadata) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per data file: (offsets, lengths, xxh3) of every item in it (one batch check per shared file)."""
    per: dict[str, list[tuple[int, int, int]]] = {}
    for info in metadata.storage_data.values():
        per.setdefault(info.relative_path, []).append((info.offset, info.length, info.xxh3))
    return {rel: (np.array([o for o, _, _ in v], np.int64), np.array([n for _, n, _ in v], np.int64),
                  np.array([h for _, _, h in v], np.uint64)) for rel, v in per.items()}


def hot_files(metadata: Metadata) -> set[str]:
    """Data files whose bytes are mostly items every rank that loads them reads (bytes items, tensors saved whole,
    as :func:`foresight.replication.hot_layout.read_by_every_rank` puts them in a file of their own)."""
    hot: dict[str, int] = {}
    total: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        whole = isinstance(md, BytesStorageMetadata) or (isinstance(md, TensorStorageMetadata) and len(md.chunks) == 1)
        total[info.relative_path] = total.get(info.relative_path, 0) + info.length
        hot[info.relative_path] = hot.get(info.relative_path, 0) + (info.length if whole else 0)
    return {rel for rel, n in total.items() if n and 2 * hot[rel] >= n}


__all__ = ["ForesightStorageReader", "hot_files"]
