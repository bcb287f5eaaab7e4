"""Flight plumbing shared by replication's sender and receiver: the one-column wire schema, calls, DoPut streams.

Every replication byte travels as record batches of one ``binary`` column (:data:`SCHEMA`, built without copying by
:func:`binary_batch`); a DoPut names its kind and JSON command in the descriptor path (:func:`_command`), the
receiver iterates its payload (:func:`_chunks`, :func:`_unit_parts`) and the sender reads the JSON answer
(:func:`_ack`).

Example::

    from foresight.replication.flight_calls import call
    call("grpc://127.0.0.1:9000", "replication.ping")   # {"site": "eval-b"}
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
from pyarrow import flight

from foresight.errors import ProtocolError
from foresight.replication.source import WIRE_CHUNK

SCHEMA = pa.schema([("data", pa.binary())])


def binary_batch(view: memoryview) -> pa.RecordBatch:
    """One row of ``view``'s bytes, without copying them."""
    offsets = pa.py_buffer(np.array([0, len(view)], np.int32).tobytes())
    arr = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(view)])
    return pa.record_batch([arr], schema=SCHEMA)


def _site_endpoint(resolver: Any, site: str) -> str | None:
    v = resolver._etcd.get(f"/foresight/sites/{site}/replication")
    return v[0].decode() if v else None


def call(endpoint: str, action: str, body: dict[str, Any] | None = None, *, client: Any = None) -> dict[str, Any]:
    """One ``DoAction`` with a JSON body; returns the JSON answer."""
    c = client or flight.connect(endpoint)
    try:
        res = list(c.do_action(flight.Action(action, json.dumps(body or {}).encode())))
    finally:
        if client is None:
            c.close()
    return json.loads(res[0].body.to_pybytes()) if res else {}


def _command(descriptor: Any) -> dict[str, Any]:
    if len(descriptor.path) != 2:
        raise ProtocolError("replication DoPut wants the path [kind, JSON command]")
    try:
        cmd = json.loads(descriptor.path[1])
    except ValueError as e:
        raise ProtocolError(f"replication DoPut command is not JSON: {e}") from None
    if not isinstance(cmd, dict) or not isinstance(cmd.get("name"), str):
        raise ProtocolError("replication DoPut command must be an object naming the checkpoint")
    return cmd


def _chunks(reader: Any) -> Any:
    for chunk in reader:
        col = chunk.data.column(0)
        offs = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + len(col) + 1]
        if len(col):
            yield memoryview(col.buffers()[2])[int(offs[0]):int(offs[-1])]


def _ack(writer: Any, reader: Any) -> dict[str, Any]:
    """The site's JSON answer to a DoPut. A stream the site dropped (it died or restarted) has none: its error
    surfaces at close; a refusal stays a ``FlightServerError``, anything else means the site is unavailable."""
    answer = reader.read()
    try:
        writer.close()
    except flight.FlightServerError:
        raise
    except flight.FlightError as e:
        raise flight.FlightUnavailableError(f"site dropped the stream: {e}") from e
    if answer is None:
        raise flight.FlightUnavailableError("site closed the stream without an answer")
    return json.loads(answer.to_pybytes())


def _unit_parts(reader: Any) -> Any:
    """``(header or None, body bytes)`` per record batch of a ``replica.units`` stream."""
    for chunk in reader:
        header = json.loads(chunk.app_metadata.to_pybytes()) if chunk.app_metadata is not None else None
        if header is not None and not isinstance(header, dict):
            raise ProtocolError("unit header must be a JSON object")
        col = chunk.data.column(0)
        offs = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + len(col) + 1]
        yield header, (memoryview(col.buffers()[2])[int(offs[0]):int(offs[-1])] if len(col) else b"")


def put_body(client: Any, kind: str, cmd: dict[str, Any], body: bytes) -> dict[str, Any]:
    """``DoPut kind`` with the JSON command ``cmd`` in its descriptor and ``body`` streamed (any size: actions
    are bounded to 64 KiB); returns the site's JSON answer."""
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(kind, json.dumps(cmd)), SCHEMA)
    mv = memoryview(body)
    for pos in range(0, max(len(mv), 1), WIRE_CHUNK):
        writer.write_batch(binary_batch(mv[pos:pos + WIRE_CHUNK]))
    writer.done_writing()
    return _ack(writer, reader)


def json_body(reader: Any, what: str) -> dict[str, Any]:
    """A DoPut body sent by :func:`put_body` with a JSON object in it."""
    try:
        obj = json.loads(b"".join(bytes(c) for c in _chunks(reader)) or b"{}")
    except ValueError as e:
        raise ProtocolError(f"{what} body is not JSON: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} body must be a JSON object")
    return obj
