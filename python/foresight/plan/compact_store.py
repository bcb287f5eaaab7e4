"""Compact plans on disk: ``plan.json`` (``format_version`` 3, or 2) and ``block_prefix.npy`` checked and opened.

:func:`foresight.plan.load_plan` reads ``plan.json`` and hands a version-2 document here. The checks mirror those of
the materialized kind (``foresight.plan.store``) for what a compact plan holds: every field's type and range, the
blend's item counts, the block counts, the epochs, the array's length; each (dataset, epoch) segment of the block
prefix sums running from 0 to the dataset's tokens, and (with ``verify=True``) never decreasing and matching the
digest. Bad files raise :class:`FormatError` naming the file and field, a digest mismatch :class:`PlanError`.

Example::

    plan = load_compact("plan/", json.load(open("plan/plan.json")), verify=True)
"""
from __future__ import annotations

import json
import mmap
import os
from typing import Any

import numpy as np

from foresight.errors import FormatError, PlanError
from foresight.plan.compact import (
    COMPACT_ARRAYS, COMPACT_FORMAT_VERSIONS, SHUFFLE, CompactPlan, blend_counts, blend_pattern, blend_period,
    _kernels, advise, block_layout, derive_block_prefix, items_per_source,
)
from foresight.plan.files import PLAN_JSON, _Bad, _check_envelope, _field, _load_array, _require, compute_digest
from foresight.plan.permute import MASK64
from foresight.plan.plan import FORMAT_NAME


def prefix_length(summary: dict[str, Any]) -> int:
    return sum(d["epochs_started"] * (d["blocks"] + 1) for d in summary["datasets"])


def check_compact_header(doc: Any, json_path: str) -> tuple[dict[str, Any], str]:
    """plan.json of a compact plan, checked field by field; FormatError naming the file otherwise."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    try:
        _, digest, inputs, summary, arrays = _check_envelope(
            doc, FORMAT_NAME, COMPACT_FORMAT_VERSIONS,
            lambda _: f"not a compact plan this version reads (format_version {COMPACT_FORMAT_VERSIONS})")
        seed = _field(inputs, "seed", (int,), "inputs")
        b = _field(inputs, "global_batch_size", (int,), "inputs")
        seq_len = _field(inputs, "seq_len", (int,), "inputs")
        _field(inputs, "num_steps", (int,), "inputs", optional=True)
        _field(inputs, "epochs", (float,), "inputs", optional=True)
        _require(_field(inputs, "shuffle", (str,), "inputs") == SHUFFLE, f"inputs.shuffle must be {SHUFFLE!r}")
        block_size = _field(inputs, "block_size", (int,), "inputs", optional=True)
        if version == 2:  # blocks strided over the whole corpus: no block_group
            _require("block_group" not in inputs, "inputs.block_group is not in format_version 2")
            group = None
        else:
            group = _field(inputs, "block_group", (int,), "inputs")
            _require(1 <= group <= 1 << 32 and group * (block_size or 1) < 1 << 62,
                     "inputs.block_group must be 1 to 2**32, and times block_size below 2**62")
        period = _field(inputs, "blend_period", (int,), "inputs")
        sources = _field(inputs, "sources", (list,), "inputs")
        _require(0 <= seed <= MASK64 and b >= 1 and seq_len >= 1 and (block_size is None or block_size >= 1),
                 "seed, global_batch_size, seq_len or block_size out of range")
        _require(1 <= len(sources) <= 65535, "inputs.sources must list 1 to 65535 datasets")
        _require(period == blend_period(len(sources)), f"inputs.blend_period must be {blend_period(len(sources))}")
        for i, s in enumerate(sources):
            where = f"inputs.sources[{i}]"
            _field(s, "fingerprint", (str,), where)
            _require(_field(s, "weight", (float,), where) > 0, f"{where}.weight must be > 0")
            _require(_field(s, "num_samples", (int,), where) >= 1, f"{where}.num_samples must be >= 1")
            _field(s, "token_dtype", (str,), where)
        _require(_field(summary, "kind", (str,), "summary") == "tokens", "summary.kind must be 'tokens'")
        num_steps = _field(summary, "num_steps", (int,), "summary")
        num_items = _field(summary, "num_items", (int,), "summary")
        _require(num_steps >= 1 and num_items == num_steps * b,
                 "summary.num_items must be num_steps * global_batch_size")
        _require(_field(summary, "num_pieces", (int,), "summary", optional=True) is None,
                 "summary.num_pieces must be null in a compact plan")
        datasets = _field(summary, "datasets", (list,), "summary")
        _require(len(datasets) == len(sources), "summary.datasets must have one entry per source")
        counts = blend_counts([s["weight"] for s in sources], period)
        items = items_per_source(counts, blend_pattern(counts)[0], num_items)
        for i, (d, s) in enumerate(zip(datasets, sources)):
            where = f"summary.datasets[{i}]"
            _require(_field(d, "items", (int,), where) == int(items[i]), f"{where}.items must be {int(items[i])}")
            _field(d, "share", (float,), where)
            _field(d, "epochs_covered", (float,), where)
            tokens = _field(d, "tokens", (int,), where)
            _require(tokens >= 1, f"{where}.tokens must be >= 1")
            blocks = block_layout(s["num_samples"], block_size, group)[0]
            _require(_field(d, "blocks", (int,), where) == blocks, f"{where}.blocks must be {blocks}")
            need = -(-(d["items"] * seq_len + 1) // tokens) if d["items"] else 0
            _require(_field(d, "epochs_started", (int,), where) == need, f"{where}.epochs_started must be {need}")
        _require(set(arrays) == set(COMPACT_ARRAYS), f"arrays must be exactly {sorted(COMPACT_ARRAYS)}")
        spec = _field(arrays, "block_prefix", (dict,), "arrays")
        _require(_field(spec, "dtype", (str,), "arrays.block_prefix") == "<i8", "arrays.block_prefix.dtype must be <i8")
        want = prefix_length(summary)
        _require(_field(spec, "shape", (list,), "arrays.block_prefix") == [want],
                 f"arrays.block_prefix.shape must be [{want}]")
    except _Bad as e:
        raise FormatError(f"malformed plan.json of a compact plan (format_version {version}): {e}",
                          path=json_path) from None
    header = {k: doc[k] for k in ("format", "format_version", "inputs", "summary", "arrays")}
    return header, digest


def check_prefix(summary: dict[str, Any], prefix: np.ndarray, path: str, *, full: bool) -> None:
    """Each (dataset, epoch) segment starts at 0 and ends at the dataset's tokens; with ``full`` also that
    it never decreases (reads the whole array, as the digest check does anyway)."""
    file = os.path.join(path, "block_prefix.npy")
    base = 0
    for i, d in enumerate(summary["datasets"]):
        nb = d["blocks"]
        for e in range(d["epochs_started"]):
            seg = prefix[base : base + nb + 1]
            if int(seg[0]) != 0 or int(seg[-1]) != d["tokens"]:
                raise FormatError(f"block prefix of dataset {i} epoch {e} must run from 0 to {d['tokens']}",
                                  path=file, index=base)
            if full:
                bad = _kernels.first_decrease(seg)  # native, one pass: no temporary the size of the array
                if bad >= 0:
                    raise FormatError("block prefix sums must not decrease", path=file, index=base + int(bad))
            base += nb + 1


def rebuild_compact(path: str, datasets: list) -> None:
    """Write ``block_prefix.npy`` into the plan directory ``path``, which holds only a compact plan's
    ``plan.json``, computed from ``datasets`` (its sources, in order); :func:`load_compact` then checks the result
    against the digest. The plan's inputs are a few KB; the array, 8 bytes per block and epoch, is not sent."""
    json_path = os.path.join(path, PLAN_JSON)
    with open(json_path, "rb") as f:
        doc = json.loads(f.read())
    header, _ = check_compact_header(doc, json_path)
    if len(datasets) != len(header["inputs"]["sources"]):
        raise PlanError("a compact plan is rebuilt from all its datasets", path=path,
                        expected=len(header["inputs"]["sources"]), given=len(datasets))
    prefix = derive_block_prefix(header["inputs"], header["summary"], datasets)
    np.save(os.path.join(path, "block_prefix.npy"), prefix)


def load_compact(path: str, doc: Any, *, verify: bool) -> CompactPlan:
    """Open a compact plan directory whose plan.json ``doc`` has been read (``load_plan`` dispatches here)."""
    header, digest = check_compact_header(doc, os.path.join(path, PLAN_JSON))
    prefix = _load_array(path, "block_prefix", header["arrays"]["block_prefix"])
    if verify:  # every byte is read next: have the kernel read the file ahead at disk speed, not page by page
        advise(prefix, 0, prefix.shape[0], mmap.MADV_WILLNEED)
    check_prefix(header["summary"], prefix, path, full=verify)
    plan = CompactPlan(inputs=header["inputs"], summary=header["summary"], arrays={"block_prefix": prefix},
                       digest=digest, path=path, format_version=header["format_version"])
    if verify:
        actual = compute_digest(header, plan.arrays, COMPACT_ARRAYS)
        if actual != digest:
            raise PlanError("plan files do not match their digest (corrupt or edited)", path=path,
                            expected=digest, actual=actual)
    return plan
