"""Plans uploaded to a node once and kept by digest (``DoPut`` with descriptor path ``["plan", digest]``).

A job whose plan is not on the node's data root sends the plan directory's files (``plan.json`` and the ``.npy``
arrays; nothing else) as record batches of ``(name, data)`` rows. The node writes them into
``<root>/.uploads/plans/<hex>`` through a temporary directory, loads the result with digest verification, and keeps
it only when the digest is the one claimed; from then on jobs name it like any plan under the root. Steps are never
sent: the node resolves them from this one copy.

A compact plan (``format_version`` 2 or 3) is sent as its ``plan.json`` alone (its inputs and per-dataset summary, a
few KB): the node computes ``block_prefix.npy`` again from the datasets it holds (found by the fingerprints the plan
names; :func:`foresight.plan.compact_store.rebuild_compact`) and keeps the plan only if the result matches the
digest.

Example::

    sent = upload_plan(client, "plan/", plan.digest, options)  # client side, once per node; bytes sent
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from foresight.errors import PlanError, ProtocolError
from foresight.plan import load_plan
from foresight.plan.compact import COMPACT_FORMAT_VERSIONS
from foresight.plan.compact_store import rebuild_compact
from foresight.plan.files import PLAN_JSON

UPLOAD_DIR = os.path.join(".uploads", "plans")
_FILE = re.compile(r"^(plan\.json|[a-z_]{1,40}\.npy)$")


def is_plan_file(name: str) -> bool:
    """Whether ``name`` is a file a plan directory holds (``plan.json`` and its ``.npy`` arrays; nothing else is
    sent or copied)."""
    return bool(_FILE.match(name))


def _schema():
    import pyarrow as pa

    return pa.schema([("name", pa.string()), ("data", pa.large_binary())])


def _is_compact(plan_json: str) -> bool:
    try:
        with open(plan_json, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return False  # not readable as a plan: sent as it is, and the node refuses it
    return isinstance(doc, dict) and doc.get("format_version") in COMPACT_FORMAT_VERSIONS


def upload_plan(client, plan_dir: str, digest: str, options) -> int:
    """Send ``plan_dir``'s plan files to the node behind ``client`` (a compact plan's ``plan.json`` alone);
    returns the bytes of file data sent."""
    import pyarrow as pa
    import pyarrow.flight as flight

    if _is_compact(os.path.join(plan_dir, PLAN_JSON)):
        names = [PLAN_JSON]  # the node derives the rest from its datasets
    else:
        names = sorted(n for n in os.listdir(plan_dir) if _FILE.match(n))
    sent = 0
    writer, reader = client.do_put(flight.FlightDescriptor.for_path("plan", digest), _schema(), options)
    try:
        for name in names:
            with open(os.path.join(plan_dir, name), "rb") as f:
                data = f.read()
            writer.write_batch(pa.record_batch([pa.array([name]), pa.array([data], pa.large_binary())],
                                               schema=_schema()))
            sent += len(data)
        writer.done_writing()
        reader.read()
    finally:
        writer.close()
    return sent


def _derive_compact(tmp: str, find_dataset: Callable[[str], Any] | None) -> None:
    """A compact plan uploaded as plan.json alone: its block_prefix.npy computed here from the node's datasets."""
    try:
        with open(os.path.join(tmp, PLAN_JSON), "rb") as f:
            sources = json.loads(f.read())["inputs"]["sources"]
        fingerprints = [str(s["fingerprint"]) for s in sources]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"uploaded compact plan's plan.json has no readable sources: {e}"[:300]) from None
    found = [find_dataset(fp) if find_dataset is not None else None for fp in fingerprints]
    missing = [fp for fp, ds in zip(fingerprints, found) if ds is None]
    if missing:
        raise ProtocolError("a compact plan is derived from its datasets, and the node does not hold them all",
                            missing=",".join(missing)[:300])
    try:
        rebuild_compact(tmp, found)
    except (OSError, ValueError, PlanError) as e:
        raise ProtocolError(f"uploaded compact plan cannot be derived from the node's datasets: {e}"[:300]) from None


def receive_plan(root: str, digest: str, reader, *, max_bytes: int,
                 find_dataset: Callable[[str], Any] | None = None) -> str:
    """Write an uploaded plan under ``root`` and verify it; returns its name relative to ``root``. A compact plan
    sent as plan.json alone is completed from the datasets ``find_dataset(fingerprint)`` opens (None: not held)."""
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
                path = os.path.join(tmp, name)
                try:
                    with open(path, "wb") as f:
                        f.write(buf)
                except OSError as e:  # disk full or file too large: the caller hears which file, by its name
                    raise OSError(e.errno, e.strerror, path) from None
        names = set(os.listdir(tmp))
        if names == {PLAN_JSON} and _is_compact(os.path.join(tmp, PLAN_JSON)):
            _derive_compact(tmp, find_dataset)
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


__all__ = ["UPLOAD_DIR", "is_plan_file", "receive_plan", "upload_plan"]
