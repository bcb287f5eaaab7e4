"""``build_plan``: a mixture of datasets, a seed and a batch shape in; a :class:`Plan` out.

The algorithm, all heavy loops in ``foresight._plan_kernels`` (Cython, GIL released):

1. Blend: item i of the global sequence goes to the dataset with the largest
   ``weight[d] * (i + 1) - count[d]`` (Megatron-LM's ``build_blending_indices``), so every prefix
   of the plan follows the mixture weights as closely as whole items allow.
2. Order: each dataset visits its samples epoch after epoch, each epoch in the order
   :func:`foresight.plan.shuffle.epoch_order` draws from ``(seed, dataset index, epoch)``.
3. Items: for token data, each dataset's documents, in that order, form one token stream cut into
   sequences of ``seq_len + 1`` tokens overlapping by one (sequence j covers stream positions
   ``[j*seq_len, j*seq_len + seq_len + 1)``, as Megatron-LM's sample index does); each sequence is
   a few (dataset, sample, token offset, length) pieces. Otherwise one item is one whole sample.

Example::

    plan = build_plan([(dataset, 1.0)], seed=0, global_batch_size=8, seq_len=2048, num_steps=100)
    start, stop = plan.rank_items(step=3, rank=1, world_size=4)
    pieces = plan.pieces(start, stop)
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from foresight._native import load
from foresight.errors import PlanError
from foresight.plan.compact import build_compact, check_compact_args
from foresight.plan.locations import describe_sources
from foresight.plan.plan import Plan
from foresight.plan.shuffle import epoch_order, index_dtype

_kernels = load("_plan_kernels")

SHUFFLES = ("global", "block")
MAX_DATASETS = 65535


class PlanSource(Protocol):
    """What the builder needs from a dataset (``foresight.format.Dataset`` provides it)."""

    num_samples: int
    token_dtype: Any
    fingerprint: str

    def token_counts(self) -> np.ndarray: ...

    def sample_bytes(self) -> np.ndarray: ...


@dataclass(frozen=True)
class _Source:
    index: int
    name: str
    fingerprint: str
    weight: float
    num_samples: int
    token_dtype: str | None
    sizes: np.ndarray  # tokens (token data) or bytes per sample, int64
    total: int  # sum of sizes
    items_per_epoch: int


def build_plan(
    sources: Sequence[tuple[PlanSource, float]],
    *,
    seed: int,
    global_batch_size: int,
    seq_len: int | None = None,
    num_steps: int | None = None,
    epochs: float | None = None,
    shuffle: str = "global",
    block_size: int | None = None,
    compact: bool = False,
) -> Plan:
    """Build the deterministic global plan of a training job.

    ``sources`` is a list of ``(dataset, weight)``; datasets must all be token data (then
    ``seq_len`` is required) or all non-token data (then it must be None). Give exactly one of
    ``num_steps`` or ``epochs`` (passes over the whole mixture: ``epochs * sum of items per epoch``
    items, rounded down to whole steps). ``shuffle="block"`` keeps runs of ``block_size`` samples
    together. ``compact=True`` builds the compact kind (:mod:`foresight.plan.compact`: token data only,
    its own block shuffle with ``block_size`` documents per block), whose steps are computed on demand.
    Raises :class:`PlanError` naming the bad input.
    """
    checked = _check_sources(sources)
    kind = "tokens" if checked[0][0].token_dtype is not None else "samples"
    seed = _check_int("seed", seed, minimum=0)
    global_batch_size = _check_int("global_batch_size", global_batch_size, minimum=1)
    if kind == "tokens":
        seq_len = _check_int("seq_len", seq_len, minimum=1, maximum=2**31 - 2, hint="token data needs seq_len")
    elif seq_len is not None:
        raise PlanError("seq_len is only for token data; these datasets hold whole samples", seq_len=seq_len)
    if compact:
        block_size = check_compact_args(kind, shuffle, block_size)
    elif shuffle not in SHUFFLES:
        raise PlanError(f"shuffle must be one of {SHUFFLES}", shuffle=shuffle)
    elif shuffle == "block":
        block_size = _check_int("block_size", block_size, minimum=1, hint="block shuffle needs block_size")
    elif block_size is not None:
        raise PlanError("block_size is only for shuffle='block'", block_size=block_size)
    if (num_steps is None) == (epochs is None):
        raise PlanError("give exactly one of num_steps or epochs", num_steps=num_steps, epochs=epochs)
    if num_steps is not None:
        num_steps = _check_int("num_steps", num_steps, minimum=1)
    elif isinstance(epochs, bool) or not isinstance(epochs, numbers.Real) or not (0 < epochs < math.inf):
        raise PlanError("epochs must be a positive finite number", epochs=epochs)
    if compact:
        return build_compact(checked, seed=seed, global_batch_size=global_batch_size, seq_len=seq_len,
                             num_steps=num_steps, epochs=epochs, block_size=block_size)

    weights = np.array([w for _, w in checked], dtype=np.float64)
    weights = weights / weights.sum()
    srcs = [_describe(i, ds, float(w), kind, seq_len) for i, (ds, w) in enumerate(checked)]

    if num_steps is None:
        per_epoch = sum(s.items_per_epoch for s in srcs)
        num_steps = math.floor(float(epochs) * per_epoch) // global_batch_size
        if num_steps < 1:
            raise PlanError(
                "epochs give less than one step", epochs=epochs, items_per_epoch=per_epoch,
                global_batch_size=global_batch_size,
            )
    num_items = num_steps * global_batch_size

    choice = np.zeros(num_items, dtype=np.uint16)
    counts = np.zeros(len(srcs), dtype=np.int64)
    if len(srcs) == 1:
        counts[0] = num_items
    else:
        _kernels.blend(weights, choice, counts)

    order, order_base, epochs_used = _orders(srcs, counts, kind, seq_len, seed, shuffle, block_size)
    sizes, sizes_base = _concat_sizes(srcs)
    if kind == "tokens":
        item_ptr, p_dataset, p_sample, p_offset, p_length = _kernels.pack_tokens(
            choice, order, order_base, sizes, sizes_base, seq_len
        )
    else:
        item_ptr = np.arange(num_items + 1, dtype=np.int64)
        p_dataset = np.empty(num_items, dtype=np.uint16)
        p_sample = np.empty(num_items, dtype=np.int64)
        p_length = np.empty(num_items, dtype=np.int64)
        _kernels.fill_samples(choice, order, order_base, sizes, sizes_base, p_dataset, p_sample, p_length)
        p_offset = np.zeros(num_items, dtype=np.int64)  # calloc: costs no memory until read
    del order, choice

    inputs = {
        "seed": seed,
        "global_batch_size": global_batch_size,
        "seq_len": seq_len,
        "num_steps": num_steps if epochs is None else None,
        "epochs": float(epochs) if epochs is not None else None,
        "shuffle": shuffle,
        "block_size": block_size,
        "sources": [
            {
                "fingerprint": s.fingerprint,
                "weight": float(checked[s.index][1]),
                "num_samples": s.num_samples,
                "token_dtype": s.token_dtype,
            }
            for s in srcs
        ],
    }
    summary = {
        "kind": kind,
        "num_steps": num_steps,
        "num_items": num_items,
        "num_pieces": int(item_ptr[-1]),
        "datasets": [
            {
                "items": int(counts[s.index]),
                "share": float(counts[s.index]) / num_items,
                "epochs_started": int(epochs_used[s.index]),
                "epochs_covered": _epochs_covered(s, int(counts[s.index]), kind, seq_len),
            }
            for s in srcs
        ],
    }
    arrays = {
        "item_ptr": item_ptr,
        "piece_dataset": p_dataset,
        "piece_sample": p_sample,
        "piece_offset": p_offset,
        "piece_length": p_length,
    }
    plan = Plan(inputs=inputs, summary=summary, arrays=arrays)
    plan.source_locations = describe_sources([ds for ds, _ in checked])  # saved beside the plan, not digested
    return plan


def _check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"{name} must be an integer" + (f" ({hint})" if hint else ""), **{name: value})
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise PlanError(f"{name} must be {bound}", **{name: value})
    return value


def _check_sources(sources: Any) -> list[tuple[Any, float]]:
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
        raise PlanError("sources must be a non-empty list of (dataset, weight) pairs")
    if len(sources) > MAX_DATASETS:
        raise PlanError(f"at most {MAX_DATASETS} datasets", num_datasets=len(sources))
    checked = []
    for i, pair in enumerate(sources):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise PlanError("each source must be a (dataset, weight) pair", source=i)
        ds, w = pair
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (0 < float(w) < math.inf):
            raise PlanError("weights must be positive finite numbers", source=i, weight=w)
        for attr in ("num_samples", "token_dtype", "fingerprint", "token_counts", "sample_bytes"):
            if not hasattr(ds, attr):
                raise PlanError(f"source {i} is not a dataset: it has no {attr!r}", source=i)
        checked.append((ds, float(w)))
    token = [ds.token_dtype is not None for ds, _ in checked]
    if any(token) and not all(token):
        raise PlanError(
            "cannot mix token datasets with sample datasets in one plan: token datasets are cut into seq_len rows, "
            "sample datasets (text bytes, media) are taken whole. To train on text, pack it as tokens "
            "(foresight pack jsonl|parquet ... --tokenizer tokenizer.json); to use both, build one plan per kind",
            token_sources=[i for i, t in enumerate(token) if t],
            sample_sources=[i for i, t in enumerate(token) if not t],
        )
    return checked


def _describe(index: int, ds: Any, weight: float, kind: str, seq_len: int | None) -> _Source:
    n = ds.num_samples
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise PlanError("a dataset in a plan needs at least one sample", source=index, num_samples=n)
    n = int(n)
    sizes = np.ascontiguousarray(ds.token_counts() if kind == "tokens" else ds.sample_bytes())
    what = "token_counts()" if kind == "tokens" else "sample_bytes()"
    if sizes.ndim != 1 or sizes.shape[0] != n or sizes.dtype.kind not in "iu":
        raise PlanError(
            f"{what} must be an integer array with one entry per sample", source=index,
            shape=sizes.shape, dtype=sizes.dtype, num_samples=n,
        )
    sizes = sizes.astype(np.int64, copy=False)
    if n and int(sizes.min()) < 0:
        raise PlanError(f"{what} has a negative entry", source=index, sample=int(np.argmin(sizes)))
    total = int(sizes.sum())
    if kind == "tokens":
        if total < 1:
            raise PlanError("token dataset holds no tokens", source=index)
        items_per_epoch = max(0, (total - 1) // seq_len)
    else:
        items_per_epoch = n
    path = getattr(ds, "path", None)
    name = os.path.basename(os.path.normpath(str(path))) if path else f"source-{index}"
    token_dtype = None if ds.token_dtype is None else np.dtype(ds.token_dtype).name
    return _Source(index, name, str(ds.fingerprint), weight, n, token_dtype, sizes, total, items_per_epoch)


def _epochs_needed(s: _Source, count: int, kind: str, seq_len: int | None) -> int:
    if count == 0:
        return 0
    if kind == "tokens":
        return -(-(count * seq_len + 1) // s.total)
    return -(-count // s.num_samples)


def _epochs_covered(s: _Source, count: int, kind: str, seq_len: int | None) -> float:
    if kind == "tokens":
        return (count * seq_len + 1) / s.total if count else 0.0
    return count / s.num_samples


def _orders(srcs, counts, kind, seq_len, seed, shuffle, block_size):
    """Every dataset's order over the epochs it needs, concatenated (one allocation, filled in place)."""
    epochs = [_epochs_needed(s, int(counts[s.index]), kind, seq_len) for s in srcs]
    lengths = [e * s.num_samples for e, s in zip(epochs, srcs)]
    order_base = np.zeros(len(srcs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=order_base[1:])
    order = np.empty(int(order_base[-1]), dtype=index_dtype(max(s.num_samples for s in srcs)))
    for s, e in zip(srcs, epochs):
        for epoch in range(e):
            start = int(order_base[s.index]) + epoch * s.num_samples
            epoch_order(
                s.num_samples, seed=seed, dataset_index=s.index, epoch=epoch, shuffle=shuffle,
                block_size=block_size, out=order[start : start + s.num_samples],
            )
    return order, order_base, epochs


def _concat_sizes(srcs):
    sizes_base = np.zeros(len(srcs), dtype=np.int64)
    np.cumsum([s.num_samples for s in srcs[:-1]], out=sizes_base[1:])
    sizes = srcs[0].sizes if len(srcs) == 1 else np.concatenate([s.sizes for s in srcs])
    return sizes, sizes_base
