"""Plans uploaded to a node once and kept by digest (``DoPut`` with descriptor path ``["plan", digest]``).

A job whose plan is not on the node's data root sends the plan directory's files (``plan.json`` and the ``.npy``
arrays; nothing else) as record batches of ``(name, data)`` rows. The node writes them into
``<root>/.uploads/plans/<hex>`` through a temporary directory, loads the result with digest verification, and keeps
it only when the digest is the one claimed; from then on jobs name it like any plan under the root. Steps are never
sent: the node resolves them from this one copy.

Example::

    upload_plan(client, "plan/", plan.digest, options)        # client side, once per node
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile

from foresight.errors import ProtocolError
from foresight.plan import load_plan

UPLOAD_DIR = os.path.join(".uploads", "plans")
_FILE = re.compile(r"^(plan\.json|[a-z_]{1,40}\.npy)$")


def _schema():
    import pyarrow as pa

    return pa.schema([("name", pa.string()), ("data", pa.large_binary())])


def upload_plan(client, plan_dir: str, digest: str, options) -> None:
    """Send ``plan_dir``'s plan files to the node behind ``client``."""
    import pyarrow as pa
    import pyarrow.flight as flight

    names = sorted(n for n in os.listdir(plan_dir) if _FILE.match(n))
    writer, reader = client.do_put(flight.FlightDescriptor.for_path("plan", digest), _schema(), options)
    try:
        for name in names:
            with open(os.path.join(plan_dir, name), "rb") as f:
                writer.write_batch(pa.record_batch([pa.array([name]), pa.array([f.read()], pa.large_binary())],
                                                   schema=_schema()))
        writer.done_writing()
        reader.read()
    finally:
        writer.close()


def receive_plan(root: str, digest: str, reader, *, max_bytes: int) -> str:
    """Write an uploaded plan under ``root`` and verify it; returns its name relative to ``root``."""
    if not re.match(r"^sha256:[0-9a-f]{64}$", digest):
        raise ProtocolError("plan digest must be 'sha256:<64 hex>'", digest=digest[:80])
    rel = os.path.join(UPLOAD_DIR, digest.split(":", 1)[1])
    final = os.path.join(root, rel)
    if os.path.isdir(final):
        return rel  # kept from an earlier upload
    os.makedirs(os.path.join(root, UPLOAD_DIR), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".incoming-", dir=os.path.join(root, UPLOAD_DIR))
    try:
        total = 0
        for chunk in reader:
            batch = chunk.data
            if batch.schema.names != ["name", "data"]:
                raise ProtocolError("plan upload has unexpected columns", columns=",".join(batch.schema.names))
            for name, data in zip(batch.column(0).to_pylist(), batch.column(1)):
                if not isinstance(name, str) or not _FILE.match(name):
                    raise ProtocolError("plan upload names a file a plan does not have", name=str(name)[:60])
                buf = data.as_buffer()
                total += buf.size
                if total > max_bytes:
                    raise ProtocolError("plan upload is larger than the node accepts", limit=max_bytes)
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(buf)
        try:
            plan = load_plan(tmp)
        except (OSError, ValueError) as e:
            raise ProtocolError(f"uploaded plan does not load: {e}"[:300]) from None
        if plan.digest != digest:
            raise ProtocolError("uploaded plan's digest differs from the one claimed", claimed=digest,
                                actual=plan.digest)
        del plan
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # another upload of the same plan won the race: keep that one
                raise
        return rel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["UPLOAD_DIR", "receive_plan", "upload_plan"]
