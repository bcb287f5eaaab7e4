"""From a plan's pieces to file extents: which bytes of which shard file one step needs.

All work is vectorized over the step's pieces; the only Python loop is over the (few) datasets of a mixture.

Example::

    files = FileTable(datasets, engine)
    ext = step_extents(plan, datasets, files, start, stop)
    ext.file, ext.offset, ext.length       # int32 / int64 / int64 arrays, one entry per piece
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

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
        import os

        for i, fd in enumerate(self.fds):
            if fd >= 0:
                os.close(int(fd))
                self.fds[i] = -1


@dataclass
class StepExtents:
    """One entry per plan piece of the step, in plan order."""

    file: np.ndarray  # int32, index into FileTable
    offset: np.ndarray  # int64, byte offset in the file
    length: np.ndarray  # int64, bytes
    dataset: np.ndarray  # int32
    sample: np.ndarray  # int64
    piece_tokens: np.ndarray | None  # int64 tokens per piece (token plans), else None
    item_ptr: np.ndarray  # int64, pieces of item i are item_ptr[i]:item_ptr[i+1] (rebased to 0)


def step_extents(plan, datasets: Sequence, files: FileTable, start: int, stop: int) -> StepExtents:
    """Extents of items ``[start, stop)`` of ``plan`` (a rank's share of one step)."""
    pieces = plan.pieces(start, stop)
    p_dataset = np.asarray(pieces.dataset, dtype=np.int32)
    p_sample = np.asarray(pieces.sample, dtype=np.int64)
    p_offset = np.asarray(pieces.offset, dtype=np.int64)
    p_length = np.asarray(pieces.length, dtype=np.int64)
    n = len(p_sample)
    file = np.empty(n, dtype=np.int32)
    offset = np.empty(n, dtype=np.int64)
    length = np.empty(n, dtype=np.int64)
    tokens = plan.kind == "tokens"
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
    return StepExtents(
        file=file,
        offset=offset,
        length=length,
        dataset=p_dataset,
        sample=p_sample,
        piece_tokens=p_length if tokens else None,
        item_ptr=np.asarray(pieces.item_ptr, dtype=np.int64),
    )


__all__ = ["FileTable", "StepExtents", "step_extents"]
