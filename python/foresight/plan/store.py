"""Plan directories on disk: ``plan.json`` plus one ``.npy`` per array, opened with mmap.

``plan.json`` holds the format name and version, the canonical inputs (seed, batch shape, shuffle,
and each source's fingerprint, weight and sample count), a summary, each array's dtype and shape,
and ``digest = sha256(canonical JSON of all that + the arrays' bytes)``. Nothing machine-specific
(no absolute paths, no timestamps) goes in, so equal inputs give byte-identical directories.

:func:`load_plan` checks everything it can cheaply (JSON schema, dtypes, shapes, a strictly
increasing ``item_ptr``, datasets, sample ids and lengths in range, token items of exactly
``seq_len + 1`` tokens) in bounded-memory chunks over the mmap, and the digest when
``verify=True``. A bad file raises :class:`FormatError` (malformed) or :class:`PlanError` (digest
mismatch) naming the file.

Example::

    plan.save("plan/")
    plan = load_plan("plan/")             # verify=True also rehashes every byte
    plan = load_plan("s3://data/plans/p1")  # fetched once into FORESIGHT_BUCKET_CACHE, then as a local one
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from foresight.errors import FormatError, PlanError
from foresight.plan.compact import COMPACT_FORMAT_VERSIONS
from foresight.plan.compact_store import load_compact
from foresight.plan.files import (
    CHUNK, MAX_JSON_BYTES, PLAN_JSON, _Bad, _check_envelope, _field, _load_array, _recover, _require, compute_digest,
    local_plan_dir,
)
from foresight.plan.plan import ARRAY_DTYPES, FORMAT_NAME, FORMAT_VERSION, Plan

SHUFFLES = ("global", "block")
KINDS = ("tokens", "samples")


def load_plan(path: str, *, verify: bool = True) -> Plan:
    """Open a plan directory; arrays are read-only mmaps. ``verify=True`` also checks the digest
    (reads every byte once); the structural checks always run. ``s3://bucket/prefix`` opens the plan's copy in
    the bucket cache (:func:`~foresight.plan.files.local_plan_dir`)."""
    path = os.path.abspath(local_plan_dir(path))
    json_path = os.path.join(path, PLAN_JSON)
    _recover(path)
    if not os.path.isdir(path):
        raise FormatError("not a plan directory", path=path)
    if not os.path.isfile(json_path):
        raise FormatError("not a plan directory: plan.json is missing (an unfinished save?)", path=json_path)
    doc = _read_json(json_path)
    if isinstance(doc, dict) and doc.get("format_version") in COMPACT_FORMAT_VERSIONS:
        return load_compact(path, doc, verify=verify)
    header, digest = _check_header(doc, json_path)
    arrays = {name: _load_array(path, name, header["arrays"][name]) for name in ARRAY_DTYPES}
    _check_arrays(header, arrays, path)
    plan = Plan(inputs=header["inputs"], summary=header["summary"], arrays=arrays, digest=digest, path=path)
    if verify:
        actual = compute_digest(header, arrays, ARRAY_DTYPES)
        if actual != digest:
            raise PlanError("plan files do not match their digest (corrupt or edited)", path=path,
                            expected=digest, actual=actual)
    return plan


# ---- plan.json -------------------------------------------------------------------------------
def _read_json(json_path: str) -> Any:
    size = os.path.getsize(json_path)
    if size > MAX_JSON_BYTES:
        raise FormatError("plan.json is implausibly large", path=json_path, size=size)
    with open(json_path, "rb") as f:
        raw = f.read()
    def no_constants(name: str) -> None:
        raise FormatError(f"plan.json holds {name}, which is not valid JSON", path=json_path)

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError as e:
        raise FormatError("plan.json is not UTF-8", path=json_path, offset=e.start) from None
    except json.JSONDecodeError as e:
        raise FormatError(f"plan.json is not valid JSON: {e.msg}", path=json_path, offset=e.pos) from None
    except RecursionError:
        raise FormatError("plan.json nests too deeply", path=json_path) from None


def _check_header(doc: Any, json_path: str) -> tuple[dict[str, Any], str]:
    try:
        _, digest, inputs, summary, arrays = _check_envelope(
            doc, FORMAT_NAME, (FORMAT_VERSION,),
            lambda version: f"unsupported plan format_version {version} (this reads {FORMAT_VERSION} and compact "
                            f"{', '.join(map(str, COMPACT_FORMAT_VERSIONS))})")

        seed = _field(inputs, "seed", (int,), "inputs")
        b = _field(inputs, "global_batch_size", (int,), "inputs")
        seq_len = _field(inputs, "seq_len", (int,), "inputs", optional=True)
        _field(inputs, "num_steps", (int,), "inputs", optional=True)
        _field(inputs, "epochs", (float,), "inputs", optional=True)
        shuffle = _field(inputs, "shuffle", (str,), "inputs")
        block_size = _field(inputs, "block_size", (int,), "inputs", optional=True)
        sources = _field(inputs, "sources", (list,), "inputs")
        _require(seed >= 0 and b >= 1, "seed must be >= 0 and global_batch_size >= 1")
        _require(shuffle in SHUFFLES, f"inputs.shuffle must be one of {SHUFFLES}")
        _require((block_size is not None) == (shuffle == "block") and (block_size is None or block_size >= 1),
                 "inputs.block_size goes with shuffle='block' and must be >= 1")
        _require(1 <= len(sources) <= 65535, "inputs.sources must list 1 to 65535 datasets")
        for i, s in enumerate(sources):
            where = f"inputs.sources[{i}]"
            _field(s, "fingerprint", (str,), where)
            _require(_field(s, "weight", (float,), where) > 0, f"{where}.weight must be > 0")
            _require(_field(s, "num_samples", (int,), where) >= 1, f"{where}.num_samples must be >= 1")
            _field(s, "token_dtype", (str,), where, optional=True)

        kind = _field(summary, "kind", (str,), "summary")
        _require(kind in KINDS, f"summary.kind must be one of {KINDS}")
        _require((seq_len is not None) == (kind == "tokens") and (seq_len is None or seq_len >= 1),
                 "inputs.seq_len goes with token plans and must be >= 1")
        num_steps = _field(summary, "num_steps", (int,), "summary")
        num_items = _field(summary, "num_items", (int,), "summary")
        num_pieces = _field(summary, "num_pieces", (int,), "summary")
        _require(num_steps >= 1 and num_items == num_steps * b, "summary.num_items must be num_steps * global_batch_size")
        _require(num_pieces >= num_items, "summary.num_pieces must be >= num_items")
        datasets = _field(summary, "datasets", (list,), "summary")
        _require(len(datasets) == len(sources), "summary.datasets must have one entry per source")
        for i, d in enumerate(datasets):
            where = f"summary.datasets[{i}]"
            _require(_field(d, "items", (int,), where) >= 0, f"{where}.items must be >= 0")
            _field(d, "share", (float,), where)
            _field(d, "epochs_started", (int,), where)
            _field(d, "epochs_covered", (float,), where)
        _require(sum(d["items"] for d in datasets) == num_items, "summary.datasets items must add up to num_items")

        _require(set(arrays) == set(ARRAY_DTYPES), f"arrays must be exactly {sorted(ARRAY_DTYPES)}")
        for name, dtype in ARRAY_DTYPES.items():
            spec = _field(arrays, name, (dict,), "arrays")
            _require(_field(spec, "dtype", (str,), f"arrays.{name}") == dtype, f"arrays.{name}.dtype must be {dtype}")
            shape = _field(spec, "shape", (list,), f"arrays.{name}")
            want = num_items + 1 if name == "item_ptr" else num_pieces
            _require(shape == [want], f"arrays.{name}.shape must be [{want}]")
    except _Bad as e:
        raise FormatError(f"malformed plan.json: {e}", path=json_path) from None
    header = {k: doc[k] for k in ("format", "format_version", "inputs", "summary", "arrays")}
    return header, digest


# ---- arrays ----------------------------------------------------------------------------------
def _check_arrays(header: dict[str, Any], a: dict[str, np.ndarray], path: str) -> None:
    inputs, summary = header["inputs"], header["summary"]
    num_items, num_pieces = summary["num_items"], summary["num_pieces"]
    sample_limits = np.array([s["num_samples"] for s in inputs["sources"]], dtype=np.int64)
    num_datasets = len(sample_limits)
    tokens = summary["kind"] == "tokens"
    seq_len = inputs["seq_len"]
    ptr = a["item_ptr"]

    def fail(name: str, message: str, index: int) -> None:
        raise FormatError(message, path=os.path.join(path, name + ".npy"), index=int(index))

    if ptr[0] != 0:
        fail("item_ptr", "item_ptr must start at 0", 0)
    if ptr[-1] != num_pieces:
        fail("item_ptr", "item_ptr must end at num_pieces", num_items)
    item_counts = np.zeros(num_datasets, dtype=np.int64)
    for lo in range(0, num_items, CHUNK):
        hi = min(lo + CHUNK, num_items)
        p = np.asarray(ptr[lo : hi + 1])
        steps = np.diff(p)
        bad = np.flatnonzero(steps < 1)
        if bad.size:
            fail("item_ptr", "item_ptr must increase strictly (every item has a piece)", lo + bad[0] + 1)
        if not tokens and int(steps.max()) != 1:
            fail("item_ptr", "a sample plan has one piece per item", lo + int(np.argmax(steps)) + 1)
        first_ds = np.asarray(a["piece_dataset"][p[:-1]])
        if int(first_ds.max()) >= num_datasets:
            fail("piece_dataset", "dataset index out of range", p[int(np.argmax(first_ds))])
        item_counts += np.bincount(first_ds, minlength=num_datasets)
        if tokens:
            base = int(p[0])
            lengths = np.asarray(a["piece_length"][base : int(p[-1])])
            sums = np.add.reduceat(lengths, p[:-1] - base)
            bad = np.flatnonzero(sums != seq_len + 1)
            if bad.size:
                fail("piece_length", f"a token item must hold seq_len + 1 = {seq_len + 1} tokens", lo + bad[0])
            ds = np.asarray(a["piece_dataset"][base : int(p[-1])])
            bad = np.flatnonzero(ds != np.repeat(first_ds, steps))
            if bad.size:
                fail("piece_dataset", "all pieces of an item must come from one dataset", base + bad[0])
    if item_counts.tolist() != [d["items"] for d in summary["datasets"]]:
        raise FormatError("per-dataset item counts differ from summary.datasets", path=os.path.join(path, PLAN_JSON))

    for lo in range(0, num_pieces, CHUNK):
        hi = min(lo + CHUNK, num_pieces)
        ds = np.asarray(a["piece_dataset"][lo:hi])
        if int(ds.max()) >= num_datasets:
            fail("piece_dataset", "dataset index out of range", lo + int(np.argmax(ds)))
        sample = np.asarray(a["piece_sample"][lo:hi])
        bad = np.flatnonzero((sample < 0) | (sample >= sample_limits[ds]))
        if bad.size:
            fail("piece_sample", "sample id out of range for its dataset", lo + bad[0])
        offset = np.asarray(a["piece_offset"][lo:hi])
        length = np.asarray(a["piece_length"][lo:hi])
        bad = np.flatnonzero(offset != 0) if not tokens else np.flatnonzero(offset < 0)
        if bad.size:
            fail("piece_offset", "piece offsets must be >= 0 (0 for whole samples)", lo + bad[0])
        bad = np.flatnonzero(length < (1 if tokens else 0))
        if bad.size:
            fail("piece_length", "piece lengths must be positive", lo + bad[0])
        if tokens:
            bad = np.flatnonzero(length > seq_len + 1)
            if bad.size:
                fail("piece_length", "a piece is longer than seq_len + 1", lo + bad[0])
