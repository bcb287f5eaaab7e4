"""From a plan's pieces to file extents: which bytes of which shard file one step needs.

All work is vectorized over the step's pieces; the only Python loop is over the (few) datasets of a mixture
(:func:`lookup_samples` is that loop, once, for whole samples).
Token pieces are usually parts of a sample; with ``whole_samples=True`` (the loader's ``verify``) the extents
are the whole samples the pieces come from, each once, so their checksums can be checked, and every piece is
located inside its sample's extent.

Example::

    files = FileTable(datasets, engine)
    ext = step_extents(plan, datasets, files, start, stop)
    ext.file, ext.offset, ext.length       # int32 / int64 / int64 arrays, one entry per piece
    file, offset, length = sample_extents(datasets, files, dataset_ids, sample_ids)   # whole samples
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from foresight.bucket import BucketDataset
from foresight.errors import PlanError


class FileTable:
    """Every shard file of every dataset under one global index, opened once.

    ``index(d, shard)`` is ``base[d] + shard``; ``fds[index]`` is the open descriptor.
    """

    def __init__(self, datasets: Sequence, open_file, *, direct: bool = False) -> None:
        self.paths: list[str] = []
        base = [0]
        for ds in datasets:
            self.paths.extend(ds.shard_paths)
            base.append(len(self.paths))
        self.base = np.asarray(base, dtype=np.int32)
        self.fds = np.full(len(self.paths), -1, dtype=np.int32)
        try:
            for i, path in enumerate(self.paths):
                self.fds[i] = open_file(path, direct=direct)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for i, fd in enumerate(self.fds):
            if fd >= 0:
                os.close(int(fd))
                self.fds[i] = -1


@dataclass
class StepExtents:
    """The byte ranges to read for one step, and the step's pieces in plan order.

    ``file``/``offset``/``length`` are the extents to read: one per piece, or with ``whole_samples`` one per
    distinct sample (then ``read_dataset``/``read_sample`` name them, and piece ``p`` starts
    ``piece_skip[p]`` bytes into extent ``piece_read[p]``). The other arrays are per piece.
    """

    file: np.ndarray  # int32, index into FileTable
    offset: np.ndarray  # int64, byte offset in the file
    length: np.ndarray  # int64, bytes
    dataset: np.ndarray  # int32
    sample: np.ndarray  # int64
    piece_tokens: np.ndarray | None  # int64 tokens per piece (token plans), else None
    item_ptr: np.ndarray  # int64, pieces of item i are item_ptr[i]:item_ptr[i+1] (rebased to 0)
    piece_read: np.ndarray | None = None  # int64, extent of each piece (whole_samples only)
    piece_skip: np.ndarray | None = None  # int64, bytes from its extent's start to the piece
    read_dataset: np.ndarray | None = None  # int32, per extent (whole_samples only)
    read_sample: np.ndarray | None = None  # int64, per extent (whole_samples only)

    def piece_positions(self, x_dest: np.ndarray) -> np.ndarray:
        """Where each piece starts in the transfer region, given where each extent landed (``x_dest``)."""
        if self.piece_read is None:
            return x_dest
        return x_dest[self.piece_read] + self.piece_skip


def step_extents(plan, datasets: Sequence, files: FileTable, start: int, stop: int, *,
                 whole_samples: bool = False) -> StepExtents:
    """Extents of items ``[start, stop)`` of ``plan`` (a rank's share of one step)."""
    pieces = plan.pieces(start, stop)
    # Copies: the plan's arrays are read-only mmaps (torch warns on them) and must never be written through
    # a batch's ``sample_ids`` or ``dataset``; a compact plan's pieces are new arrays of this call, used as they are.
    p_dataset = np.array(pieces.dataset, dtype=np.int32)
    p_sample = _own_copy(pieces.sample)
    tokens = plan.kind == "tokens"
    p_length = np.asarray(pieces.length, dtype=np.int64) if tokens else None
    if len(datasets) == 1 and not tokens and not p_dataset.any():
        # one dataset, whole samples: its lookup's arrays are the extents (no per-dataset masks, no scatter)
        found = datasets[0].lookup(p_sample)
        file = (found.shard + files.base[0]).astype(np.int32, copy=False)
        offset, length = np.asarray(found.offset, dtype=np.int64), np.asarray(found.length, dtype=np.int64)
    else:
        p_offset = np.asarray(pieces.offset, dtype=np.int64)
        p_length = np.asarray(pieces.length, dtype=np.int64)
        file, offset, length = _mixture_extents(datasets, files, p_dataset, p_sample, p_offset, p_length, tokens)
    ext = StepExtents(
        file=file,
        offset=offset,
        length=length,
        dataset=p_dataset,
        sample=p_sample,
        piece_tokens=p_length if tokens else None,
        item_ptr=np.asarray(pieces.item_ptr, dtype=np.int64),
    )
    return _whole_samples(ext, datasets, files) if whole_samples and tokens else ext


def _mixture_extents(datasets: Sequence, files: FileTable, p_dataset: np.ndarray, p_sample: np.ndarray,
                     p_offset: np.ndarray, p_length: np.ndarray, tokens: bool,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(file, offset, length)`` of the pieces: one batched lookup per dataset they touch (token pieces are parts
    of their samples, checked to lie inside them)."""
    n = len(p_sample)
    file = np.empty(n, dtype=np.int32)
    offset = np.empty(n, dtype=np.int64)
    length = np.empty(n, dtype=np.int64)
    for d in np.unique(p_dataset):
        if d < 0 or d >= len(datasets):
            raise PlanError("plan names a dataset the loader was not given", dataset=int(d), datasets=len(datasets))
        ds = datasets[int(d)]
        mask = p_dataset == d
        ext = ds.lookup(p_sample[mask])
        file[mask] = files.base[d] + ext.shard
        if tokens:
            itemsize = ds.token_dtype.itemsize
            offset[mask] = ext.offset + p_offset[mask] * itemsize
            length[mask] = p_length[mask] * itemsize
            if np.any(p_offset[mask] * itemsize + length[mask] > ext.length):
                bad = int(p_sample[mask][np.argmax(p_offset[mask] * itemsize + length[mask] > ext.length)])
                raise PlanError("plan piece runs past the end of its sample", dataset=int(d), sample=bad)
        else:
            offset[mask] = ext.offset
            length[mask] = ext.length
    return file, offset, length


def _own_copy(array: np.ndarray) -> np.ndarray:
    """``array`` as a writable int64 array no one else holds: itself when it owns its memory (computed for this
    call, as a compact plan's pieces), else a copy (a view of a plan's arrays)."""
    if array.flags.owndata and array.flags.writeable and array.dtype == np.int64:
        return array
    return np.array(array, dtype=np.int64)


def lookup_samples(datasets: Sequence, dataset: np.ndarray, samples: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(shard, offset, length)`` of whole samples ``(datasets[dataset[i]], samples[i])``: one batched
    ``Dataset.lookup`` per dataset the samples touch (int32 shard within its dataset, int64 bytes).

    Example::

        shard, offset, length = lookup_samples(datasets, np.array([0, 1, 0]), np.array([5, 2, 9]))
    """
    dataset, samples = np.asarray(dataset), np.asarray(samples, dtype=np.int64)
    shard = np.empty(len(samples), dtype=np.int32)
    offset = np.empty(len(samples), dtype=np.int64)
    length = np.empty(len(samples), dtype=np.int64)
    for d in np.unique(dataset):
        if d < 0 or d >= len(datasets):
            raise PlanError("a sample names a dataset that was not given", dataset=int(d), datasets=len(datasets))
        mask = dataset == d
        ext = datasets[int(d)].lookup(samples[mask])
        shard[mask], offset[mask], length[mask] = ext.shard, ext.offset, ext.length
    return shard, offset, length


def sample_extents(datasets: Sequence, files: FileTable, dataset: np.ndarray, samples: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(file, offset, length)`` of whole samples, ``file`` indexing ``files`` (see :func:`lookup_samples`).

    Example::

        file, offset, length = sample_extents(datasets, files, fields["dataset"], fields["sample_ids"])
    """
    shard, offset, length = lookup_samples(datasets, dataset, samples)
    file = (files.base[np.asarray(dataset, dtype=np.int64)] + shard).astype(np.int32)
    return file, offset, length


def _whole_samples(ext: StepExtents, datasets: Sequence, files: FileTable) -> StepExtents:
    """``ext`` reading each distinct sample of its pieces whole, once."""
    key = (ext.dataset.astype(np.int64) << 40) | ext.sample  # sample ids < 2**40
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    r_dataset, r_sample = ext.dataset[first], ext.sample[first]
    r_file, r_offset, r_length = sample_extents(datasets, files, r_dataset, r_sample)
    inverse = inverse.reshape(-1).astype(np.int64)
    ext.piece_skip = ext.offset - r_offset[inverse]
    ext.piece_read = inverse
    ext.file, ext.offset, ext.length = r_file, r_offset, r_length
    ext.read_dataset, ext.read_sample = r_dataset, r_sample
    return ext


__all__ = ["FileTable", "StepExtents", "lookup_samples", "sample_extents", "step_extents"]


class MapsOnly:
    """A bucket dataset seen through its maps alone: ``lookup`` gives extents and fetches nothing, so a step's
    extents cost no request (the storage node then fetches only the samples it reads)."""

    def __init__(self, ds: BucketDataset) -> None:
        self.ds = ds

    def lookup(self, ids: np.ndarray):
        return self.ds.cache.lookup(ids)

    def __getattr__(self, name: str):
        return getattr(self.ds, name)


def extents_without_fetching(datasets: Sequence) -> list:
    """What to look steps' extents up in without fetching a byte: a bucket dataset's maps, a local dataset itself."""
    return [MapsOnly(ds) if isinstance(ds, BucketDataset) else ds for ds in datasets]


def sample_shards(dataset) -> np.ndarray:
    """The shard of every sample of ``dataset`` (a dataset or :class:`MapsOnly`), from its maps."""
    return dataset.lookup(np.arange(dataset.num_samples, dtype=np.int64)).shard
