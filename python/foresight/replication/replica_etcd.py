"""The replica manager's etcd and authentication helpers: keys under the cluster prefix, leases, puts (many in
one transaction; a key created together with others), what planning a hint reads (one round trip), the copies of a
checkpoint on live nodes, the nodes' advertised loads, copy tasks, and the check of a job's token against the one its
first call bound (kept in etcd, salted and hashed).

:class:`ReplicaEtcd` is a base class of :class:`~foresight.replication.replica_manager.ReplicaManager`; the
state lives on the manager (``cluster``, ``lease_ttl``, ``_bindings``).

Example::

    manager.copies("run-7/step-100")       # {file: {node: {node, location, size, xxh3, base}}}
    manager._tasks(manager.node_id)         # [(key, task)] of copies this node is to make
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence
from typing import Any

import pyarrow.flight as flight

from foresight.cluster.membership import TXN_OPS
from foresight.errors import NodeError
from foresight.replication.replica_requests import ckpt_key


def live_copies(base: str, ranges: list[list[tuple[str, Any]]], live: Any) -> dict[str, dict[str, dict]]:
    """``{file: {node: record}}`` from ranges of copy records under ``base`` (``{p}/replicas/{ckpt}/``), the nodes
    in ``live`` only."""
    out: dict[str, dict[str, dict]] = {}
    for key, rec in (kv for r in ranges for kv in r):
        f, _, node = key[len(base):].partition("/")
        if node in live:
            out.setdefault(f, {})[node] = rec
    return out


class ReplicaEtcd:
    """See the module docstring."""

    # -- etcd helpers ----------------------------------------------------------------------------------------
    def _k(self, *parts: str) -> str:
        return self.cluster.key(*parts)

    def _new_lease(self):
        return self.cluster._call(lambda c: c.lease(ttl=self.lease_ttl))

    def _lease_of(self, lease_id: int):
        from etcd3gw.lease import Lease

        return Lease(int(lease_id), self.cluster._etcd)

    def _put(self, key: str, value: dict, lease: Any = None) -> None:
        body = json.dumps(value, default=str)
        self.cluster._call(lambda c: c.put(key, body, lease=lease))

    def _put_many(self, items: dict[str, str], lease: Any) -> None:
        """Many puts under one lease, ``TXN_OPS`` per etcd transaction (etcd's default limit is 128 operations)."""
        from etcd3gw.utils import _encode

        ops = [{"request_put": {"key": _encode(k), "value": _encode(v), "lease": lease.id}} for k, v in items.items()]
        for i in range(0, len(ops), TXN_OPS):
            txn = {"compare": [], "success": ops[i:i + TXN_OPS], "failure": []}
            self.cluster._call(lambda c: c.transaction(txn))

    def _get1(self, key: str) -> dict | None:
        vals = self.cluster._call(lambda c: c.get(key))
        return json.loads(vals[0]) if vals else None

    def _live_nodes(self) -> dict[str, dict]:
        return self.cluster.nodes()

    def copies(self, name: str, live: dict[str, dict] | None = None, *, file: str | None = None,
               files: Sequence[str] | None = None) -> dict[str, dict[str, dict]]:
        """``{file: {node: record}}`` of a checkpoint's copies on live nodes: of one ``file``, of ``files`` (a range
        each, one round trip), or of every file."""
        live = self._live_nodes() if live is None else live
        files = [file] if file else files
        if files is not None and not files:
            return {}
        base = self._k("replicas", ckpt_key(name)) + "/"
        ranges, _ = self.cluster.get_many([base + f"{f}/" for f in files] if files else [base])
        return live_copies(base, ranges, live)


    def _loads(self, live: dict[str, dict], advertised: list[tuple[str, Any]] | None = None) -> dict[str, float]:
        """In-flight reads each live node advertises (``advertised``: the ``.load`` range, if already read)."""
        base = self._k("replicas", ".load") + "/"
        kvs = self.cluster._get_prefix(base) if advertised is None else advertised
        adv = {k[len(base):]: v for k, v in kvs}
        return {n: float(adv.get(n, {}).get("inflight", 0)) for n in live}

    def _hint_reads(self, job: str, name: str, files: list[str]) -> dict[str, Any]:
        """Everything planning a hint reads, in one etcd round trip (the plan is on the restart's clock): the live
        hint (``hint``, or None), the live nodes, the hinted files' copies on them, the nodes' advertised loads,
        every copy task (``tasks``: the job's usage) and the cluster's placement mean (``placement``)."""
        nodes, base = self._k("nodes") + "/", self._k("replicas", ckpt_key(name)) + "/"
        (listed, advertised, tasks, *ranges), (hint, placement) = self.cluster.get_many(
            [nodes, self._k("replicas", ".load") + "/", self._k("replicas", ".tasks") + "/",
             *(base + f"{f}/" for f in files)],
            [self._k("hints", job, "ckpt", ckpt_key(name)), self._k("replicas", ".placement")])
        live = {k[len(nodes):]: v for k, v in listed}
        return {"hint": hint, "live": live, "copies": live_copies(base, ranges, live),
                "loads": self._loads(live, advertised),
                "tasks": tasks, "placement": placement}

    def _create_with(self, key: str, value: dict, lease: Any, extra: dict[str, dict]) -> bool:
        """Create ``key`` (only if absent) and put ``extra`` with it, all under ``lease``, in one transaction (more
        than one when ``extra`` is long: the rest follow once the key is created). False: the key existed."""
        from etcd3gw.utils import _encode

        def put(k: str, v: dict) -> dict:
            return {"request_put": {"key": _encode(k), "value": _encode(json.dumps(v, default=str)),
                                    "lease": lease.id}}

        items = list(extra.items())
        head, rest = items[:TXN_OPS - 1], dict(items[TXN_OPS - 1:])
        txn = {"compare": [{"key": _encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
               "success": [put(key, value), *(put(k, v) for k, v in head)], "failure": []}
        if not self.cluster._call(lambda c: c.transaction(txn)).get("succeeded", False):
            return False
        if rest:
            self._put_many({k: json.dumps(v, default=str) for k, v in rest.items()}, lease)
        return True

    def _tasks(self, node: str | None = None) -> list[tuple[str, dict]]:
        base = self._k("replicas", ".tasks") + "/" + (f"{node}/" if node else "")
        return self.cluster._get_prefix(base)

    # -- authentication ------------------------------------------------------------------------------------
    def _authorize(self, context: Any, job: str) -> None:
        """The call carries ``job``'s header and the token the job's first call bound (in etcd, hashed)."""
        mw = context.get_middleware("auth") if context is not None else None
        token = None if mw is None else mw.token
        if mw is None or mw.job != job or not token or len(token) < 8:
            raise flight.FlightUnauthenticatedError("foresight: replica calls need the job header and a token of "
                                                    "at least 8 characters")
        binding = self._bindings.get(job)
        if binding is None:
            key = self._k("hints", job, "token")
            salt = secrets.token_hex(8)
            mine = {"salt": salt, "sha256": hashlib.sha256((salt + token).encode()).hexdigest()}
            self.cluster._call(lambda c: c.create(key, json.dumps(mine)))  # first caller binds; others read it
            binding = self._get1(key)
            if binding is None:
                raise NodeError("job token binding vanished from etcd", job=job)
            self._bindings[job] = binding
        digest = hashlib.sha256((binding["salt"] + token).encode()).hexdigest()
        if not hmac.compare_digest(digest, binding["sha256"]):
            raise flight.FlightUnauthenticatedError(f"foresight: bad token for job {job!r}")


__all__ = ["ReplicaEtcd", "live_copies"]
