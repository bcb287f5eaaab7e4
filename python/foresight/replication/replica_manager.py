"""The replica manager: replication hints, node-to-node copies before a restart, spread reads, TTL reclaim.

Mounted on a :class:`~foresight.node.server.NodeServer` that is part of a cluster (``foresight node serve --etcd``).
A job publishes the checkpoint files a node holds (``replicas.publish``: the base copies), declares before a
restart which files its ranks will read and how many at once (``set_replication_hints``, see
:mod:`foresight.replication.hint_client`), and the node that receives the hint plans the extra copies
(:func:`~foresight.replication.replica_plan.plan_replicas`: its reads in one etcd round trip) and writes the hint
and one *task* per copy in one etcd transaction; each task names the file's holders, least loaded first. Each
target node picks up its tasks (at once: the planning node wakes it with ``replicas.wake``, carrying the hint's job
token, which the target checks against the job's binding; else within
``poll_s``), pulls the file from a holder the task names over Flight (``DoGet ckpt.get`` with the task's grant),
writes it under a temp name, checks its xxh3 against the base copy's, renames it into place, then registers it
under the hint's lease and marks the task done in one write. Ranks read through
:class:`~foresight.replication.hint_client.ReplicaReader`, which picks the least loaded live copy and verifies every
file it reads.

This module holds the actions (publish, hints, progress, release) and the node's round; its other parts:
:mod:`.replica_requests` (request checks), :mod:`.replica_etcd` (keys, leases, token binding),
:mod:`.replica_copies` (serving, pulling and reclaiming this node's copies).

etcd keys (``{p}`` = the cluster prefix, ``{ckpt}`` = the checkpoint name URL-quoted; values JSON):

``{p}/hints/{job}/token``                        ``{salt, sha256}``: the first call of a job binds its token
``{p}/hints/{job}/ckpt/{ckpt}``                  the live hint (its lease = the hint's TTL)
``{p}/replicas/{ckpt}/{file}/{node}``            a copy: ``{node, location, size, xxh3, base}``; base copies live
                                                 under the node's lease, hinted ones under the hint's lease
``{p}/replicas/.tasks/{node}/{ckpt}/{file}``     a copy to make: ``{state, grant, lease, sources, ...}`` (hint's
                                                 lease); ``pending`` until done or failed
``{p}/replicas/.load/{node}``                    ``{inflight, reads, bytes}`` (node's lease)
``{p}/replicas/.placement``                      ``{place_s, samples}``: recent placements' running mean (no lease)

Reclaim: when a hint's lease ends its keys vanish; each node's janitor then stops serving its copies and deletes
them, deferred while a read of the copy is in flight (reference counts). A wrong or stale hint therefore costs at
most its quota in bytes and copies for at most its TTL; readers verify every file and fall back to other copies.

Example::

    manager = ReplicaManager(server, cluster, limit=ServiceLimit.parse("64M:500"), quota_bytes=64 << 30)
    ...
    manager.close()
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

import pyarrow.flight as flight

from foresight.checksum import file_xxh3
from foresight.cluster.auth import call_options, connect
from foresight.cluster.requests import check_fields
from foresight.cluster.throttle import ServiceLimit
from foresight.errors import NodeError
from foresight.replication.hints import HintError, validate_hints
from foresight.replication.replica_copies import LocalCopy, ReplicaCopies
from foresight.replication.replica_etcd import ReplicaEtcd, hint_from
from foresight.replication.replica_plan import DEFAULT_BASE_REPLICAS, DEFAULT_SAFE_READERS, cold_lead_s, plan_replicas
from foresight.replication.replica_requests import (
    MAX_HINTS_BYTES,
    check_file,
    ckpt_key,
    decode_ckpt_request,
    decode_hints,
)

log = logging.getLogger("foresight.replication.replica_manager")


def _placement_steps(done: list[dict]) -> dict | None:
    """Where placement's time went, the slowest copy's per step: hint accepted -> task picked up by its target ->
    pulled from a holder -> registered (copies from before these timestamps are left out)."""
    done = [t for t in done if "picked_at" in t and "pulled_at" in t]
    if not done:
        return None
    return {"pickup": max(t["picked_at"] - t["created"] for t in done),
            "pull": max(t["pulled_at"] - t["picked_at"] for t in done),
            "register": max(t["done_at"] - t["pulled_at"] for t in done)}


class ReplicaManager(ReplicaEtcd, ReplicaCopies):
    """See the module docstring. Options:

    Args:
        limit: the node's service limit (every ``ckpt.get`` takes a request token and its bytes).
        quota_bytes, quota_replicas: per job, over all its live hints: extra bytes and extra copies.
        safe_readers: concurrent readers one copy serves well (the planner's divisor).
        max_ttl_s: longest hint TTL accepted; max_readers: largest reader count accepted.
        poll_s: how often the node looks for copy tasks and expired copies.
        placement_cost_s: what placing one copy costs a restart beyond its bytes (plan, task pick-up, registration,
            readers told); a copy above the base replication is placed only when it saves the readers more, judged
            at this node's service ``limit`` (every node assumed alike; unlimited: every wanted copy is placed).
            None: ``2 x poll_s`` (a target finds its task within one poll; the rest takes about another). The
            planner takes the cluster's measured placement time instead when it is longer (``{p}/replicas/
            .placement``: a running mean of hint received -> last copy registered, folded in when a hint's
            progress is first seen complete).
    """

    def __init__(self, server: Any, cluster: Any, *, limit: ServiceLimit | None = None,
                 quota_bytes: int = 64 << 30, quota_replicas: int = 4096,
                 safe_readers: int = DEFAULT_SAFE_READERS, base_replicas: int = DEFAULT_BASE_REPLICAS,
                 max_per_file: int | None = None, max_ttl_s: float = 24 * 3600, max_readers: int = 1 << 20,
                 poll_s: float = 0.25, lease_ttl: int = 10, copy_threads: int = 2,
                 placement_cost_s: float | None = None) -> None:
        self.server, self.cluster = server, cluster
        self.node_id, self.root = server.node_id, server.root
        self.limit = limit or ServiceLimit()
        self.quota_bytes, self.quota_replicas = int(quota_bytes), int(quota_replicas)
        self.safe_readers, self.base_replicas, self.max_per_file = safe_readers, base_replicas, max_per_file
        self.max_ttl_s, self.max_readers = float(max_ttl_s), int(max_readers)
        self.poll_s, self.lease_ttl = float(poll_s), max(2, int(lease_ttl))
        self.placement_cost_s = 2 * self.poll_s if placement_cost_s is None else float(placement_cost_s)
        if self.placement_cost_s < 0:
            raise ValueError(f"placement_cost_s {placement_cost_s} < 0")
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, str], LocalCopy] = {}
        self._base_records: dict[str, str] = {}  # key -> value, re-put under a new lease if ours expired
        self._bindings: dict[str, dict] = {}
        self._busy: set[str] = set()  # task keys being copied here
        self._noted: set[int] = set()  # hints (by lease) whose placement time went into the running mean
        self.inflight = 0
        self.stats = {"reads": 0, "bytes": 0, "copies_made": 0, "copies_failed": 0, "reclaimed": 0,
                      "wake_failures": 0, "round_failures": 0}
        self._failing: str | None = None  # the error of the rounds failing since the last one that worked
        self._pool = cf.ThreadPoolExecutor(max_workers=copy_threads, thread_name_prefix="foresight-replica-copy")
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by replicas.wake (a planning node wrote tasks for us): poll now
        self._lease: Any = None  # the node's lease (base copies, load); made by the loop, which rides over etcd outages
        self._adopted = False
        self._last = {"lease": -1e9, "load": -1e9, "reclaim": -1e9}  # when each periodic duty last ran
        self._round()  # at once when etcd answers; otherwise the loop keeps trying
        for name, dec, handler in (("replicas.publish", decode_ckpt_request, self._publish),
                                   ("replicas.progress", decode_ckpt_request, self._progress),
                                   ("replicas.release", decode_ckpt_request, self._release)):
            server.register_action(name, dec, handler, job_scoped=False)  # own auth: jobs here register no plan
        server.register_action("set_replication_hints", decode_hints, self._set_hints, job_scoped=False,
                               max_bytes=MAX_HINTS_BYTES)  # up to MAX_FILES hints: a restart of thousands of ranks
        server.register_action("replicas.wake", lambda o: check_fields(o, (), (), "replicas.wake") or {},
                               self._wake_call, job_scoped=False)
        server.register_action("replicas.stats", lambda o: check_fields(o, (), (), "replicas.stats") or {},
                               self._stats_call, job_scoped=False)
        server.register_get("ckpt.get", self._get)
        self._thread = threading.Thread(target=self._loop, name="foresight-replica-manager", daemon=True)
        self._thread.start()

    # -- actions -------------------------------------------------------------------------------------------
    def _publish(self, context: Any, req: dict) -> dict:
        """Register this node's files of ``checkpoint`` (under ``<root>/<checkpoint>/``) as base copies."""
        self._authorize(context, req["job"])
        name = req["checkpoint"]
        d = os.path.join(self.root, *name.split("/"))
        if not os.path.isdir(d):
            raise NodeError("this node holds no such checkpoint", checkpoint=name, node=self.node_id)
        files, records = {}, {}
        root = os.path.realpath(self.root)
        for f in sorted(os.listdir(d)):
            p = os.path.join(d, f)
            if not os.path.isfile(p) or f.startswith(".tmp"):
                continue
            check_file(f)
            if os.path.commonpath([root, os.path.realpath(p)]) != root:  # a symlink out: never served to the cluster
                raise NodeError("checkpoint file resolves outside the node's root", checkpoint=name, file=f,
                                node=self.node_id)
            rec = {"node": self.node_id, "location": self.server.location, "size": os.path.getsize(p),
                   "xxh3": file_xxh3(p), "base": True}
            records[self._k("replicas", ckpt_key(name), f, self.node_id)] = json.dumps(rec)
            with self._lock:
                self._copies[(name, f)] = LocalCopy(p, hinted=False)
            files[f] = rec["size"]
        with self._lock:
            self._base_records.update(records)
        if self._lease is None:
            self._keep_lease()
        self._put_many(records, self._lease)
        return {"checkpoint": name, "node": self.node_id, "files": files}

    def _set_hints(self, context: Any, req: dict) -> dict:
        received = time.time()  # the restart's clock runs from here: planning is part of placement's cost
        job, name = req["job"], req["checkpoint"]
        self._authorize(context, job)
        if req["ttl_s"] > self.max_ttl_s:
            raise HintError(f"hint TTL {req['ttl_s']} s is above this cluster's limit of {self.max_ttl_s} s",
                            checkpoint=name)
        # one etcd round trip for every read the plan needs; the hinted files' copies only: a restart's checkpoint
        # holds thousands of per-rank shards, and the plan is on the restart's clock
        state = self._hint_reads(job, name, [h.path for h in req["files"]])
        if state["hint"] is not None:  # checked again atomically when the hint is written
            raise HintError("a hint for this checkpoint is live; release it first (replicas.release) or let it "
                            "expire", checkpoint=name)
        live, copies, loads = state["live"], state["copies"], state["loads"]
        if not copies and not self.copies(name, live):  # which error: the slow look only when none was found
            raise HintError("no live node has published this checkpoint (replicas.publish)", checkpoint=name)
        known = {f: next(iter(recs.values()))["size"] for f, recs in copies.items()}
        hints = validate_hints(req["files"], known=known, max_readers=self.max_readers)
        used_bytes, used_replicas = self._job_usage(job, state["tasks"])
        holders = {f: sorted(recs) for f, recs in copies.items()}
        cost_s = self._placement_cost(state["placement"])
        lead_s = cold_lead_s(req.get("cold_bytes", 0), req.get("cold_reads", 0), len(loads),
                             node_bytes_per_s=self.limit.bytes_per_s, node_requests_per_s=self.limit.requests_per_s)
        common = dict(nodes=loads, holders=holders, safe_readers=self.safe_readers, base_replicas=self.base_replicas,
                      max_per_file=self.max_per_file, node_bytes_per_s=self.limit.bytes_per_s,
                      node_requests_per_s=self.limit.requests_per_s, placement_cost_s=cost_s,
                      lead_s=lead_s, join=req.get("copies_join", False))
        wanted = plan_replicas(hints, **common)
        left_bytes, left_replicas = self.quota_bytes - used_bytes, self.quota_replicas - used_replicas
        if not req["allow_partial"] and (wanted.copy_bytes > left_bytes or wanted.new_replicas > left_replicas):
            raise HintError(f"hint needs {wanted.copy_bytes} bytes in {wanted.new_replicas} new copies; the job's "
                            f"quota has {max(0, left_bytes)} bytes and {max(0, left_replicas)} copies left "
                            "(quota_bytes/quota_replicas; pass allow_partial to place what fits)",
                            checkpoint=name, job=job)
        plan = plan_replicas(hints, **common, quota_bytes=max(0, left_bytes), quota_replicas=max(0, left_replicas))
        lease = self.cluster._call(lambda c: c.lease(ttl=int(max(1, round(req["ttl_s"])))))
        now = time.time()
        files = [{"path": f.path, "size": f.size, "readers": f.readers, "wanted": f.wanted, "replicas": f.replicas,
                  "holders": f.holders, "new_nodes": f.new_nodes, "capped_by": f.capped_by,
                  "granularity_waste": f.granularity_waste, "sized_by": f.sized_by} for f in plan.files]
        record = {"job": job, "checkpoint": name, "ttl_s": req["ttl_s"], "lease": lease.id, "created": now,
                  "received": received,
                  "copy_bytes": plan.copy_bytes, "new_replicas": plan.new_replicas, "files": files,
                  "placement_cost_s": cost_s, "lead_s": lead_s,
                  "copies_join": req.get("copies_join", False),
                  "coordinator": self.node_id}
        tasks = {}
        for f in plan.files:
            recs = copies[f.path]
            # the holders the target pulls from, least loaded first: no lookups between its wake and its pull
            sources = [{"node": n, "location": recs[n]["location"]}
                       for n in sorted(recs, key=lambda n: (loads.get(n, 0), n))]
            for node in f.new_nodes:
                tasks[self._k("replicas", ".tasks", node, ckpt_key(name), f.path)] = {
                    "job": job, "checkpoint": name, "file": f.path, "size": f.size,
                    "xxh3": next(iter(recs.values()))["xxh3"], "grant": secrets.token_hex(16), "lease": lease.id,
                    "state": "pending", "created": now, "node": node, "sources": sources}
        if not self._create_hint(job, name, record, lease, tasks):  # the hint and its tasks: all or nothing
            lease.revoke()  # another node accepted a hint for it a moment ago
            raise HintError("a hint for this checkpoint is live; release it first (replicas.release) or let it "
                            "expire", checkpoint=name)
        self._wake_targets({n for f in plan.files for n in f.new_nodes}, live, job,
                           context.get_middleware("auth").token)  # the hint's token: targets check it
        log.info("replication hint accepted", extra={"job": job, "checkpoint": name, "ttl_s": req["ttl_s"],
                                                     "copy_bytes": plan.copy_bytes, "new": plan.new_replicas})
        return dict(record, wasteful=[f.path for f in plan.wasteful()])

    def wake(self) -> dict:
        """Look for copy tasks now rather than at the next poll (``replicas.wake``)."""
        self._wake.set()
        return {"node": self.node_id}

    def _wake_call(self, context: Any, req: dict) -> dict:
        """``replicas.wake`` makes this node read etcd now: only for a caller holding a job's token (the planning
        node forwards the hint's), checked against the job's binding without creating one (a made-up job is
        refused, and leaves no key in etcd)."""
        mw = context.get_middleware("auth")
        job = None if mw is None else mw.job
        if not job:
            raise flight.FlightUnauthenticatedError("foresight: replicas.wake needs the job header and its token")
        self._authorize(context, job, bind=False)
        return self.wake()

    def _stats_call(self, context: Any, req: dict) -> dict:
        """``replicas.stats``: the operator's (the node's admin token, or a caller on this host)."""
        self.server.authorize_operator(context)
        return self.describe()

    def _wake_targets(self, nodes: set[str], live: dict[str, dict], job: str, token: str) -> None:
        """Tell each target of new tasks at once, from a thread (the hint's reply does not wait); a target not
        reached finds its tasks at its next poll (logged, ``stats['wake_failures']``)."""
        def send(node: str) -> None:
            if node == self.node_id:
                self.wake()
                return
            try:
                client = connect(live[node]["location"])
                try:
                    list(client.do_action(flight.Action("replicas.wake", b"{}"), call_options(job, token, timeout=5)))
                finally:
                    client.close()
            except Exception as e:  # the target polls anyway
                self.stats["wake_failures"] += 1
                log.warning("could not wake a copy target; it finds its task at its next poll",
                            extra={"node": node, "error": str(e)[:200]})

        for node in sorted(nodes):
            threading.Thread(target=send, args=(node,), name="foresight-replica-wake", daemon=True).start()

    def _placement_cost(self, measured: dict | None) -> float:
        """What placement costs a restart here: the configured figure, or what the cluster's recent placements
        took (``measured``: the ``.placement`` record, hint received -> last copy registered, planning included; a
        running mean in etcd) when longer: a loaded cluster places slower than its poll interval says, and a copy
        must pay for the time it really takes."""
        return max(self.placement_cost_s, float(measured["place_s"])) if measured else self.placement_cost_s

    def _note_placement(self, hint: dict, place_s: float) -> None:
        """Fold a finished hint's placement time into the cluster's running mean (once per hint, by the node
        that reports its progress; racing nodes each fold their sample: a mean, not a ledger)."""
        with self._lock:
            if hint["lease"] in self._noted:
                return
            self._noted.add(hint["lease"])
        key = self._k("replicas", ".placement")
        old = self._get1(key)
        mean = place_s if old is None else 0.5 * float(old["place_s"]) + 0.5 * place_s
        self._put(key, {"place_s": mean, "samples": (old or {}).get("samples", 0) + 1})

    def _job_usage(self, job: str, tasks: list[tuple[str, dict]]) -> tuple[int, int]:
        """Bytes and copies this job's live hints hold or are making (``tasks``: every copy task)."""
        nbytes = copies = 0
        for _, t in tasks:
            if t.get("job") == job and t.get("state") != "failed":
                nbytes += int(t.get("size", 0))
                copies += 1
        return nbytes, copies

    def _progress(self, context: Any, req: dict) -> dict:
        job, name = req["job"], req["checkpoint"]
        self._authorize(context, job)
        nodes = self._k("nodes") + "/"  # the hint, the live nodes and the tasks in one round trip
        hint_key, parts = self._hint_ranges(job, name)
        (listed, every_task, hint_parts), (head,) = self.cluster.get_many(
            [nodes, self._k("replicas", ".tasks") + "/", parts], [hint_key])
        hint = hint_from(head, hint_parts, parts, key=hint_key)
        live = {k[len(nodes):]: v for k, v in listed}
        tasks = [t for _, t in every_task if t.get("checkpoint") == name]
        for t in tasks:  # a target that died will never finish its copy: do not wait for it
            if t["state"] in ("pending", "copying") and t["node"] not in live:
                t["state"], t["error"] = "failed", "target node left the cluster"
        # polled during the restart: the hinted files' copies (one more round trip), not every shard's
        copies = self.copies(name, live, files=[f["path"] for f in hint.get("files", [])] if hint else None)
        counts = {s: sum(t["state"] == s for t in tasks) for s in ("pending", "copying", "done", "failed")}
        done = [t for t in tasks if t["state"] == "done"]
        done_at = [t["done_at"] for t in done]
        files = {f: {"copies": sorted(recs), "hinted": sorted(n for n, r in recs.items() if not r.get("base"))}
                 for f, recs in copies.items()}
        complete = hint is not None and counts["pending"] + counts["copying"] == 0
        if complete and done_at and not counts["failed"]:
            self._note_placement(hint, max(done_at) - hint.get("received", hint["created"]))
        return {"checkpoint": name, "hint_live": hint is not None, "tasks": len(tasks), **counts,
                "complete": hint is not None and counts["pending"] + counts["copying"] == 0,
                "copied_bytes": sum(int(t.get("size", 0)) for t in tasks if t["state"] == "done"),
                "place_s": (max(done_at) - hint["created"]) if done_at and hint else None,
                "steps_s": _placement_steps(done),
                "errors": [f"{t['file']} on {t['node']}: {t.get('error')}" for t in tasks if t["state"] == "failed"],
                "files": files, "records": copies if hint is not None else {}}  # the hinted files' copy records

    def _release(self, context: Any, req: dict) -> dict:
        """End a hint now: its lease is revoked, so its copies are reclaimed (after their reads)."""
        job, name = req["job"], req["checkpoint"]
        self._authorize(context, job)
        hint = self._get1(self._hint_key(job, name))  # a hint still being written too: its writer then fails
        if hint is None:
            return {"checkpoint": name, "released": False}
        self._lease_of(hint["lease"]).revoke()
        return {"checkpoint": name, "released": True}

    # -- copies (target side) ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._round()

    def _round(self) -> None:
        """One round: keep the lease, take copy tasks, advertise the load, reclaim expired copies."""
        now = time.monotonic()
        last = self._last
        try:
            if now - last["lease"] > self.lease_ttl / 3:
                self._keep_lease()
                last["lease"] = now
            if not self._adopted:
                self._adopt_existing()
                self._adopted = True
            self._take_tasks()  # first: a woken node's copies are on a restart's clock, the load record is not
            if self.inflight != last.get("inflight") or now - last["load"] > 2.0:  # readers pick by it: keep fresh
                inflight = self.inflight
                self._put(self._k("replicas", ".load", self.node_id),
                          {"inflight": inflight, "reads": self.stats["reads"], "bytes": self.stats["bytes"]},
                          lease=self._lease)
                last["load"], last["inflight"] = now, inflight
            if now - last["reclaim"] > 1.0:
                self.reclaim()
                last["reclaim"] = now
        except Exception as e:  # etcd briefly away: try again next round
            self.stats["round_failures"] += 1
            error = str(e)[:300]
            if error != self._failing:  # once per outage (a round runs every poll_s: 4 lines a second otherwise)
                log.warning("replica manager round failed; retrying every round, logged again when the error "
                            "changes", extra={"error": error, "round_failures": self.stats["round_failures"]})
            self._failing = error
        else:
            if self._failing is not None:
                log.info("replica manager rounds work again", extra={"round_failures": self.stats["round_failures"]})
            self._failing = None

    def _keep_lease(self) -> None:
        try:
            alive = self._lease is not None and self._lease.refresh() > 0
        except Exception:
            alive = False
        if not alive:  # none yet, or expired while etcd was away: our base copies dropped out; put them back
            self._lease = self._new_lease()
            with self._lock:
                records = dict(self._base_records)
            self._put_many(records, self._lease)

    def describe(self) -> dict:
        with self._lock:
            serving = sum(1 for c in self._copies.values() if c.hinted)
        return dict(self.stats, node=self.node_id, inflight=self.inflight, hinted_copies=serving,
                    limit=self.limit.describe())

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            if self._lease is not None:
                self._lease.revoke()  # our base copies leave the cluster at once
        except Exception:
            pass


__all__ = ["ReplicaManager"]
