"""The node's wire protocol on Arrow Flight: request decoding, tickets and tensors as Arrow record batches.

Every call carries two gRPC headers, ``x-foresight-job`` and ``x-foresight-token``; every action body and ticket
is a small JSON object checked field by field here (types, ranges, lengths, unknown keys refused), so that the
server never acts on a request it did not fully understand. Nothing here unpickles or evaluates anything.

Actions (``DoAction``; body JSON -> result JSON):
    ``health``        {}                                   -> node id, datasets, plans, cpu, guard, jobs (no token)
    ``register_job``  {job, datasets, plan, plan_digest, rank, world_size, specs, seed, step, lead, queue_bytes,
                       spec_digest, guard_reply}           -> shards this node serves per dataset, lead, queue cap
    ``progress``      {job, step}                          -> the step the job consumed last; the node decodes ahead
    ``status``        {}                                   -> per-job queue depth, lead, bytes, fallbacks; node cpu
    ``unregister_job`` {job}
Streams (``DoGet``): ticket JSON ``{"job", "rank", "step"}`` -> this node's part of the step: record batches with
columns ``position`` (int64, index in the rank's step), ``modality``, ``dtype``, ``shape`` (list<int64>) and
``data`` (large_binary); schema metadata ``kind`` is ``decoded``, ``raw`` (CPU guard: raw sample bytes) or
``deferred`` (CPU guard, for a job registered with ``guard_reply: "defer"``: positions only, empty ``data``; the
client reads and decodes those samples itself, from its own access to the same shards). Metadata ``corrupt``
(comma-separated positions) names samples the node left out because its copy of their bytes failed the shard
map's xxh3 (:func:`corrupt_positions`); the client decodes those itself.

Example::

    req = decode_action("progress", b'{"job": "j1", "step": 3}')     # -> {"job": "j1", "step": 3}
    ticket = encode_ticket("j1", rank=0, step=4)
    batches = encode_tensors("decoded", [(0, "video", tensor)], step=4, node="n1")
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable

import numpy as np

from foresight._native import load
from foresight.cluster.requests import check_fields, check_ident, fail
from foresight.errors import ProtocolError
from foresight.format import Modality
from foresight.media import TransformSpec

PROTOCOL_VERSION = 1
#: Largest action body or ticket accepted, in bytes (plans never travel in actions).
MAX_MESSAGE_BYTES = 64 << 10
#: Deepest nesting of arrays and objects accepted in a request (the deepest real one, register_job, has 4).
MAX_NESTING = 16
#: Largest tensor payload in one record batch (a step part is split into several batches).
MAX_BATCH_BYTES = 8 << 20
KIND_DECODED, KIND_RAW, KIND_DEFERRED = "decoded", "raw", "deferred"
#: What a job asks a node under its CPU guard to answer: the raw sample bytes, or "read them yourself".
GUARD_REPLIES = ("raw", "defer")
_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bfloat16")


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        fail(f"{name} must be an integer in [{lo}, {hi}]", got=repr(v)[:40])
    return v


def _relpath(v: Any, name: str) -> str:
    """A dataset or plan name relative to the node's data root; the server also checks it resolves inside."""
    if not isinstance(v, str) or not 0 < len(v) <= 512 or "\x00" in v:
        fail(f"{name} must be a non-empty path of at most 512 characters", got=repr(v)[:40])
    if v.startswith("/") or any(part in ("..", "") for part in v.split("/")):
        fail(f"{name} must be relative to the data root, without '..' or empty parts", got=v[:80])
    return v


def _digest(v: Any, name: str) -> str:
    if not isinstance(v, str) or not re.match(r"^[a-z0-9]{2,16}:[0-9a-f]{8,128}$", v):
        fail(f"{name} must look like 'sha256:<hex>'", got=repr(v)[:40])
    return v


def _spec_dict(v: Any, modality: str) -> dict:
    if not isinstance(v, dict):
        fail("a transform spec must be a JSON object", modality=modality)
    allowed = set(TransformSpec.__dataclass_fields__)
    unknown = sorted(set(v) - allowed)
    if unknown:
        fail("unknown transform spec fields (only the registered TransformSpec fields are accepted)",
             modality=modality, fields=",".join(unknown)[:80])
    try:
        spec = TransformSpec.from_dict(v)
    except (TypeError, ValueError, KeyError) as e:
        raise ProtocolError(f"bad transform spec: {e}", modality=modality) from None
    if spec.modality != modality:
        fail("spec modality differs from its key", key=modality, modality=spec.modality)
    return spec.to_dict()


def _parse(body: bytes, what: str, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """A request body as a JSON object, bounded before parsing: at most ``max_bytes`` (:data:`MAX_MESSAGE_BYTES`
    unless the action names its own bound) and :data:`MAX_NESTING` levels (the parser recurses per level);
    anything else is one-line :class:`ProtocolError`."""
    if not isinstance(body, (bytes, bytearray, memoryview)):
        fail(f"{what} must be bytes")
    body = bytes(body)
    if len(body) > max_bytes:
        fail(f"{what} is larger than the node accepts", bytes=len(body), limit=max_bytes)
    depth = nesting_depth(body)
    if depth > MAX_NESTING:
        fail(f"{what} is nested deeper than the node accepts", depth=depth, limit=MAX_NESTING)
    try:
        obj = json.loads(body.decode("utf-8") or "{}", parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"{what} is not valid JSON: {e}"[:200]) from None
    if not isinstance(obj, dict):
        fail(f"{what} must be a JSON object")
    return obj


#: JSON string literals (escapes included), whose brackets do not nest.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def nesting_depth(body: bytes) -> int:
    """How deep ``[``/``{`` nest in a JSON text, outside strings (one regex pass and one cumulative sum, no parse;
    an unterminated string counts as text, which the parser then refuses)."""
    text = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    step = (text == ord("[")).astype(np.int32) + (text == ord("{")) - (text == ord("]")) - (text == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def parse_request(body: bytes, what: str = "request") -> dict:
    """A bounded JSON object of a request (extensions' tickets and bodies); see :func:`decode_action`."""
    return _parse(body, what)


def _no_constant(name: str) -> None:
    fail(f"JSON constant {name} is not accepted")


def _register_job(o: dict) -> dict:
    check_fields(o, ("job", "datasets", "plan", "plan_digest", "rank", "world_size", "specs", "seed"),
                 ("step", "lead", "queue_bytes", "spec_digest", "version", "guard_reply"), "register_job")
    ds = o["datasets"]
    if not isinstance(ds, list) or not 1 <= len(ds) <= 64:
        fail("datasets must be a list of 1 to 64 names")
    specs = o["specs"]
    labels = {m.label for m in Modality}
    if not isinstance(specs, dict) or not 1 <= len(specs) <= len(labels):
        fail("specs must map modality names to transform specs")
    for k in specs:
        if k not in labels:
            fail(f"spec for unknown modality; allowed: {sorted(labels)}", modality=str(k)[:20])
    world = _int(o["world_size"], "world_size", 1, 1 << 20)
    out = {
        "job": check_ident(o["job"], "job"),
        "datasets": [_relpath(d, "dataset") for d in ds],
        "plan": _relpath(o["plan"], "plan"),
        "plan_digest": _digest(o["plan_digest"], "plan_digest"),
        "rank": _int(o["rank"], "rank", 0, world - 1),
        "world_size": world,
        "specs": {k: _spec_dict(v, k) for k, v in specs.items()},
        "seed": _int(o["seed"], "seed", 0, (1 << 63) - 1),
        "step": _int(o.get("step", 0), "step", 0, 1 << 40),
        "lead": _int(o.get("lead", 2), "lead", 1, 64),
        "queue_bytes": _int(o.get("queue_bytes", 256 << 20), "queue_bytes", 1, 1 << 40),
        "spec_digest": None if o.get("spec_digest") is None else check_ident(o["spec_digest"], "spec_digest"),
        "version": _int(o.get("version", PROTOCOL_VERSION), "version", PROTOCOL_VERSION, PROTOCOL_VERSION),
        "guard_reply": o.get("guard_reply", "raw"),
    }
    if out["guard_reply"] not in GUARD_REPLIES:
        fail(f"guard_reply must be one of {list(GUARD_REPLIES)}")
    return out


def _progress(o: dict) -> dict:
    check_fields(o, ("job", "step"), ("rank",), "progress")
    return {"job": check_ident(o["job"], "job"), "step": _int(o["step"], "step", -1, 1 << 40)}


def _job_only(o: dict) -> dict:
    check_fields(o, ("job",), (), "request")
    return {"job": check_ident(o["job"], "job")}


def _empty(o: dict) -> dict:
    check_fields(o, (), (), "request")
    return {}


#: Body decoders of the built-in actions; :meth:`NodeServer.register_action` adds more.
ACTION_DECODERS = {
    "health": _empty,
    "status": _empty,
    "register_job": _register_job,
    "progress": _progress,
    "unregister_job": _job_only,
}


def decode_action(name: str, body: bytes, decoders: dict | None = None, *,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """The checked request of action ``name`` (a body of at most ``max_bytes``); :class:`ProtocolError` for
    anything unexpected."""
    decoders = ACTION_DECODERS if decoders is None else decoders
    if name not in decoders:
        fail(f"unknown action; known: {sorted(decoders)}", action=str(name)[:40])
    return decoders[name](_parse(body, f"{name} request", max_bytes))


def encode_ticket(job: str, *, rank: int, step: int) -> bytes:
    return json.dumps({"job": job, "rank": int(rank), "step": int(step)}, separators=(",", ":")).encode()


def decode_ticket(body: bytes) -> dict:
    o = _parse(body, "ticket")
    check_fields(o, ("job", "rank", "step"), (), "ticket")
    return {"job": check_ident(o["job"], "job"), "rank": _int(o["rank"], "rank", 0, 1 << 20),
            "step": _int(o["step"], "step", 0, 1 << 40)}


# -- tensors as record batches ------------------------------------------------------------------------------


def _schema(kind: str, step: int, node: str, corrupt: np.ndarray | None = None):
    import pyarrow as pa

    metadata = {"kind": kind, "step": str(step), "node": node, "version": str(PROTOCOL_VERSION)}
    if corrupt is not None and len(corrupt):
        metadata["corrupt"] = ",".join(str(int(p)) for p in corrupt)
    return pa.schema(
        [("position", pa.int64()), ("modality", pa.string()), ("dtype", pa.string()),
         ("shape", pa.list_(pa.int64())), ("data", pa.large_binary())],
        metadata=metadata,
    )


def corrupt_positions(schema) -> np.ndarray:
    """Positions a node left out of its part because its copy of their bytes failed the xxh3 check (the
    ``corrupt`` schema metadata; the client decodes them itself)."""
    raw = (schema.metadata or {}).get(b"corrupt", b"")
    try:
        return np.asarray([int(p) for p in raw.split(b",") if p], dtype=np.int64)
    except ValueError:
        fail("a part's corrupt metadata is not a list of positions", got=raw[:40])


def _as_numpy(t) -> tuple[np.ndarray, str]:
    """A contiguous numpy view of a tensor/array and its dtype name (bfloat16 travels as its int16 bits)."""
    try:
        import torch

        if isinstance(t, torch.Tensor):
            t = t.detach().contiguous()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy(), "bfloat16"
            return t.numpy(), str(t.dtype).removeprefix("torch.")
    except ImportError:  # pragma: no cover
        pass
    a = np.ascontiguousarray(t)
    return a, str(a.dtype)


def encode_tensors(kind: str, rows: Iterable[tuple[int, str, Any]], *, step: int, node: str,
                   stacked: dict[str, tuple[np.ndarray, Any]] | None = None, corrupt: np.ndarray | None = None):
    """Record batches of ``(position, modality, tensor-or-bytes)`` rows, each at most :data:`MAX_BATCH_BYTES`.

    ``stacked`` maps a modality to ``(positions, batch_tensor)``: its rows are slices of one contiguous tensor,
    sent with zero copies (the Arrow values buffer *is* the tensor's memory). Other rows are concatenated (one copy).
    ``corrupt``: positions left out because the node's bytes failed their checksum (see :func:`corrupt_positions`).
    Returns ``(schema, batches, copied_bytes)``.
    """
    import pyarrow as pa

    schema = _schema(kind, step, node, corrupt)
    batches, copied = [], 0
    for modality, (positions, tensor) in (stacked or {}).items():
        arr, dtype = _as_numpy(tensor)
        n = len(positions)
        if n == 0:
            continue
        per = arr.nbytes // n
        rows_per_batch = max(1, MAX_BATCH_BYTES // max(per, 1))
        flat = arr.reshape(-1).view(np.uint8) if arr.nbytes else np.zeros(0, np.uint8)
        for lo in range(0, n, rows_per_batch):
            hi = min(n, lo + rows_per_batch)
            values = pa.py_buffer(flat[lo * per: hi * per])  # zero copy over the tensor
            offsets = pa.py_buffer(np.arange(hi - lo + 1, dtype=np.int64) * per)
            data = pa.Array.from_buffers(pa.large_binary(), hi - lo, [None, offsets, values])
            batches.append(pa.record_batch([
                pa.array(np.asarray(positions[lo:hi], dtype=np.int64)),
                pa.array([modality] * (hi - lo)), pa.array([dtype] * (hi - lo)),
                pa.array([list(arr.shape[1:])] * (hi - lo), type=pa.list_(pa.int64())), data], schema=schema))
    pending: list[tuple[int, str, np.ndarray, str]] = []
    size = 0
    for position, modality, t in rows:
        arr, dtype = _as_numpy(t)
        pending.append((int(position), modality, arr, dtype))
        size += arr.nbytes
        if size >= MAX_BATCH_BYTES:
            batches.append(_rows_batch(pending, schema))
            copied += size
            pending, size = [], 0
    if pending:
        batches.append(_rows_batch(pending, schema))
        copied += size
    return schema, batches, copied


def encode_raw(region: np.ndarray, x_dest: np.ndarray, lengths: np.ndarray, positions: np.ndarray,
               modalities: list[str], *, step: int, node: str, corrupt: np.ndarray | None = None):
    """Raw sample bytes (CPU guard) as record batches: the samples are gathered out of the read region (holes and
    alignment padding dropped) by one native call per batch. Returns ``(schema, batches, copied_bytes)``."""
    import pyarrow as pa

    core = load("_core")
    schema = _schema(KIND_RAW, step, node, corrupt)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    batches, lo = [], 0
    while lo < len(lengths):
        base = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, base + MAX_BATCH_BYTES, side="right")))
        offsets = np.zeros(hi - lo + 1, dtype=np.int64)
        offsets[1:] = ends[lo:hi] - base
        values = np.empty(int(offsets[-1]), dtype=np.uint8)
        core.gather(region, np.ascontiguousarray(x_dest[lo:hi], dtype=np.int64), lengths[lo:hi], values, offsets[:-1])
        data = pa.Array.from_buffers(pa.large_binary(), hi - lo, [None, pa.py_buffer(offsets), pa.py_buffer(values)])
        batches.append(pa.record_batch([
            pa.array(np.asarray(positions[lo:hi], dtype=np.int64)), pa.array(modalities[lo:hi], type=pa.string()),
            pa.array(["uint8"] * (hi - lo)), pa.array(lengths[lo:hi, None].tolist(), type=pa.list_(pa.int64())),
            data], schema=schema))
        lo = hi
    return schema, batches, int(lengths.sum())


def encode_deferred(positions: np.ndarray, modalities: list[str], *, step: int, node: str):
    """The CPU guard's answer to a job registered with ``guard_reply: "defer"``: which positions of the step the
    client reads and decodes itself (no bytes). Returns ``(schema, batches, copied_bytes)``."""
    import pyarrow as pa

    schema = _schema(KIND_DEFERRED, step, node)
    n = len(positions)
    empty = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(np.zeros(n + 1, dtype=np.int64)),
                                                         pa.py_buffer(b"")])
    batch = pa.record_batch([pa.array(np.asarray(positions, dtype=np.int64)), pa.array(modalities, type=pa.string()),
                             pa.array(["uint8"] * n), pa.array([[0]] * n, type=pa.list_(pa.int64())), empty],
                            schema=schema)
    return schema, [batch] if n else [], 0


def deferred_positions(batches: list) -> np.ndarray:
    """The positions of a ``deferred`` answer."""
    parts = [b.column(0).to_numpy() for b in batches]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def raw_samples(batches: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(positions, data, offsets, lengths)`` of raw record batches: sample i is ``data[offsets[i]:][:lengths[i]]``.
    One batch is used in place (``data`` views its Arrow buffer); several are concatenated once."""
    parts = []
    for b in batches:
        col = b.column(4)
        offs = np.frombuffer(col.buffers()[1], dtype=np.int64)[col.offset: col.offset + len(col) + 1]
        values = col.buffers()[2]
        data = np.frombuffer(values, dtype=np.uint8) if values is not None else np.zeros(0, np.uint8)
        if offs[-1] > data.nbytes or np.any(np.diff(offs) < 0):
            fail("raw record batch has offsets outside its data")
        parts.append((b.column(0).to_numpy(), data, offs[:-1].copy(), np.diff(offs)))
    if not parts:
        z = np.zeros(0, np.int64)
        return z, np.zeros(0, np.uint8), z, z
    if len(parts) == 1:
        return parts[0]
    shift = np.cumsum([0] + [p[1].nbytes for p in parts[:-1]])
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] + k for p, k in zip(parts, shift)]), np.concatenate([p[3] for p in parts]))


def _rows_batch(rows: list, schema):
    import pyarrow as pa

    lengths = np.array([a.nbytes for _, _, a, _ in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.uint8)
    for (_, _, a, _), lo, n in zip(rows, offsets[:-1], lengths):
        values[lo: lo + n] = a.reshape(-1).view(np.uint8)
    data = pa.Array.from_buffers(pa.large_binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(values)])
    return pa.record_batch([
        pa.array([p for p, _, _, _ in rows], type=pa.int64()), pa.array([m for _, m, _, _ in rows]),
        pa.array([d for _, _, _, d in rows]),
        pa.array([list(a.shape) for _, _, a, _ in rows], type=pa.list_(pa.int64())),
        data], schema=schema)


def decode_tensors(table_batches: Iterable, *, as_torch: bool = True) -> list[tuple[int, str, Any]]:
    """``(position, modality, tensor)`` rows of received record batches; tensors view the Arrow buffers (no copy).

    Raises :class:`ProtocolError` on a batch whose shapes, dtypes or sizes do not add up.
    """
    out = []
    for batch in table_batches:
        cols = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
        if set(cols) != {"position", "modality", "dtype", "shape", "data"}:
            fail("record batch has unexpected columns", columns=",".join(batch.schema.names))
        data = cols["data"]
        offsets = np.frombuffer(data.buffers()[1], dtype=np.int64)[data.offset: data.offset + len(data) + 1]
        values = data.buffers()[2]
        raw = np.frombuffer(values, dtype=np.uint8) if values is not None else np.zeros(0, np.uint8)
        positions = cols["position"].to_numpy()
        modalities = cols["modality"].to_pylist()
        dtypes = cols["dtype"].to_pylist()
        shapes = cols["shape"].to_pylist()
        for i in range(len(batch)):
            dtype, shape = dtypes[i], tuple(shapes[i])
            if dtype not in _DTYPES or any(s < 0 for s in shape):
                fail("tensor row has a bad dtype or shape", position=int(positions[i]), dtype=dtype)
            np_dtype = np.dtype("int16" if dtype == "bfloat16" else dtype)
            view = raw[int(offsets[i]): int(offsets[i + 1])]
            if view.nbytes != int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize:
                fail("tensor row's bytes do not match its shape", position=int(positions[i]), shape=shape)
            arr = view.view(np_dtype).reshape(shape)
            out.append((int(positions[i]), modalities[i], _to_torch(arr, dtype) if as_torch else arr))
    return out


def decode_blocks(batches: Iterable) -> list[tuple[str, np.ndarray, Any]]:
    """``(modality, positions, tensor)`` blocks of received record batches: a batch whose rows share modality,
    dtype and shape (every stacked one) is one ``(n, *shape)`` tensor viewing the Arrow buffer (no copy, no loop
    per row); other batches come as ``(modality, positions, [tensors])`` per modality."""
    import pyarrow.compute as pc

    out = []
    for batch in batches:
        if len(batch) == 0:
            continue
        names = batch.schema.names
        if names != ["position", "modality", "dtype", "shape", "data"]:
            fail("record batch has unexpected columns", columns=",".join(names))
        shape_col, data = batch.column(3), batch.column(4)
        n = len(batch)
        uniform = (pc.count_distinct(batch.column(1)).as_py() == 1 and pc.count_distinct(batch.column(2)).as_py() == 1)
        if uniform:
            list_offsets = np.frombuffer(shape_col.buffers()[1], dtype=np.int32)
            lens = np.diff(list_offsets[shape_col.offset: shape_col.offset + n + 1])
            uniform = bool(len(lens) and (lens == lens[0]).all())
        if uniform:
            dims = shape_col.flatten().to_numpy().reshape(n, int(lens[0]))
            uniform = bool((dims == dims[0]).all())
        if not uniform:  # rare: shapes differ within the step
            rows = decode_tensors([batch])
            for m in dict.fromkeys(m for _, m, _ in rows):
                mine = [(p, t) for p, mm, t in rows if mm == m]
                out.append((m, np.array([p for p, _ in mine], dtype=np.int64), [t for _, t in mine]))
            continue
        dtype, shape = batch.column(2)[0].as_py(), tuple(int(d) for d in dims[0])
        if dtype not in _DTYPES or any(d < 0 for d in shape):
            fail("tensor block has a bad dtype or shape", dtype=dtype)
        np_dtype = np.dtype("int16" if dtype == "bfloat16" else dtype)
        per = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        offsets = np.frombuffer(data.buffers()[1], dtype=np.int64)[data.offset: data.offset + n + 1]
        if not np.array_equal(offsets - offsets[0], np.arange(n + 1, dtype=np.int64) * per):
            fail("tensor block's bytes do not match its shape", shape=shape)
        values = data.buffers()[2]
        raw = np.frombuffer(values, dtype=np.uint8) if values is not None else np.zeros(0, np.uint8)
        if int(offsets[-1]) > raw.nbytes:
            fail("tensor block runs past its data")
        arr = raw[int(offsets[0]): int(offsets[-1])].view(np_dtype).reshape((n, *shape))
        out.append((batch.column(1)[0].as_py(), batch.column(0).to_numpy(), _to_torch(arr, dtype)))
    return out


def _to_torch(arr: np.ndarray, dtype: str):
    import torch
    import warnings

    with warnings.catch_warnings():  # Arrow buffers are read-only; the tensor is never written in place
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


__all__ = [
    "ACTION_DECODERS", "KIND_DECODED", "KIND_RAW", "MAX_BATCH_BYTES", "MAX_NESTING",
    "nesting_depth", "parse_request",
    "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "ProtocolError", "decode_action", "decode_blocks", "decode_ticket",
    "decode_tensors",
    "encode_raw", "encode_tensors", "encode_ticket", "raw_samples", "encode_deferred", "deferred_positions",
    "KIND_DEFERRED", "GUARD_REPLIES", "corrupt_positions",
]
