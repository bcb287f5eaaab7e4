"""The cluster's shared state in etcd: nodes under leases, shard placement, jobs.

Client library: ``etcd3gw`` (pinned 2.4.2 in scripts/setup.sh), maintained by OpenStack. It talks to etcd's
gRPC-JSON gateway over plain HTTP with ``requests`` and discovers the gateway path from ``/version``: against
Debian's etcd 3.4.23 it picks ``/v3/`` (3.4 also serves ``/v3beta/``; ``/v3alpha/`` is gone), checked here with
leases, puts under a lease, TTL expiry and prefix reads. The alternative, ``etcd3`` (python-etcd3, native gRPC),
has had no release since 2020 and needs grpcio and an old protobuf beside pyarrow's own gRPC; a gateway client
adds only ``requests``. Leases, puts with a lease, prefix reads and deletes are all the cluster needs.

Key layout (``prefix`` defaults to ``/foresight/v1``; values are JSON):

``{prefix}/nodes/{node_id}``                 under the node's lease (TTL ``ttl``, refreshed every ttl/3; a dead node
                                             drops out within ``ttl``): ``{node, instance, location, datasets:
                                             {name: {fingerprint, shards}}, plans: {digest: name}, load: {cpu_percent,
                                             guard, jobs}, metrics, updated}``
``{prefix}/placement/{fingerprint}/{shard:06d}``  node id serving that shard (no lease: written by ``foresight node
                                             place``); a dataset with no placement keys is served whole by every node
                                             that advertises it
``{prefix}/jobs/{job}/{rank:06d}``           under the client's lease: ``{plan_digest, step, nodes, updated}``
``{prefix}/tokens/{job}``                   no lease, written by the operator (``foresight node job-token``):
                                             ``{sha256, issued}``, the digest of the job's token; nodes admit a
                                             registration of the job only with that token (see cluster/auth.py)
``{prefix}/replicas/...``, ``{prefix}/hints/...``  reserved for checkpoint replication and replication hints (same
                                             rules: liveness through leases, one JSON value per key)

Example::

    cluster = Cluster("http://127.0.0.1:2379")
    reg = cluster.register_node("n1", lambda: {"location": "grpc://10.0.0.5:7000", ...}, ttl=10)
    cluster.place(fingerprint, num_shards=8, nodes=["n1", "n2"])     # round-robin
    cluster.nodes()                                                  # {"n1": {...}, "n2": {...}}
    reg.close()                                                      # revokes the lease: n1 drops at once
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable
from urllib.parse import urlparse

from foresight.cluster.auth import token_digest
from foresight.cluster.etcd_txn import put_op, range_op, txn_chunks, wire
from foresight.errors import NodeError

log = logging.getLogger("foresight.cluster.membership")
DEFAULT_PREFIX = "/foresight/v1"


def _parsed(items: Any) -> list[tuple[str, Any]]:
    """``(key, raw value)`` pairs -> ``(key as str, JSON value)``; malformed values are skipped, logged."""
    out = []
    for key, value in items:
        key = key.decode() if isinstance(key, bytes) else key
        try:
            out.append((key, json.loads(value)))
        except ValueError:
            log.warning("ignoring a malformed value in etcd", extra={"key": key})
    return out


def _client(endpoint: str, timeout: float):
    import etcd3gw

    u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return etcd3gw.client(host=u.hostname or "127.0.0.1", port=u.port or 2379, protocol=u.scheme or "http",
                          timeout=timeout)


def _lease(lease_id: int, client):
    """etcd3gw's handle on lease ``lease_id`` through ``client`` (the one answering now, not the one that granted
    it: after a failover to another endpoint the old client is gone)."""
    from etcd3gw.lease import Lease as _Lease

    return _Lease(lease_id, client)


class Cluster:
    """etcd-backed cluster state; see the module docstring. ``endpoints``: one URL or a comma-separated list
    (the first that answers is used; on a connection error the next is tried)."""

    def __init__(self, endpoints: str | list[str], *, prefix: str = DEFAULT_PREFIX, timeout: float = 5.0) -> None:
        listed = endpoints.split(",") if isinstance(endpoints, str) else endpoints
        self.endpoints = [e.strip() for e in listed if e.strip()]
        if not self.endpoints:
            raise NodeError("no etcd endpoint given")
        self.prefix = prefix.rstrip("/")
        self.timeout = timeout
        self._i = 0
        self._etcd = _client(self.endpoints[0], timeout)
        self.calls = 0  # etcd requests made (round trips: what a batched read saves)

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``, on the next endpoint when one is unreachable. A request etcd answered with a refusal
        (too large, too many operations, an unknown lease: HTTP 4xx) raises at once with etcd's reason: another
        endpoint would refuse it too."""
        from etcd3gw.exceptions import Etcd3Exception

        self.calls += 1
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            try:
                return fn(self._etcd)
            except Exception as e:  # requests' connection errors, etcd3gw's ConnectionFailedError, ...
                if type(e) is Etcd3Exception:  # etcd3gw raises the base class for a 4xx answer
                    raise NodeError(f"etcd refused the request: {str(e.detail_text)[:300]}",
                                    endpoint=self.endpoints[self._i]) from None
                last = e
                self._i = (self._i + 1) % len(self.endpoints)
                self._etcd = _client(self.endpoints[self._i], self.timeout)
        raise NodeError(f"etcd unreachable: {last}", endpoints=",".join(self.endpoints))

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def txn(self, ops: list[dict], compare: list[dict] | None = None) -> dict:
        """One etcd transaction of ``ops`` (from :mod:`~foresight.cluster.etcd_txn`: ``put_op``, ``range_op``;
        within its limits, see ``txn_chunks``) if every ``compare`` holds. Returns etcd's answer (``succeeded``,
        ``responses``, ``header.revision``)."""
        body = {"compare": compare or [], "success": wire(ops), "failure": []}
        return self._call(lambda c: c.transaction(body))

    def put_many(self, items: dict[str, str], lease_id: int | None = None) -> int:
        """Put every ``key: value`` of ``items`` (values already strings), under lease ``lease_id`` if given, in as
        few transactions as etcd's limits allow (not atomic across them). Returns the transactions sent.

        Example::

            cluster.put_many({cluster.key("replicas", ckpt, f, node): json.dumps(rec) for f, rec in recs.items()},
                             lease.id)
        """
        chunks = txn_chunks([put_op(k, v, lease_id) for k, v in items.items()])
        for chunk in chunks:
            self.txn(chunk)
        return len(chunks)

    def _get_prefix(self, prefix: str) -> list[tuple[str, Any]]:
        items = self._call(lambda c: c.get_prefix(prefix))
        return _parsed((meta["key"], value) for value, meta in items)

    def get_many(self, prefixes: Sequence[str] = (), keys: Sequence[str] = ()
                 ) -> tuple[list[list[tuple[str, Any]]], list[Any]]:
        """Several prefix reads and single-key reads in one etcd round trip (a read-only transaction: one
        revision for all), or in several when they are over etcd's limits (``TXN_OPS`` reads each; each
        transaction has its own revision). Returns ``([[(key, value)] per prefix], [value or None per key])``, values decoded
        from JSON as :meth:`_get_prefix` does.

        Example::

            (nodes, tasks), (hint,) = cluster.get_many([cluster.key("nodes") + "/", tasks_prefix], [hint_key])
        """
        from etcd3gw.utils import _decode

        ops = [range_op(p, prefix=True) for p in prefixes] + [range_op(k) for k in keys]
        answers: list[list[tuple[str, Any]]] = []
        for chunk in txn_chunks(ops):  # one round trip unless the reads are over etcd's limits
            for r in self.txn(chunk).get("responses", []):
                kvs = r.get("response_range", {}).get("kvs", [])
                answers.append(_parsed((_decode(kv["key"]), _decode(kv.get("value", ""))) for kv in kvs))
        if len(answers) != len(ops):
            raise NodeError("etcd answered a batched read with the wrong number of ranges", asked=len(ops),
                            got=len(answers))
        n = len(prefixes)
        return answers[:n], [a[0][1] if a else None for a in answers[n:]]

    # -- nodes ---------------------------------------------------------------------------------------------
    def nodes(self) -> dict[str, dict]:
        """Live nodes (their lease has not expired): ``{node_id: record}``."""
        base = self.key("nodes") + "/"
        return {k[len(base):]: v for k, v in self._get_prefix(base)}

    def register_node(self, node_id: str, record: Callable[[], dict], *, ttl: int = 10) -> "Registration":
        """Put ``record()`` under a lease and keep it fresh (every ttl/3) until ``close()``."""
        return Registration(self, self.key("nodes", node_id), record, ttl=ttl)

    # -- placement -----------------------------------------------------------------------------------------
    def placement(self, fingerprint: str) -> dict[int, str]:
        base = self.key("placement", fingerprint) + "/"
        return {int(k[len(base):]): v for k, v in self._get_prefix(base)}

    def place(self, fingerprint: str, *, num_shards: int, nodes: list[str]) -> dict[int, str]:
        """Assign shards round-robin to ``nodes`` and record it (replacing any earlier placement)."""
        if not nodes:
            raise NodeError("no nodes to place shards on", dataset=fingerprint)
        assignment = {s: nodes[s % len(nodes)] for s in range(num_shards)}
        self._call(lambda c: c.delete_prefix(self.key("placement", fingerprint) + "/"))
        self.put_many({self.key("placement", fingerprint, f"{s:06d}"): json.dumps(n) for s, n in assignment.items()})
        return assignment

    def served_shards(self, node_id: str, fingerprint: str) -> list[int] | None:
        """The shards of a dataset this node serves, or None when the dataset has no placement (all)."""
        placement = self.placement(fingerprint)
        if not placement:
            return None
        return sorted(s for s, n in placement.items() if n == node_id)

    # -- jobs ----------------------------------------------------------------------------------------------
    def register_job(self, job: str, rank: int, record: Callable[[], dict], *, ttl: int = 30) -> "Registration":
        return Registration(self, self.key("jobs", job, f"{rank:06d}"), record, ttl=ttl)

    def jobs(self) -> dict[str, dict]:
        base = self.key("jobs") + "/"
        return {k[len(base):]: v for k, v in self._get_prefix(base)}

    def issue_job_token(self, job: str, token: str | None = None) -> str:
        """Issue ``job``'s token, or rotate it (the earlier one stops admitting registrations at once); etcd keeps
        its sha256 only. Returns the token (a fresh random one unless given)."""
        if not job or "/" in job or len(job) > 128:
            raise NodeError("a job name is 1-128 characters without '/'", job=job[:130])
        if token is None:
            token = secrets.token_urlsafe(24)
        elif len(token) < 8:
            raise NodeError("a job token has at least 8 characters", job=job)
        record = json.dumps({"sha256": token_digest(token), "issued": time.time()})
        self._call(lambda c: c.put(self.key("tokens", job), record))
        return token

    def job_token_digest(self, job: str) -> str | None:
        """The sha256 of ``job``'s issued token, or None when none was issued."""
        values = self._call(lambda c: c.get(self.key("tokens", job)))
        if not values:
            return None
        try:
            return json.loads(values[0]).get("sha256")
        except (ValueError, AttributeError):
            log.warning("ignoring a malformed token record in etcd", extra={"job": job})
            return None


class Registration:
    """A key kept alive under a lease by a daemon thread; the record is re-read on every refresh (load changes).

    etcd may go away for any length of time (restart with its data, or a fresh member with none): every ttl/3 the
    thread refreshes the lease, and when that fails or etcd no longer knows the lease, it grants a new one and
    writes the record again, until it succeeds. One warning when the outage starts, one info line when the key is
    back (``outages`` counts them)."""

    def __init__(self, cluster: Cluster, key: str, record: Callable[[], dict], *, ttl: int) -> None:
        self.cluster, self.key, self.record, self.ttl = cluster, key, record, max(2, int(ttl))
        self._stop = threading.Event()
        self._lease_id: int | None = None
        self.outages = 0
        self._failing = False
        self._put()
        self._thread = threading.Thread(target=self._run, name="foresight-etcd-lease", daemon=True)
        self._thread.start()

    def _put(self) -> None:
        value = json.dumps(dict(self.record(), updated=time.time()), default=str)
        if self._lease_id is None:
            self._lease_id = self.cluster._call(lambda c: c.lease(ttl=self.ttl)).id
        lease_id = self._lease_id
        self.cluster._call(lambda c: c.put(self.key, value, lease=_lease(lease_id, c)))

    def _refresh(self) -> None:
        """Keep the lease alive and the record current; a lease etcd lost (expired, or a fresh etcd) is replaced."""
        if self._lease_id is not None:
            lease_id = self._lease_id
            if self.cluster._call(lambda c: _lease(lease_id, c).refresh()) <= 0:
                self._lease_id = None
        self._put()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._refresh()
            except Exception as e:  # etcd away (NodeError) or answering garbage: grant a new lease next time
                self._lease_id = None
                if not self._failing:
                    self._failing = True
                    self.outages += 1
                    log.warning("etcd refresh failed; retrying every ttl/3 with a new lease",
                                extra={"key": self.key, "error": str(e)[:300]})
                continue
            if self._failing:
                self._failing = False
                log.info("etcd back; lease granted again and the key re-written", extra={"key": self.key})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        lease_id = self._lease_id
        if lease_id is not None:
            try:
                self.cluster._call(lambda c: _lease(lease_id, c).revoke())
            except Exception as e:
                log.warning("lease revoke failed (the key expires with its TTL)", extra={"key": self.key,
                                                                                         "error": str(e)})


__all__ = ["Cluster", "DEFAULT_PREFIX", "Registration"]
