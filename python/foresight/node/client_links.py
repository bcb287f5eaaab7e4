"""NodeSource's links to the storage nodes: finding them (etcd or a static list), registering the job (uploading
the plan a node lacks), backing off from a node that failed, fetching one step's part, and unregistering.

:class:`NodeLinks` is a base class of :class:`~foresight.node.client.NodeSource`; one :class:`NodeLink` per node.

Example::

    source._refresh(force=True)     # look for nodes now
    nodes = source._usable()        # registered and not backing off
    kind, table = source._fetch(nodes[0], step)
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow.flight as flight

from foresight.cluster.auth import call_options, connect
from foresight.errors import NodeError
from foresight.node.plans import upload_plan
from foresight.node.protocol import encode_ticket

log = logging.getLogger("foresight.node.client")  # the source's one logger: its warnings read as the client's


@dataclass
class NodeLink:
    """One storage node as the client sees it: where it is, its registration, and its backoff."""

    node_id: str
    location: str
    record: dict
    client: Any = None
    registered: dict | None = None  # the node's register_job answer (served shards, instance)
    down_until: float = 0.0
    failures: int = 0
    served: list = field(default_factory=list)  # per dataset: set of shards or None (all)


class NodeLinks:
    """The node-facing half of :class:`~foresight.node.client.NodeSource` (a base class of it; the state lives on
    the source: ``cluster``, ``_static``, ``_nodes``, ``plan``, ``stage``, ``token``, ``node_job``, rank, timeouts,
    ``stats``)."""

    def _job_record(self) -> dict:
        return {"plan_digest": self.plan.digest, "step": self._step, "nodes": sorted(self._nodes)}

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < self.refresh_s:
            return
        self._refreshed = now
        if self.cluster is not None:
            try:
                records = self.cluster.nodes()
            except NodeError as e:  # etcd away: keep the nodes we know
                log.warning("cannot list nodes", extra={"error": str(e)})
                return
        else:
            records = {}
            for loc in self._static:
                known = next((n for n in self._nodes.values() if n.location == loc), None)
                if known is not None and (known.registered is not None or known.down_until > now):
                    records[known.node_id] = known.record
                    continue
                try:
                    rec = self._health(loc)
                    records[rec["node"]] = rec
                except Exception as e:
                    if known is not None:
                        records[known.node_id] = known.record
                        self._mark_down(known, e)
        for node_id, rec in records.items():
            if not isinstance(rec, dict) or not isinstance(rec.get("location"), str):
                continue  # not a record this client can use
            n = self._nodes.get(node_id)
            if n is not None and (n.location != rec["location"] or n.record.get("instance") != rec.get("instance")):
                if n.client is not None:  # moved or restarted: it forgot the job
                    n.client.close()
                n = None
            if n is None:
                self._nodes[node_id] = NodeLink(node_id, rec["location"], rec)
        if self.cluster is not None:
            for node_id in [i for i in self._nodes if i not in records]:  # its lease expired: gone
                gone = self._nodes.pop(node_id)
                if gone.client is not None:
                    gone.client.close()

    def _health(self, location: str) -> dict:
        client = connect(location, tls_root=self.tls_root, cert=self.cert)
        try:
            out = list(client.do_action(flight.Action("health", b"{}"), call_options(None, None, timeout=self.timeout)))
        finally:
            client.close()
        return json.loads(out[0].body.to_pybytes())

    def _register(self, n: NodeLink) -> None:
        names = {}
        for ds_name, info in n.record.get("datasets", {}).items():
            names.setdefault(info.get("fingerprint"), ds_name)
        plan_name = n.record.get("plans", {}).get(self.plan.digest)
        missing = [fp for fp in self._fingerprints if fp not in names]
        if missing:
            raise NodeError("node does not hold this job's datasets", node=n.node_id, datasets_missing=len(missing))
        if n.client is None:
            n.client = connect(n.location, tls_root=self.tls_root, cert=self.cert)
        if plan_name is None:  # upload it once; the node keeps it by digest
            if not getattr(self.plan, "path", None):
                raise NodeError("node lacks the plan and the plan has no directory to upload", node=n.node_id)
            upload_plan(n.client, self.plan.path, self.plan.digest, self._options(self.register_timeout))
            self.stats["plans_uploaded"] += 1
            plan_name = self._health(n.location)["plans"][self.plan.digest]
        req = {"job": self.node_job, "datasets": [names[fp] for fp in self._fingerprints], "plan": plan_name,
               "plan_digest": self.plan.digest, "rank": self.rank, "world_size": self.world_size,
               "specs": self._spec_dicts, "seed": self.stage.seed, "step": self._step, "lead": self.lead,
               "queue_bytes": self.queue_bytes, "spec_digest": self._spec_digest}
        if self.guard_reply != "raw":  # sent only when asked, so the default talks to any node of this protocol
            req["guard_reply"] = self.guard_reply
        out = list(n.client.do_action(flight.Action("register_job", json.dumps(req).encode()),
                                      self._options(self.register_timeout)))
        n.registered = json.loads(out[0].body.to_pybytes())
        n.served = [None if s is None else set(s) for s in n.registered["served_shards"]]

    def _options(self, timeout: float | None = None) -> flight.FlightCallOptions:
        return call_options(self.node_job, self.token, timeout=timeout or self.timeout)

    def _mark_down(self, n: NodeLink, error: BaseException) -> None:
        n.failures += 1
        n.down_until = time.monotonic() + min(30.0, self.retry_s * 2 ** (n.failures - 1))
        n.registered = None
        if n.client is not None:
            try:
                n.client.close()
            except Exception:
                pass
            n.client = None
        log.warning("node unavailable; decoding its part locally",
                    extra={"node": n.node_id, "failures": n.failures, "error": str(error)[:300]})

    def _usable(self) -> list[NodeLink]:
        now = time.monotonic()
        out = []
        for n in sorted(self._nodes.values(), key=lambda n: n.node_id):
            if n.down_until > now:
                continue
            if n.registered is None:
                try:
                    self._register(n)
                except flight.FlightUnauthenticatedError:
                    raise  # a wrong token is the caller's error, not a node failure
                except Exception as e:
                    self._mark_down(n, e)
                    continue
            out.append(n)
        return out

    def _fetch(self, node: NodeLink, step: int) -> tuple[str, Any]:
        ticket = flight.Ticket(encode_ticket(self.node_job, rank=self.rank, step=step))
        try:
            reader = node.client.do_get(ticket, self._options())
            table = reader.read_all()
        except flight.FlightServerError as e:
            if "unknown job" not in str(e):
                raise
            self.stats["reregistered"] += 1  # the node restarted and forgot us: register again, once
            self._register(node)
            table = node.client.do_get(ticket, self._options()).read_all()
        kind = (table.schema.metadata or {}).get(b"kind", b"").decode()
        self.stats["bytes_received"] += table.nbytes
        return kind, table

    def _unregister_nodes(self) -> None:
        """Unregister this job from every node it registered with (best effort: a node that does not answer
        drops the job when it has been idle for its ``--job-idle-s``)."""
        for n in list(self._nodes.values()):
            if n.client is not None and n.registered is not None:
                try:
                    list(n.client.do_action(flight.Action("unregister_job",
                                                          json.dumps({"job": self.node_job}).encode()),
                                            call_options(self.node_job, self.token, timeout=5)))
                except Exception as e:
                    log.info("unregister failed; the node drops the job when idle",
                             extra={"node": n.node_id, "error": str(e)[:200]})
            n.registered = None


__all__ = ["NodeLink", "NodeLinks"]
