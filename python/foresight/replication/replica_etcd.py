"""The replica manager's etcd and authentication helpers: keys under the cluster prefix, leases, puts (many in
one transaction), the copies of a checkpoint on live nodes, the nodes' advertised loads, copy tasks, and the
check of a job's token against the one its first call bound (kept in etcd, salted and hashed).

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
from typing import Any

import pyarrow.flight as flight

from foresight.errors import NodeError
from foresight.replication.replica_requests import ckpt_key


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
        """Many puts under one lease, 100 per etcd transaction (etcd's default limit is 128 operations)."""
        from etcd3gw.utils import _encode

        ops = [{"request_put": {"key": _encode(k), "value": _encode(v), "lease": lease.id}} for k, v in items.items()]
        for i in range(0, len(ops), 100):
            txn = {"compare": [], "success": ops[i:i + 100], "failure": []}
            self.cluster._call(lambda c: c.transaction(txn))

    def _get1(self, key: str) -> dict | None:
        vals = self.cluster._call(lambda c: c.get(key))
        return json.loads(vals[0]) if vals else None

    def _live_nodes(self) -> dict[str, dict]:
        return self.cluster.nodes()

    def copies(self, name: str, live: dict[str, dict] | None = None, *,
               file: str | None = None) -> dict[str, dict[str, dict]]:
        """``{file: {node: record}}`` of a checkpoint's copies (of one ``file`` if given) on live nodes."""
        live = self._live_nodes() if live is None else live
        base = self._k("replicas", ckpt_key(name)) + "/"
        out: dict[str, dict[str, dict]] = {}
        for key, rec in self.cluster._get_prefix(base + (f"{file}/" if file else "")):
            file, _, node = key[len(base):].partition("/")
            if node in live:
                out.setdefault(file, {})[node] = rec
        return out

    def _loads(self, live: dict[str, dict]) -> dict[str, float]:
        base = self._k("replicas", ".load") + "/"
        adv = {k[len(base):]: v for k, v in self.cluster._get_prefix(base)}
        return {n: float(adv.get(n, {}).get("inflight", 0)) for n in live}

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


__all__ = ["ReplicaEtcd"]
