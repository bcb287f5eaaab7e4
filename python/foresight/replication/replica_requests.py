"""The replica manager's requests, checked before any handler runs: checkpoint and file names (a job names only its
own checkpoints ``<job>/...``), the ``{job, checkpoint}`` requests and ``set_replication_hints``' hints; and
:func:`ckpt_key`, a checkpoint name as one etcd key segment.

Example::

    req = decode_hints({"job": "run-7", "checkpoint": "run-7/step-100", "ttl_s": 600,
                        "files": [{"path": "model.safetensors", "size": 1 << 30, "readers": 64, "hot_bytes": 0}]})
    key = cluster.key("hints", req["job"], "ckpt", ckpt_key(req["checkpoint"]))
"""
from __future__ import annotations

from typing import Any
from urllib.parse import quote

from foresight.cluster.requests import check_fields, check_ident, fail
from foresight.errors import ProtocolError
from foresight.replication.hints import MAX_TTL_S, FileHint, HintError
from foresight.replication.units import check_file_name, check_name

MAX_FILES = 1 << 16
MAX_HINTS_BYTES = MAX_FILES * 384  # a set_replication_hints body: MAX_FILES hints of long names


def ckpt_key(name: str) -> str:
    """A checkpoint name as one etcd key segment (URL-quoted, slashes included)."""
    return quote(name, safe="")


def check_checkpoint(job: str, name: Any) -> str:
    """A checkpoint name ``<job>/...`` of safe parts: a job hints and reads only its own checkpoints."""
    if not isinstance(name, str):
        fail("checkpoint must be a string", got=repr(name)[:40])
    try:
        check_name(name)
    except Exception as e:
        raise ProtocolError(str(e)) from None
    if name.split("/")[0] != job:
        fail("a job may hint, publish and read only its own checkpoints (named '<job>/...')", job=job,
             checkpoint=name)
    return name


def check_file(name: Any) -> str:
    """A file name inside a checkpoint directory, checked (one safe path segment)."""
    if not isinstance(name, str):
        fail("file must be a string", got=repr(name)[:40])
    try:
        return check_file_name(name)
    except Exception as e:
        raise ProtocolError(str(e)) from None


# -- request decoders (checked before any handler runs) ------------------------------------------------------
def decode_ckpt_request(o: dict) -> dict:
    check_fields(o, ("job", "checkpoint"), (), "request")
    job = check_ident(o["job"], "job")
    return {"job": job, "checkpoint": check_checkpoint(job, o["checkpoint"])}


def decode_hints(o: dict) -> dict:
    check_fields(o, ("job", "checkpoint", "ttl_s", "files"),
                 ("allow_partial", "cold_bytes", "cold_reads", "copies_join"), "set_replication_hints")
    job = check_ident(o["job"], "job")
    ttl = o["ttl_s"]
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL_S:
        raise HintError(f"hint TTL {ttl!r} s is not in (0, {MAX_TTL_S}]")
    files = o["files"]
    if not isinstance(files, list) or not 1 <= len(files) <= MAX_FILES:
        raise HintError(f"files must be a list of 1 to {MAX_FILES} hints")
    hints = []
    for f in files:
        if not isinstance(f, dict) or set(f) != {"path", "size", "readers", "hot_bytes"}:
            raise HintError("each hint must be {path, size, readers, hot_bytes}", got=repr(f)[:80])
        for k in ("size", "readers", "hot_bytes"):
            if isinstance(f[k], bool) or not isinstance(f[k], int):
                raise HintError(f"hint field {k} must be an integer", path=str(f["path"])[:80])
        hints.append(FileHint(check_file(f["path"]), f["size"], f["readers"], f["hot_bytes"]))
    cold = {}
    for k in ("cold_bytes", "cold_reads"):  # what the readers read before the hinted files (a cold-first schedule)
        v = o.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 62:
            raise HintError(f"{k} must be an integer >= 0", got=repr(v)[:80])
        cold[k] = v
    join = o.get("copies_join", False)
    if not isinstance(join, bool):
        raise HintError("copies_join must be true or false", got=repr(join)[:80])
    return {"job": job, "checkpoint": check_checkpoint(job, o["checkpoint"]), "ttl_s": float(ttl), "files": hints,
            "allow_partial": bool(o.get("allow_partial", False)), "copies_join": join, **cold}


__all__ = ["MAX_FILES", "MAX_HINTS_BYTES", "check_checkpoint", "check_file", "ckpt_key", "decode_ckpt_request", "decode_hints"]
