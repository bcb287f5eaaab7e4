"""The replica manager: replication hints, node-to-node copies before a restart, spread reads, TTL reclaim.

Mounted on a :class:`~foresight.node.server.NodeServer` that is part of a cluster (``foresight node serve --etcd``).
A job publishes the checkpoint files a node holds (``replicas.publish``: the base copies), declares before a
restart which files its ranks will read and how many at once (``set_replication_hints``, see
:mod:`foresight.replication.hint_client`), and the node that receives the hint plans the extra copies
(:func:`~foresight.replication.replica_plan.plan_replicas`) and writes one *task* per copy in etcd. Each target node
picks up its tasks (at once: the planning node wakes it with ``replicas.wake``; else within ``poll_s``), pulls the file from a holder over Flight (``DoGet ckpt.get`` with the task's grant), writes it
under a temp name, checks its xxh3 against the base copy's, renames it into place and registers it under the
hint's lease. Ranks read through :class:`~foresight.replication.hint_client.ReplicaReader`, which picks the least
loaded live copy and verifies every file it reads.

etcd keys (``{p}`` = the cluster prefix, ``{ckpt}`` = the checkpoint name URL-quoted; values JSON):

``{p}/hints/{job}/token``                        ``{salt, sha256}``: the first call of a job binds its token
``{p}/hints/{job}/ckpt/{ckpt}``                  the live hint (its lease = the hint's TTL)
``{p}/replicas/{ckpt}/{file}/{node}``            a copy: ``{node, location, size, xxh3, base}``; base copies live
                                                 under the node's lease, hinted ones under the hint's lease
``{p}/replicas/.tasks/{node}/{ckpt}/{file}``     a copy to make: ``{state, grant, lease, ...}`` (hint's lease)
``{p}/replicas/.load/{node}``                    ``{inflight, reads, bytes}`` (node's lease)

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
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pyarrow.flight as flight

from foresight.checksum import file_xxh3
from foresight.cluster.auth import connect
from foresight.cluster.requests import check_fields, check_ident, fail
from foresight.cluster.throttle import ServiceLimit
from foresight.errors import NodeError, ProtocolError
from foresight.replication.hints import MAX_TTL_S, FileHint, HintError, validate_hints
from foresight.replication.replica_plan import DEFAULT_BASE_REPLICAS, DEFAULT_SAFE_READERS, plan_replicas
from foresight.replication.service import SCHEMA, binary_batch
from foresight.replication.units import check_file_name, check_name

log = logging.getLogger("foresight.replication.replica_manager")
CHUNK = 1 << 20  # bytes per record batch: fine enough for the byte bucket to interleave readers
REPLICA_DIR = ".replicas"  # hinted copies live under <root>/.replicas/<checkpoint>/<file>
MAX_FILES = 1 << 16


def ckpt_key(name: str) -> str:
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
    if not isinstance(name, str):
        fail("file must be a string", got=repr(name)[:40])
    try:
        return check_file_name(name)
    except Exception as e:
        raise ProtocolError(str(e)) from None


# -- request decoders (checked before any handler runs) ------------------------------------------------------
def _decode_ckpt_request(o: dict) -> dict:
    check_fields(o, ("job", "checkpoint"), (), "request")
    job = check_ident(o["job"], "job")
    return {"job": job, "checkpoint": check_checkpoint(job, o["checkpoint"])}


def _decode_hints(o: dict) -> dict:
    check_fields(o, ("job", "checkpoint", "ttl_s", "files"), ("allow_partial",), "set_replication_hints")
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
    return {"job": job, "checkpoint": check_checkpoint(job, o["checkpoint"]), "ttl_s": float(ttl), "files": hints,
            "allow_partial": bool(o.get("allow_partial", False))}


@dataclass
class _Local:
    """A copy this node serves: its path, open reads, and whether it is to be deleted when they end."""

    path: str
    hinted: bool
    refs: int = 0
    doomed: bool = False


def _placement_steps(done: list[dict]) -> dict | None:
    """Where placement's time went, the slowest copy's per step: hint accepted -> task picked up by its target ->
    pulled from a holder -> registered (copies from before these timestamps are left out)."""
    done = [t for t in done if "picked_at" in t and "pulled_at" in t]
    if not done:
        return None
    return {"pickup": max(t["picked_at"] - t["created"] for t in done),
            "pull": max(t["pulled_at"] - t["picked_at"] for t in done),
            "register": max(t["done_at"] - t["pulled_at"] for t in done)}


class ReplicaManager:
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
            None: ``2 x poll_s`` (a target finds its task within one poll; the rest takes about another).
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
        self._copies: dict[tuple[str, str], _Local] = {}
        self._base_records: dict[str, str] = {}  # key -> value, re-put under a new lease if ours expired
        self._bindings: dict[str, dict] = {}
        self._busy: set[str] = set()  # task keys being copied here
        self.inflight = 0
        self.stats = {"reads": 0, "bytes": 0, "copies_made": 0, "copies_failed": 0, "reclaimed": 0,
                      "wake_failures": 0}
        self._pool = cf.ThreadPoolExecutor(max_workers=copy_threads, thread_name_prefix="foresight-replica-copy")
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by replicas.wake (a planning node wrote tasks for us): poll now
        self._lease: Any = None  # the node's lease (base copies, load); made by the loop, which rides over etcd outages
        self._adopted = False
        self._last = {"lease": -1e9, "load": -1e9, "reclaim": -1e9}  # when each periodic duty last ran
        self._round()  # at once when etcd answers; otherwise the loop keeps trying
        for name, dec, handler in (("replicas.publish", _decode_ckpt_request, self._publish),
                                   ("set_replication_hints", _decode_hints, self._set_hints),
                                   ("replicas.progress", _decode_ckpt_request, self._progress),
                                   ("replicas.release", _decode_ckpt_request, self._release)):
            server.register_action(name, dec, handler, job_scoped=False)  # own auth: jobs here register no plan
        server.register_action("replicas.wake", lambda o: check_fields(o, (), (), "replicas.wake") or {},
                               lambda context, req: self.wake(), job_scoped=False)  # only polls sooner: no auth
        server.register_action("replicas.stats", lambda o: check_fields(o, (), (), "replicas.stats") or {},
                               lambda context, req: self.describe(), job_scoped=False)
        server.register_get("ckpt.get", self._get)
        self._thread = threading.Thread(target=self._loop, name="foresight-replica-manager", daemon=True)
        self._thread.start()

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

    # -- actions -------------------------------------------------------------------------------------------
    def _publish(self, context: Any, req: dict) -> dict:
        """Register this node's files of ``checkpoint`` (under ``<root>/<checkpoint>/``) as base copies."""
        self._authorize(context, req["job"])
        name = req["checkpoint"]
        d = os.path.join(self.root, *name.split("/"))
        if not os.path.isdir(d):
            raise NodeError("this node holds no such checkpoint", checkpoint=name, node=self.node_id)
        files, records = {}, {}
        for f in sorted(os.listdir(d)):
            p = os.path.join(d, f)
            if not os.path.isfile(p) or f.startswith(".tmp"):
                continue
            check_file(f)
            rec = {"node": self.node_id, "location": self.server.location, "size": os.path.getsize(p),
                   "xxh3": file_xxh3(p), "base": True}
            records[self._k("replicas", ckpt_key(name), f, self.node_id)] = json.dumps(rec)
            with self._lock:
                self._copies[(name, f)] = _Local(p, hinted=False)
            files[f] = rec["size"]
        with self._lock:
            self._base_records.update(records)
        if self._lease is None:
            self._keep_lease()
        self._put_many(records, self._lease)
        return {"checkpoint": name, "node": self.node_id, "files": files}

    def _set_hints(self, context: Any, req: dict) -> dict:
        job, name = req["job"], req["checkpoint"]
        self._authorize(context, job)
        if req["ttl_s"] > self.max_ttl_s:
            raise HintError(f"hint TTL {req['ttl_s']} s is above this cluster's limit of {self.max_ttl_s} s",
                            checkpoint=name)
        hint_key = self._k("hints", job, "ckpt", ckpt_key(name))
        if self._get1(hint_key) is not None:  # checked again atomically when the hint is written
            raise HintError("a hint for this checkpoint is live; release it first (replicas.release) or let it "
                            "expire", checkpoint=name)
        live = self._live_nodes()
        copies = self.copies(name, live)
        known = {f: next(iter(recs.values()))["size"] for f, recs in copies.items()}
        if not known:
            raise HintError("no live node has published this checkpoint (replicas.publish)", checkpoint=name)
        hints = validate_hints(req["files"], known=known, max_readers=self.max_readers)
        used_bytes, used_replicas = self._job_usage(job)
        holders = {f: sorted(recs) for f, recs in copies.items()}
        loads = self._loads(live)
        common = dict(nodes=loads, holders=holders, safe_readers=self.safe_readers, base_replicas=self.base_replicas,
                      max_per_file=self.max_per_file, node_bytes_per_s=self.limit.bytes_per_s,
                      node_requests_per_s=self.limit.requests_per_s, placement_cost_s=self.placement_cost_s)
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
                  "granularity_waste": f.granularity_waste} for f in plan.files]
        record = {"job": job, "checkpoint": name, "ttl_s": req["ttl_s"], "lease": lease.id, "created": now,
                  "copy_bytes": plan.copy_bytes, "new_replicas": plan.new_replicas, "files": files,
                  "placement_cost_s": self.placement_cost_s,
                  "coordinator": self.node_id}
        if not self.cluster._call(lambda c: c.create(hint_key, json.dumps(record), lease=lease)):
            lease.revoke()  # another node accepted a hint for it a moment ago
            raise HintError("a hint for this checkpoint is live; release it first (replicas.release) or let it "
                            "expire", checkpoint=name)
        for f in plan.files:
            src = next(iter(copies[f.path].values()))
            for node in f.new_nodes:
                task = {"job": job, "checkpoint": name, "file": f.path, "size": f.size, "xxh3": src["xxh3"],
                        "grant": secrets.token_hex(16), "lease": lease.id, "state": "pending", "created": now,
                        "node": node}
                self._put(self._k("replicas", ".tasks", node, ckpt_key(name), f.path), task, lease=lease)
        self._wake_targets({n for f in plan.files for n in f.new_nodes}, live)
        log.info("replication hint accepted", extra={"job": job, "checkpoint": name, "ttl_s": req["ttl_s"],
                                                     "copy_bytes": plan.copy_bytes, "new": plan.new_replicas})
        return dict(record, wasteful=[f.path for f in plan.wasteful()])

    def wake(self) -> dict:
        """Look for copy tasks now rather than at the next poll (``replicas.wake``)."""
        self._wake.set()
        return {"node": self.node_id}

    def _wake_targets(self, nodes: set[str], live: dict[str, dict]) -> None:
        """Tell each target of new tasks at once, from a thread (the hint's reply does not wait); a target not
        reached finds its tasks at its next poll (logged, ``stats['wake_failures']``)."""
        def send(node: str) -> None:
            if node == self.node_id:
                self.wake()
                return
            try:
                client = connect(live[node]["location"])
                try:
                    list(client.do_action(flight.Action("replicas.wake", b"{}"), flight.FlightCallOptions(timeout=5)))
                finally:
                    client.close()
            except Exception as e:  # the target polls anyway
                self.stats["wake_failures"] += 1
                log.warning("could not wake a copy target; it finds its task at its next poll",
                            extra={"node": node, "error": str(e)[:200]})

        for node in sorted(nodes):
            threading.Thread(target=send, args=(node,), name="foresight-replica-wake", daemon=True).start()

    def _job_usage(self, job: str) -> tuple[int, int]:
        """Bytes and copies this job's live hints hold or are making."""
        nbytes = copies = 0
        for _, t in self._tasks():
            if t.get("job") == job and t.get("state") != "failed":
                nbytes += int(t.get("size", 0))
                copies += 1
        return nbytes, copies

    def _progress(self, context: Any, req: dict) -> dict:
        job, name = req["job"], req["checkpoint"]
        self._authorize(context, job)
        hint = self._get1(self._k("hints", job, "ckpt", ckpt_key(name)))
        live = self._live_nodes()
        tasks = [t for _, t in self._tasks() if t.get("checkpoint") == name]
        for t in tasks:  # a target that died will never finish its copy: do not wait for it
            if t["state"] in ("pending", "copying") and t["node"] not in live:
                t["state"], t["error"] = "failed", "target node left the cluster"
        copies = self.copies(name, live)
        counts = {s: sum(t["state"] == s for t in tasks) for s in ("pending", "copying", "done", "failed")}
        done = [t for t in tasks if t["state"] == "done"]
        done_at = [t["done_at"] for t in done]
        files = {f: {"copies": sorted(recs), "hinted": sorted(n for n, r in recs.items() if not r.get("base"))}
                 for f, recs in copies.items()}
        return {"checkpoint": name, "hint_live": hint is not None, "tasks": len(tasks), **counts,
                "complete": hint is not None and counts["pending"] + counts["copying"] == 0,
                "copied_bytes": sum(int(t.get("size", 0)) for t in tasks if t["state"] == "done"),
                "place_s": (max(done_at) - hint["created"]) if done_at and hint else None,
                "steps_s": _placement_steps(done),
                "errors": [f"{t['file']} on {t['node']}: {t.get('error')}" for t in tasks if t["state"] == "failed"],
                "files": files}

    def _release(self, context: Any, req: dict) -> dict:
        """End a hint now: its lease is revoked, so its copies are reclaimed (after their reads)."""
        job, name = req["job"], req["checkpoint"]
        self._authorize(context, job)
        hint = self._get1(self._k("hints", job, "ckpt", ckpt_key(name)))
        if hint is None:
            return {"checkpoint": name, "released": False}
        self._lease_of(hint["lease"]).revoke()
        return {"checkpoint": name, "released": True}

    # -- reads ---------------------------------------------------------------------------------------------
    def _get(self, context: Any, t: dict) -> Any:
        check_fields(t, ("kind", "job", "checkpoint", "file"), ("grant", "node"), "ckpt.get ticket")
        job = check_ident(t["job"], "job")
        name, f = check_checkpoint(job, t["checkpoint"]), check_file(t["file"])
        if "grant" in t:  # a node pulling a copy for a task: the task's grant is its credential
            task = self._get1(self._k("replicas", ".tasks", check_ident(t.get("node"), "node"), ckpt_key(name), f))
            if task is None or not hmac.compare_digest(str(task.get("grant")), str(t["grant"])):
                raise flight.FlightUnauthenticatedError("foresight: no live copy task with this grant")
        else:
            self._authorize(context, job)
        with self._lock:
            local = self._copies.get((name, f))
            if local is None or local.doomed:
                raise NodeError("this node serves no copy of the file", checkpoint=name, file=f, node=self.node_id)
            local.refs += 1
            self.inflight += 1
        copy = "grant" in t  # a copy's source read goes ahead of the readers' queue (see cluster/throttle.py)
        try:
            self.limit.request(priority=copy)
            fd = os.open(local.path, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self._unref(name, f, local, 0)
            raise
        size = os.fstat(fd).st_size

        def batches():
            sent = 0
            try:
                while sent < size:
                    k = min(CHUNK, size - sent)
                    self.limit.consume(k, priority=copy)
                    data = os.pread(fd, k, sent)
                    if not data:
                        raise NodeError("file shrank while being read", path=local.path, offset=sent)
                    sent += len(data)
                    yield binary_batch(memoryview(data))
            finally:
                os.close(fd)
                self._unref(name, f, local, sent)

        return flight.GeneratorStream(SCHEMA, batches())

    def _unref(self, name: str, f: str, local: _Local, sent: int) -> None:
        with self._lock:
            local.refs -= 1
            self.inflight -= 1
            self.stats["reads"] += 1
            self.stats["bytes"] += sent
            delete = local.doomed and local.refs == 0
        if delete:
            self._unlink(local.path)

    # -- copies (target side) ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._round()

    def _round(self) -> None:
        """One round: keep the lease, advertise the load, take copy tasks, reclaim expired copies."""
        now = time.monotonic()
        last = self._last
        try:
            if now - last["lease"] > self.lease_ttl / 3:
                self._keep_lease()
                last["lease"] = now
            if not self._adopted:
                self._adopt_existing()
                self._adopted = True
            if self.inflight != last.get("inflight") or now - last["load"] > 2.0:  # readers pick by it: keep fresh
                inflight = self.inflight
                self._put(self._k("replicas", ".load", self.node_id),
                          {"inflight": inflight, "reads": self.stats["reads"], "bytes": self.stats["bytes"]},
                          lease=self._lease)
                last["load"], last["inflight"] = now, inflight
            self._take_tasks()
            if now - last["reclaim"] > 1.0:
                self.reclaim()
                last["reclaim"] = now
        except Exception as e:  # etcd briefly away: try again next round
            log.warning("replica manager round failed", extra={"error": str(e)[:300]})

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

    def _take_tasks(self) -> None:
        for key, task in self._tasks(self.node_id):
            if task.get("state") == "pending" and key not in self._busy:
                self._busy.add(key)
                self._pool.submit(self._copy, key, task)

    def _copy(self, key: str, task: dict) -> None:
        lease = self._lease_of(task["lease"])
        name, f = task["checkpoint"], task["file"]
        try:
            picked_at = time.time()
            self._put(key, dict(task, state="copying", picked_at=picked_at), lease=lease)
            errors = []
            live = self._live_nodes()
            holders = [r for n, r in self.copies(name, live, file=f).get(f, {}).items() if n != self.node_id]
            loads = self._loads(live)
            holders.sort(key=lambda r: (loads.get(r["node"], 0), r["node"]))
            for src in holders:
                try:
                    path = self._pull(task, src)
                    pulled_at = time.time()
                except Exception as e:  # another holder may serve it: the error is kept for progress
                    errors.append(f"{src['node']}: {e}"[:300])
                    continue
                rec = {"node": self.node_id, "location": self.server.location, "size": task["size"],
                       "xxh3": task["xxh3"], "base": False}
                with self._lock:
                    self._copies[(name, f)] = _Local(path, hinted=True)
                try:
                    self._put(self._k("replicas", ckpt_key(name), f, self.node_id), rec, lease=lease)
                    self._put(key, dict(task, state="done", picked_at=picked_at, pulled_at=pulled_at,
                                        done_at=time.time(), source=src["node"]), lease=lease)
                except NodeError:  # the hint expired while copying: the copy is reclaimed next round
                    pass
                self.stats["copies_made"] += 1
                return
            self.stats["copies_failed"] += 1
            self._put(key, dict(task, state="failed", error="; ".join(errors) or "no live holder"), lease=lease)
        except Exception as e:
            log.warning("copy task failed", extra={"task": key, "error": str(e)[:300]})
        finally:
            self._busy.discard(key)

    def _pull(self, task: dict, src: dict) -> str:
        name, f = task["checkpoint"], task["file"]
        final_dir = os.path.join(self.root, REPLICA_DIR, *name.split("/"))
        os.makedirs(final_dir, exist_ok=True)
        final = os.path.join(final_dir, f)
        tmp = os.path.join(final_dir, f".tmp-{f}-{uuid.uuid4().hex[:8]}")
        ticket = json.dumps({"kind": "ckpt.get", "job": task["job"], "checkpoint": name, "file": f,
                             "grant": task["grant"], "node": self.node_id}).encode()
        client = connect(src["location"])
        try:
            reader = client.do_get(flight.Ticket(ticket), flight.FlightCallOptions(timeout=300))
            with open(tmp, "wb") as out:
                for chunk in reader:
                    col = chunk.data.column(0)
                    for i in range(len(col)):
                        out.write(col[i].as_buffer())
                out.flush()
                os.fsync(out.fileno())
            got = file_xxh3(tmp)
            if os.path.getsize(tmp) != task["size"] or got != task["xxh3"]:
                raise NodeError("copy does not match the base copy's size/xxh3", file=f, source=src["node"],
                                expected=task["xxh3"], got=got)
            os.rename(tmp, final)
        except BaseException:
            self._unlink(tmp)
            raise
        finally:
            client.close()
        return final

    # -- reclaim -------------------------------------------------------------------------------------------
    def reclaim(self) -> list[tuple[str, str]]:
        """Stop serving and delete hinted copies whose key expired (deferred while read). Returns them."""
        with self._lock:
            hinted = [(k, c) for k, c in self._copies.items() if c.hinted and not c.doomed]
        gone = []
        for (name, f), local in hinted:
            if self._get1(self._k("replicas", ckpt_key(name), f, self.node_id)) is not None:
                continue
            with self._lock:
                if self._copies.get((name, f)) is local:
                    del self._copies[(name, f)]
                local.doomed = True
                delete = local.refs == 0
            if delete:
                self._unlink(local.path)
            gone.append((name, f))
            self.stats["reclaimed"] += 1
            log.info("replica reclaimed", extra={"checkpoint": name, "file": f, "deferred": not delete})
        return gone

    def _adopt_existing(self) -> None:
        """After a restart: keep serving hinted copies whose key still names this node; delete the rest."""
        top = os.path.join(self.root, REPLICA_DIR)
        for dirpath, _, filenames in os.walk(top):
            name = os.path.relpath(dirpath, top).replace(os.sep, "/")
            for f in filenames:
                path = os.path.join(dirpath, f)
                if not f.startswith(".tmp-") and self._get1(self._k("replicas", ckpt_key(name), f, self.node_id)):
                    self._copies[(name, f)] = _Local(path, hinted=True)
                else:
                    self._unlink(path)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

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


__all__ = ["ReplicaManager", "ckpt_key", "check_checkpoint"]
