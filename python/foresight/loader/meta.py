"""Per-sample metadata of a step (captions, labels, ids): the meta JSON the shard maps hold, looked up in batches.

A shard map keeps each sample's meta as one JSON object in an Arrow string column (``foresight pack media
--captions`` puts the caption there). For a step, :func:`sample_metas` takes the rows of each shard it touches
with one Arrow ``take``, joins them with one Arrow ``binary_join`` and parses them with one ``json.loads``: no
Python call per sample until the values are handed out. :func:`meta_fields` picks named fields out of them.

Example::

    metas = sample_metas(datasets, fields["dataset"], fields["sample_ids"])   # one dict per sample, in order
    meta_fields(metas, ("caption", "label"))    # {"caption": ["a cat", None, ...], "label": [3, 1, ...]}
"""
from __future__ import annotations

import json
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
    maps, first = getattr(ds, "_maps", None), getattr(ds, "_first", None)
    if maps is None or first is None:  # not a foresight shard dataset (e.g. Megatron): its own meta(), per sample
        out[where] = [ds.meta(int(i)) for i in ids]
        return
    ids = ds._check_ids(ids)
    shard = np.searchsorted(first, ids, side="right") - 1
    for s in np.unique(shard):  # a loop over the shards a step touches, never over samples
        pick = shard == s
        m = maps[int(s)]
        rows = ids[pick] - int(first[s])
        _put(out, where[pick], _parse_rows(m, rows))


def _put(out: np.ndarray, where: np.ndarray, values: list) -> None:
    # Through a 1-D object array: assigning a list of dicts to out[where] directly is fine, but an empty or
    # ragged list would confuse numpy's shape inference.
    tmp = np.empty(len(values), dtype=object)
    tmp[:] = values
    out[where] = tmp


def _parse_rows(m: Any, rows: np.ndarray) -> list:
    """Meta dicts of ``rows`` of shard map ``m``: one take, one join, one JSON parse."""
    import pyarrow as pa
    import pyarrow.compute as pc

    texts = m._meta.take(pa.array(rows, type=pa.int64()))
    texts = pc.if_else(pc.equal(texts, ""), pa.scalar("{}", texts.type), texts)  # empty meta is {}
    one_list = pa.LargeListArray.from_arrays(pa.array([0, len(texts)], pa.int64()), texts)
    joined = pc.binary_join(one_list, pa.scalar(",", texts.type))
    try:
        values = json.loads("[" + joined[0].as_py() + "]")
    except (ValueError, RecursionError):
        values = None
    # The map's checksum (checked at open) ties it to a writer that stores one json.dumps'd object per row, so a
    # well-formed join has one object per row; anything else is parsed row by row to name the bad sample.
    if values is None or len(values) != len(rows) or not all(type(v) is dict for v in values):
        return [m.meta_json(int(r)) for r in rows]
    return values


__all__ = ["meta_fields", "sample_metas"]
