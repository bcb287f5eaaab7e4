"""etcd's request limits, in one place, and the cutting of many operations into transactions that respect them.

etcd refuses a request over ``--max-request-bytes`` (default 1.5 MiB: "request is too large") and a transaction of
more than ``--max-txn-ops`` operations (default 128). Every batched write or read of the cluster (copy records, copy
tasks, a hint's parts, placement, ``Cluster.get_many``) goes through :func:`txn_chunks`, which cuts by both:
``TXN_OPS`` operations and ``TXN_BYTES`` bytes of keys and values (the rest of the 1.5 MiB is left for the
request's own framing and the compares a caller adds). One operation larger than ``TXN_BYTES`` alone is refused
here with the key and its size, not sent.

Example::

    ops = [put_op(k, v, lease_id) for k, v in items.items()]
    for chunk in txn_chunks(ops):
        cluster.txn(chunk)                     # each at most TXN_OPS operations and TXN_BYTES bytes
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from foresight.errors import NodeError

TXN_OPS = 100  # operations per transaction (etcd's --max-txn-ops default is 128; room for a caller's compares)
TXN_BYTES = 1 << 20  # key and value bytes per request (etcd's --max-request-bytes default is 1.5 MiB)
OP_BYTES = 32  # what etcd adds per operation (lease, field tags, lengths): counted with the key and value


def _b(s: str | bytes) -> bytes:
    return s.encode() if isinstance(s, str) else s


def put_op(key: str, value: str | bytes, lease_id: int | None = None) -> dict:
    """A put for a transaction, with its size (``op["nbytes"]``, dropped before it is sent)."""
    from etcd3gw.utils import _encode

    k, v = _b(key), _b(value)
    body: dict[str, Any] = {"key": _encode(k), "value": _encode(v)}
    if lease_id is not None:
        body["lease"] = int(lease_id)
    return {"request_put": body, "nbytes": len(k) + len(v) + OP_BYTES, "name": key}


def range_op(key: str, *, prefix: bool = False) -> dict:
    """A read of one key, or of every key under ``key`` when ``prefix``."""
    from etcd3gw.utils import _encode, _increment_last_byte

    body = {"key": _encode(key)}
    if prefix:
        body["range_end"] = _encode(_increment_last_byte(key))
    return {"request_range": body, "nbytes": 2 * len(_b(key)) + OP_BYTES, "name": key}


def op_bytes(ops: Sequence[dict]) -> int:
    return sum(op["nbytes"] for op in ops)


def wire(ops: Sequence[dict]) -> list[dict]:
    """The operations as etcd takes them (the sizes and names kept for cutting dropped)."""
    return [{k: v for k, v in op.items() if k not in ("nbytes", "name")} for op in ops]


def txn_chunks(ops: Sequence[dict], *, max_ops: int = TXN_OPS, max_bytes: int = TXN_BYTES) -> list[list[dict]]:
    """``ops`` in order, cut into runs of at most ``max_ops`` operations and ``max_bytes`` bytes each. An
    operation over ``max_bytes`` by itself raises :class:`NodeError` naming its key (etcd would refuse it)."""
    chunks: list[list[dict]] = []
    run: list[dict] = []
    size = 0
    for op in ops:
        n = op["nbytes"]
        if n > max_bytes:
            raise NodeError(f"one etcd operation of {n} bytes is over the {max_bytes}-byte request budget (etcd "
                            "refuses requests over --max-request-bytes, 1.5 MiB by default)", key=op["name"][:200])
        if run and (len(run) >= max_ops or size + n > max_bytes):
            chunks.append(run)
            run, size = [], 0
        run.append(op)
        size += n
    if run:
        chunks.append(run)
    return chunks


__all__ = ["OP_BYTES", "TXN_BYTES", "TXN_OPS", "op_bytes", "put_op", "range_op", "txn_chunks", "wire"]
