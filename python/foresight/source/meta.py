"""Per-sample metadata of a step (captions, labels, ids): the meta JSON the shard maps hold, looked up in batches.

A shard map keeps each sample's meta as one JSON object in an Arrow string column (``foresight pack media
--captions`` puts the caption there). For a step, :func:`sample_metas` asks each dataset for the metas of its samples
in one call (``Dataset.meta_many``: one Arrow take, join and JSON parse per shard touched), so there is no Python call
per sample until the values are handed out. :func:`meta_fields` picks named fields out of them.

Example::

    metas = sample_metas(datasets, fields["dataset"], fields["sample_ids"])   # one dict per sample, in order
    meta_fields(metas, ("caption", "label"))    # {"caption": ["a cat", None, ...], "label": [3, 1, ...]}
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def sample_metas(datasets: Sequence[Any], dataset: np.ndarray | None, samples: np.ndarray) -> np.ndarray:
    """The meta dict of each ``(datasets[dataset[i]], samples[i])`` as an object array aligned with ``samples``
    (``dataset=None``: all from ``datasets[0]``). Malformed meta raises FormatError naming the map and sample."""
    samples = np.asarray(samples, dtype=np.int64)
    out = np.empty(len(samples), dtype=object)
    if not len(samples):
        return out
    dataset = np.zeros(len(samples), np.int64) if dataset is None else np.asarray(dataset)
    for d in np.unique(dataset):
        where = np.flatnonzero(dataset == d)
        _fill(datasets[int(d)], samples[where], out, where)
    return out


def meta_fields(metas: np.ndarray, names: Sequence[str]) -> dict[str, list]:
    """``{name: [meta.get(name) for each sample]}``: None where a sample's meta lacks the field."""
    return {name: [m.get(name) for m in metas] for name in names}


def _fill(ds: Any, ids: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
    values = ds.meta_many(ids)  # batched by the format (one Arrow take + one JSON parse per shard touched)
    # Through a 1-D object array: assigning a list of dicts to out[where] directly is fine, but an empty or
    # ragged list would confuse numpy's shape inference.
    tmp = np.empty(len(values), dtype=object)
    tmp[:] = values
    out[where] = tmp


__all__ = ["meta_fields", "sample_metas"]
