"""The replica manager's etcd and authentication helpers: keys under the cluster prefix, leases, puts (many in as
few transactions as etcd's limits allow; a key created together with others, all or nothing as its readers see
it), a hint stored as a head record and its files list in parts (``<hint>/files/<lease>/<i>``), what planning a
hint reads (one round trip), the copies of a
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
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import pyarrow.flight as flight

from foresight.cluster.etcd_txn import put_op, txn_chunks
from foresight.errors import NodeError
from foresight.replication.replica_requests import ckpt_key

log = logging.getLogger("foresight.replication.replica_manager")  # the manager's one logger
HINT_PART_BYTES = 256 << 10  # a hint's files list is stored in parts of at most this much JSON
WRITING_TTL_S = 30  # a key being written in parts is claimed this long (renewed while written; see _create_with)


def hint_parts(files: list[dict]) -> list[list[dict]]:
    """``files`` cut into runs of at most ``HINT_PART_BYTES`` of JSON each (at least one run, maybe empty)."""
    parts: list[list[dict]] = [[]]
    size = 0
    for f in files:
        n = len(json.dumps(f, default=str)) + 2
        if parts[-1] and size + n > HINT_PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(f)
        size += n
    return parts


def hint_from(head: dict | None, listed: list[tuple[str, Any]], parts_prefix: str, *, key: str) -> dict | None:
    """The hint from its head record and the keys read under ``parts_prefix`` (the same read: one revision):
    None when there is none or it is still being written (a marker); its ``files`` joined from its parts."""
    if head is None or head.get("writing"):
        return None
    if "file_parts" not in head:  # written whole by a node before hints were stored in parts
        return head
    mine = f"{parts_prefix}{int(head['lease']):x}/"
    parts = sorted((k, v) for k, v in listed if k.startswith(mine))
    if len(parts) != head.get("file_parts", 0):
        raise NodeError("a hint's files list is incomplete in etcd", key=key, parts=len(parts),
                        expected=head.get("file_parts"))
    return dict(head, files=[f for _, part in parts for f in part])


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
        """Many puts under one lease, in as few transactions as etcd's limits allow (``Cluster.put_many``)."""
        self.cluster.put_many(items, lease.id)

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

    def _create_with(self, key: str, value: dict, lease: Any, extra: dict[str, Any]) -> bool:
        """Create ``key`` (only if absent) with the keys of ``extra``, all under ``lease``: all or nothing as a
        reader of ``key`` sees it. False: the key existed (nothing written).

        One transaction when everything fits etcd's limits (``etcd_txn.txn_chunks``). Otherwise the key is first
        claimed with a marker (``{"writing": true, "lease"}``, which readers take for no value: see
        :func:`hint_from`) under a short claim lease (``WRITING_TTL_S``); the extras follow, each transaction
        only while the marker is still this writer's, and the last one replaces the marker with ``value``. On
        any failure both leases are revoked (what was written goes with them; if etcd is away, the claim expires
        within ``WRITING_TTL_S`` and a retry succeeds) and the error is raised."""
        from etcd3gw.utils import _encode

        ops = [put_op(k, json.dumps(v, default=str), lease.id) for k, v in extra.items()]
        chunks = txn_chunks([*ops, put_op(key, json.dumps(value, default=str), lease.id)])  # the key last
        absent = [{"key": _encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
        if len(chunks) == 1:
            return bool(self.cluster.txn(chunks[0], absent).get("succeeded"))
        claim = self.cluster._call(lambda c: c.lease(ttl=WRITING_TTL_S))
        marker = {"writing": True, "lease": lease.id, "coordinator": getattr(self, "node_id", None)}
        try:
            got = self.cluster.txn([put_op(key, json.dumps(marker), claim.id)], absent)
            if not got.get("succeeded"):
                self._revoke(claim)
                return False
            mine = [{"key": _encode(key), "result": "EQUAL", "target": "MOD",
                     "mod_revision": int(got["header"]["revision"])}]
            renewed = time.monotonic()
            for i, chunk in enumerate(chunks):
                if time.monotonic() - renewed > WRITING_TTL_S / 3:
                    self.cluster._call(lambda c: claim.refresh())
                    renewed = time.monotonic()
                if not self.cluster.txn(chunk, mine).get("succeeded"):
                    raise NodeError("a key being written in parts lost its claim (released, or the claim expired)",
                                    key=key, written=f"{i} of {len(chunks)} transactions")
        except BaseException:
            self._revoke(lease, claim)
            raise
        return True  # the claim lease holds no key now; it expires by itself (no round trip on the restart's clock)

    def _revoke(self, *leases: Any) -> None:
        """Revoke ``leases`` (their keys go at once); one etcd cannot revoke expires by its TTL (logged)."""
        for lease in leases:
            try:
                lease.revoke()
            except Exception as e:  # etcd away: the lease's TTL ends it
                log.warning("could not revoke a lease; its keys go when its TTL ends",
                            extra={"lease": getattr(lease, "id", None), "error": str(e)[:200]})

    # -- a hint: a head record and its files list in parts ---------------------------------------------------
    def _hint_key(self, job: str, name: str) -> str:
        return self._k("hints", job, "ckpt", ckpt_key(name))

    def _create_hint(self, job: str, name: str, record: dict, lease: Any, tasks: dict[str, dict]) -> bool:
        """Write hint ``record`` and its copy ``tasks`` under ``lease``, all or nothing (:meth:`_create_with`).
        The record's ``files`` list goes in parts of at most ``HINT_PART_BYTES`` (thousands of per-rank shards are
        over etcd's request limit in one value): ``<hint>/files/<lease>/<i>``; the head names how many."""
        key = self._hint_key(job, name)
        parts = hint_parts(record["files"])
        head = {k: v for k, v in record.items() if k != "files"}
        head["file_parts"] = len(parts)
        extra: dict[str, Any] = {f"{key}/files/{lease.id:x}/{i:06d}": part for i, part in enumerate(parts)}
        extra.update(tasks)
        return self._create_with(key, head, lease, extra)

    def _hint_ranges(self, job: str, name: str) -> tuple[str, str]:
        """What :func:`hint_from` reads: the head's key and its parts' prefix (read them in one ``get_many``)."""
        key = self._hint_key(job, name)
        return key, key + "/files/"

    def _read_hint(self, job: str, name: str) -> dict | None:
        """The live hint of ``job`` for checkpoint ``name``, whole, or None (none, or one still being written)."""
        key, parts = self._hint_ranges(job, name)
        (listed,), (head,) = self.cluster.get_many([parts], [key])
        return hint_from(head, listed, parts, key=key)

    def _tasks(self, node: str | None = None) -> list[tuple[str, dict]]:
        base = self._k("replicas", ".tasks") + "/" + (f"{node}/" if node else "")
        return self.cluster._get_prefix(base)

    # -- authentication ------------------------------------------------------------------------------------
    def _authorize(self, context: Any, job: str, *, bind: bool = True) -> None:
        """The call carries ``job``'s header and the token the job's first call bound (in etcd, hashed); ``bind``
        False: a job with no binding yet is refused instead of bound by this call."""
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
            if bind:
                self.cluster._call(lambda c: c.create(key, json.dumps(mine)))  # first caller binds; others read it
            binding = self._get1(key)
            if binding is None and not bind:
                raise flight.FlightUnauthenticatedError(f"foresight: no token is bound for job {job!r}")
            if binding is None:
                raise NodeError("job token binding vanished from etcd", job=job)
            self._bindings[job] = binding
        digest = hashlib.sha256((binding["salt"] + token).encode()).hexdigest()
        if not hmac.compare_digest(digest, binding["sha256"]):
            raise flight.FlightUnauthenticatedError(f"foresight: bad token for job {job!r}")


__all__ = ["HINT_PART_BYTES", "ReplicaEtcd", "WRITING_TTL_S", "hint_from", "hint_parts", "live_copies"]
