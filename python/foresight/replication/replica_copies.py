"""The copies one node holds for the replica manager: serving them (``DoGet ckpt.get``, reference counted so a
copy is deleted only after its reads), making the copies this node is asked for (take a task, pull the file from
the least loaded holder, check its xxh3, rename it into place, register it under the hint's lease), reclaiming
hinted copies whose hint expired, and adopting the copies found on disk after a restart.

:class:`ReplicaCopies` is a base class of :class:`~foresight.replication.replica_manager.ReplicaManager`; the
state lives on the manager (``_copies``, ``_lock``, ``_busy``, ``_pool``, ``limit``, ``stats``, ``inflight``).

A task names the holders to pull from (the planner's view, least loaded first), so a target goes from its wake to
its pull with one etcd read (the task) and registers the copy with one write.

Example::

    manager._take_tasks()        # submit this node's pending copy tasks to the copy threads
    gone = manager.reclaim()     # [(checkpoint, file)] whose hint expired: no longer served, deleted after reads
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow.flight as flight

from foresight.checksum import file_xxh3
from foresight.cluster.auth import connect
from foresight.cluster.requests import check_fields, check_ident
from foresight.errors import NodeError
from foresight.cluster.owned_stream import OwnedStream
from foresight.replication.replica_requests import check_checkpoint, check_file, ckpt_key
from foresight.replication.flight_calls import SCHEMA, binary_batch

log = logging.getLogger("foresight.replication.replica_manager")  # the manager's one logger

CHUNK = 1 << 20  # bytes per record batch: fine enough for the byte bucket to interleave readers
REPLICA_DIR = ".replicas"  # hinted copies live under <root>/.replicas/<checkpoint>/<file>


@dataclass
class LocalCopy:
    """A copy this node serves: its path, open reads, and whether it is to be deleted when they end."""

    path: str
    hinted: bool
    refs: int = 0
    doomed: bool = False


class ReplicaCopies:
    """See the module docstring."""

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
        sent = [0]

        def batches():
            while sent[0] < size:
                k = min(CHUNK, size - sent[0])
                self.limit.consume(k, priority=copy)
                data = os.pread(fd, k, sent[0])
                if not data:
                    raise NodeError("file shrank while being read", path=local.path, offset=sent[0])
                sent[0] += len(data)
                yield binary_batch(memoryview(data))

        def release() -> None:  # also when the stream is dropped unread (see OwnedStream): the copy stays reclaimable
            os.close(fd)
            self._unref(name, f, local, sent[0])

        return flight.GeneratorStream(SCHEMA, OwnedStream(batches(), release))

    def _unref(self, name: str, f: str, local: LocalCopy, sent: int) -> None:
        with self._lock:
            local.refs -= 1
            self.inflight -= 1
            self.stats["reads"] += 1
            self.stats["bytes"] += sent
            delete = local.doomed and local.refs == 0
        if delete:
            self._unlink(local.path)

    def _take_tasks(self) -> None:
        for key, task in self._tasks(self.node_id):
            if task.get("state") == "pending" and key not in self._busy:
                self._busy.add(key)
                self._pool.submit(self._copy, key, task)

    def _copy(self, key: str, task: dict) -> None:
        """Make one copy: pull it from the holders the task names (the planner's, least loaded first; from a
        lookup of the live copies when it names none or none of them served), then register the copy and mark the
        task done in one etcd write. The task stays ``pending`` while it is copied (no write between the wake and
        the pull: each etcd write is a sync on placement's path); a failure marks it ``failed``."""
        lease = self._lease_of(task["lease"])
        name, f = task["checkpoint"], task["file"]
        try:
            picked_at = time.time()
            errors: list[str] = []
            tried = {self.node_id}
            for holders in (lambda: task.get("sources") or [], lambda: self._holders(name, f)):
                for src in holders():
                    if src["node"] in tried:
                        continue
                    tried.add(src["node"])
                    try:
                        path = self._pull(task, src)
                        pulled_at = time.time()
                    except Exception as e:  # another holder may serve it: the error is kept for progress
                        errors.append(f"{src['node']}: {e}"[:300])
                        continue
                    self._register(key, task, path, lease, picked_at=picked_at, pulled_at=pulled_at,
                                   source=src["node"])
                    return
            self.stats["copies_failed"] += 1
            self._put(key, dict(task, state="failed", error="; ".join(errors) or "no live holder"), lease=lease)
        except Exception as e:
            log.warning("copy task failed", extra={"task": key, "error": str(e)[:300]})
        finally:
            self._busy.discard(key)

    def _holders(self, name: str, f: str) -> list[dict]:
        """The live copies of ``f`` from etcd, least loaded first (when the task's own list did not serve)."""
        live = self._live_nodes()
        loads = self._loads(live)
        return sorted(self.copies(name, live, file=f).get(f, {}).values(), key=lambda r: (loads.get(r["node"], 0),
                                                                                            r["node"]))

    def _register(self, key: str, task: dict, path: str, lease: Any, **done: Any) -> None:
        """Serve the pulled copy, then list it for readers and mark its task done (one transaction)."""
        name, f = task["checkpoint"], task["file"]
        rec = {"node": self.node_id, "location": self.server.location, "size": task["size"], "xxh3": task["xxh3"],
               "base": False}
        with self._lock:
            self._copies[(name, f)] = LocalCopy(path, hinted=True)
        self.stats["copies_made"] += 1  # before the task reads done: whoever sees it done sees it counted
        try:
            self._put_many({self._k("replicas", ckpt_key(name), f, self.node_id): json.dumps(rec),
                            key: json.dumps(dict(task, state="done", done_at=time.time(), **done), default=str)},
                           lease)
        except NodeError:  # the hint expired while copying: the copy is reclaimed next round
            pass

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
                    if out.tell() > task["size"]:  # a holder sending more than the file: stop before the disk fills
                        raise NodeError("holder sent more bytes than the file has", file=f, source=src["node"],
                                        expected=task["size"], got=out.tell())
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
            self.stats["reclaimed"] += 1  # before the delete: whoever sees the copy gone sees it counted
            if delete:
                self._unlink(local.path)
            gone.append((name, f))
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
                    self._copies[(name, f)] = LocalCopy(path, hinted=True)
                else:
                    self._unlink(path)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


__all__ = ["CHUNK", "LocalCopy", "REPLICA_DIR", "ReplicaCopies"]
