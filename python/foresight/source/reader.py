"""Where a part's bytes come from: the :class:`PartReader` protocol and its local-file implementation.

A *part* is samples of a step, named by ``(dataset, sample)`` pairs. A reader puts their bytes in memory
(:class:`~foresight.source.PartBytes`); what is done with them next (checksums, :func:`~foresight.source.decode_part`)
is the same whoever read them. :class:`LocalPartReader` reads the shard files of this host through the engine
(:func:`~foresight.source.read_extents`).

A new source is one class with ``read_samples`` and ``close``. The object-store tier fits without a read path of
its own: a :class:`~foresight.bucket.BucketDataset`'s ``lookup`` fetches the bytes a batch is missing into its local
cache files (its ``shard_paths``) before it answers, so ``LocalPartReader`` over bucket datasets already reads
objects; a reader that fetches ahead of the lookup (or over another store) subclasses it, fetches in
``read_samples``, then calls ``super().read_samples``.

Example::

    reader = LocalPartReader(datasets)
    part = reader.read_samples(fields["dataset"][positions], fields["sample_ids"][positions])
    blocks = decode_part(stage, part, step=s, dataset=..., samples=..., positions=positions, first_item=start)
    reader.close()
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from foresight.io import IOEngine, open_file
from foresight.source.extents import FileTable, sample_extents
from foresight.source.reads import PartBytes, ReusableRegion, read_extents


class PartReader(Protocol):
    """Reads the bytes of samples ``(dataset[i], samples[i])`` of a step into memory."""

    def read_samples(self, dataset: np.ndarray, samples: np.ndarray) -> PartBytes: ...

    def close(self) -> None: ...


class LocalPartReader:
    """:class:`PartReader` over this host's shard files: whole samples -> extents -> coalesced reads, into one
    region reused step after step (the caller's decode copies out of it before the next call). One engine, one
    thread at a time.

    Args:
        datasets: the datasets ``dataset`` indexes.
        engine: an :class:`~foresight.io.IOEngine` to read with (default: one of its own, closed with the reader).
    """

    def __init__(self, datasets: Sequence, *, engine: Any = None) -> None:
        self.datasets = list(datasets)
        self.files = FileTable(self.datasets, open_file)
        self._own_engine = engine is None
        self.engine = IOEngine() if engine is None else engine
        self._region = ReusableRegion()

    def read_samples(self, dataset: np.ndarray, samples: np.ndarray) -> PartBytes:
        file, offset, length = sample_extents(self.datasets, self.files, dataset, samples)
        return read_extents(self.engine, self.files, file, offset, length, into=self._region)

    def close(self) -> None:
        self.files.close()
        if self._own_engine:
            self.engine.close()


__all__ = ["LocalPartReader", "PartReader"]
