"""A restart's read schedule around its replication hint: no rank waits for placement, new copies take the late
readers.

Sending a hint and waiting for its copies before the ranks start puts the placement (one planning call, then the
copies) on the restart's clock; with per-host sharing a plan often places nothing and the call alone is lost time.
:class:`HintedRestore` sends the hint from a thread of its own the moment the restart is declared (one node, one
connection for the hint and its progress polls) and lets the ranks start at once. While the copies are placed:

* ``.metadata`` comes first (a rank needs it to plan its reads);
* :meth:`HintedRestore.order`: the hinted (hot) files first only for as many ranks as the copies that exist serve
  at once (``depth`` fetches per copy; with per-host sharing one fetch per host, by its local rank 0, while the
  host's other ranks read their own files first); the other ranks read their cold files (their own shards, spread
  over every node) first and reach the hot files later;
* :class:`ScheduledReader`: a hot fetch waits for a slot (``depth`` per copy in flight), so the base copies are
  kept busy but never queue reads that the new copies will serve sooner; registered copies add slots at once.

Once placement is over (copies registered and the reader's list refreshed, or a plan that places none, or a
failure: logged, the base copies serve), or runs past when its copies were expected (the plan's placement cost;
``expect_s`` while the plan is out: late copies hold nobody), every rank reads in its own order with no slot. The hint says the ranks are
not held (``copies_join``) and how much they read besides (``cold_bytes``, ``cold_reads``), so the planner places a
copy when the base copies would still be busy with the file when it lands
(:func:`~foresight.replication.replica_plan.paying_replicas`). A hint costs time at worst, never a byte.

Example::

    with ReplicaReader(ep, job="job-7", token=tok) as replicas:
        replicas.copies("job-7/step-100")
        restore = HintedRestore("job-7/step-100", etcd=ep, job="job-7", token=tok, hints=hints, reader=replicas,
                                ranks_per_host=8, cold_bytes=world * shard_size, cold_reads=world).start()
        reader = SharedReplicaReader(restore.scheduled(replicas), share, hot=[h.path for h in hints])
        for f in restore.order([".metadata", "__0_data.bin", my_shard], local_rank=local_rank):
            data = reader.read("job-7/step-100", f)
        restore.join()
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pyarrow.flight as flight

from foresight.cluster.auth import connect
from foresight.cluster.membership import Cluster
from foresight.errors import NodeError
from foresight.replication.hint_client import set_replication_hints, wait_for_replicas
from foresight.replication.hints import METADATA, FileHint
from foresight.replication.replica_plan import DEFAULT_BASE_REPLICAS

log = logging.getLogger("foresight.replication.restore_schedule")


class HintedRestore:
    """The hint of one restart, sent in the background, and the order its ranks read in (see the module docstring).

    Args:
        checkpoint: ``<job>/...``; etcd, job, token: as
            :func:`~foresight.replication.hint_client.set_replication_hints`.
        hints: the hot files (e.g. :func:`~foresight.replication.hints.derive_dcp_hints`); may be set before start.
        reader: a :class:`~foresight.replication.hint_client.ReplicaReader` whose copy list is refreshed once the
            copies are registered (the ranks are told).
        ranks_per_host, cold_bytes, cold_reads, ttl_s: passed with the hint.
        timeout: longest wait for the copies; past it (or on any failure) the ranks read the base copies.
        depth: fetches in flight per copy of a hinted file while placement runs (see :meth:`order`).
        node: the node (location) to send the hint to and poll; default one live node at random. If it does not
            answer, the hint goes to the cluster (any live node).
        expect_s: how long the schedule holds hot fetches for a plan that is not back yet; once it is back, for
            its ``placement_cost_s`` (the cluster's measured placement time when longer than the configured).

    Attributes after :meth:`join`: ``plan`` (the node's plan), ``placed`` (its progress at the end), ``place_s``
    (hint sent -> ranks told), ``error`` (why the hint did not help, or None); ``stats``: ``fallbacks`` (the
    chosen node did not answer: the hint went to the cluster) and ``failures`` (the hint did not help: base copies).
    """

    def __init__(self, checkpoint: str, *, etcd: str, job: str, token: str, hints: Sequence[FileHint] = (),
                 reader: Any = None, ranks_per_host: int = 1, cold_bytes: int = 0, cold_reads: int = 0,
                 ttl_s: float = 600.0, timeout: float = 600.0, poll_s: float = 0.05, depth: int = 4,
                 node: str | None = None, expect_s: float = 1.0) -> None:
        self.checkpoint, self.etcd, self.job, self.token = checkpoint, etcd, job, token
        self.hints, self.reader, self.ranks_per_host = list(hints), reader, ranks_per_host
        self.cold_bytes, self.cold_reads, self.ttl_s = cold_bytes, cold_reads, ttl_s
        self.timeout, self.poll_s, self.node, self.expect_s = timeout, poll_s, node, expect_s
        self._plan_at: float | None = None
        self.planned = threading.Event()  # the plan is back (or the hint failed)
        self.ready = threading.Event()  # the plan's copies are registered and the reader told (or none, or failed)
        self.plan: dict | None = None
        self.placed: dict | None = None
        self.error: str | None = None
        self.place_s: float | None = None
        self.t0 = 0.0
        self.held_s = 0.0  # fetch time spent waiting for a slot, all fetches together
        self.depth = depth
        self._lock = threading.Lock()
        self._slots = threading.Condition(self._lock)
        self._inflight: dict[str, int] = {}
        self.peak: dict[str, int] = {}  # most fetches of each hinted file in flight at once through the slots
        self._hot_first = 0
        self._counts: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self.stats = {"fallbacks": 0, "failures": 0}

    # -- placement -------------------------------------------------------------------------------------------
    def start(self) -> "HintedRestore":
        """Send the hint now (from a thread of its own); the ranks may start reading at once."""
        self.t0 = time.perf_counter()
        try:
            self._count_copies()
        except NodeError as e:  # no list yet: the schedule assumes the base replication
            log.warning("no copy list for the schedule", extra={"checkpoint": self.checkpoint, "error": str(e)[:200]})
        self._thread = threading.Thread(target=self._run, name="hinted-restore", daemon=True)
        self._thread.start()
        return self

    def _coordinator(self) -> tuple[str | None, Any]:
        """One live node and one connection to it for the hint and its progress polls (a new etcd client and
        Flight channel per poll is time the restart waits for); (None, None): any node through etcd."""
        location = self.node
        if location is None:
            cluster = getattr(self.reader, "cluster", None) or Cluster(self.etcd)
            try:
                nodes = [r["location"] for r in cluster.nodes().values()]
            except NodeError:
                return None, None
            if not nodes:
                return None, None
            location = random.choice(nodes)
        try:
            return location, connect(location)
        except (flight.FlightError, OSError) as e:
            log.warning("could not connect to a node for the hint; asking the cluster",
                        extra={"node": location, "error": str(e)[:200]})
            self.stats["fallbacks"] += 1
            return None, None

    def _run(self) -> None:
        node, client = self._coordinator()
        try:
            args = dict(etcd=self.etcd, job=self.job, token=self.token)
            try:
                hint = dict(ttl_s=self.ttl_s, hints=self.hints, ranks_per_host=self.ranks_per_host,
                            cold_bytes=self.cold_bytes, cold_reads=self.cold_reads, copies_join=True)
                try:
                    self.plan = set_replication_hints(self.checkpoint, **args, **hint, node=node, client=client)
                except (flight.FlightUnavailableError, flight.FlightTimedOutError) as e:
                    if node is None:
                        raise
                    log.warning("the node chosen for the hint did not answer; asking the cluster",
                                extra={"node": node, "error": str(e)[:200]})
                    self.stats["fallbacks"] += 1
                    client.close()
                    node, client = None, None
                    self.plan = set_replication_hints(self.checkpoint, **args, **hint)
            finally:
                self._plan_at = time.perf_counter()
                self.planned.set()
            if self.plan.get("new_replicas"):
                self.placed = wait_for_replicas(self.checkpoint, **args, node=node, client=client,
                                                timeout=self.timeout, poll_s=self.poll_s)
                if self.reader is not None:
                    self.reader.copies(self.checkpoint, force=True)  # the ranks see the new copies
                    self._count_copies()
            self.place_s = time.perf_counter() - self.t0
        except Exception as e:  # the restart goes on from the base copies; said once, kept for the caller
            self.error = str(e)[:300]
            self.stats["failures"] += 1
            log.warning("replication hint did not help: reading the base copies",
                        extra={"checkpoint": self.checkpoint, "error": self.error})
        finally:
            self.planned.set()
            self.ready.set()
            with self._slots:
                self._slots.notify_all()  # placement over: every held fetch goes
            if client is not None:
                client.close()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 60)

    # -- the ranks' side -------------------------------------------------------------------------------------
    def order(self, files: Sequence[str], *, local_rank: int | None = None) -> list[str]:
        """``files`` in the schedule's order: ``.metadata`` first; then, while the hint's copies are being placed,
        the hinted files only for the ranks the existing copies have fetch slots for (``depth`` per copy, one
        fetch per ``ranks_per_host`` ranks), the cold files first for the others (by the time they reach the
        hinted files, the new copies take them). Once placement is over: the order given.

        With per-host sharing, give ``local_rank`` (the rank's index on its host): the host's one fetch of each hot
        file is local rank 0's (the budget then counts hosts), and the other ranks read their own cold files while
        it runs, instead of waiting for it, whether placement is over or not."""
        hinted = {h.path for h in self.hints}
        meta = [f for f in files if f == METADATA]
        hot = [f for f in files if f != METADATA and f in hinted]
        cold = [f for f in files if f != METADATA and f not in hinted]
        shared = local_rank is not None and self.ranks_per_host > 1
        if hot and shared and local_rank > 0:
            return meta + cold + hot
        if not hot or not self._placing():
            return meta + [f for f in files if f != METADATA]
        budget = self.depth * (1 if shared else self.ranks_per_host) * min(self._copies_now(f) for f in hot)
        with self._lock:
            first = self._hot_first < budget
            self._hot_first += first
        return meta + (hot + cold if first else cold + hot)

    def scheduled(self, reader: Any) -> "ScheduledReader":
        """``reader`` (a ReplicaReader) with the hinted files' fetches through this schedule's slots."""
        return ScheduledReader(self, reader)

    def _placing(self) -> bool:
        return self._gate_left() > 0

    def _gate_left(self) -> float:
        """Seconds the schedule still holds hot fetches for placement: until the copies are registered, but never
        past when they were expected (the plan's placement cost after the plan came back; ``expect_s`` after the
        hint was sent, while it is out): copies that run late do not hold the readers of the base copies."""
        if self._thread is None or self.ready.is_set():
            return 0.0
        plan, at = self.plan, self._plan_at
        if plan is None or at is None:
            return max(0.0, self.t0 + self.expect_s - time.perf_counter())
        return max(0.0, at + float(plan.get("placement_cost_s", self.expect_s)) - time.perf_counter())

    def _copies_now(self, file: str) -> int:
        return max(1, self._counts.get(file, DEFAULT_BASE_REPLICAS))

    def _count_copies(self) -> None:
        """The hinted files' copies in the reader's list (at the start, and once the new ones are registered)."""
        if self.reader is not None:
            listed = self.reader.copies(self.checkpoint)
            self._counts = {h.path: len(listed.get(h.path, {})) for h in self.hints}

    def _acquire(self, file: str) -> None:
        """A fetch slot for ``file``: at most ``depth`` fetches in flight per copy while placement runs (a deeper
        queue at the base copies would hold reads the new copies serve sooner); copies registered add slots."""
        t = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        with self._slots:  # woken by a release, or by the end of placement (notify_all)
            while self._placing() and self._inflight.get(file, 0) >= self.depth * self._copies_now(file):
                left = min(deadline - time.monotonic(), self._gate_left())
                if left <= 0:
                    break
                self._slots.wait(left)
            self._inflight[file] = self._inflight.get(file, 0) + 1
            self.peak[file] = max(self.peak.get(file, 0), self._inflight[file])
            self.held_s += time.perf_counter() - t

    def _release(self, file: str) -> None:
        with self._slots:
            self._inflight[file] -= 1
            self._slots.notify_all()  # waiters of other files share the condition


class ScheduledReader:
    """A ReplicaReader front whose hinted files (not ``.metadata``) are fetched through the schedule's slots;
    other reads and the copy list pass straight through (so a :class:`~foresight.replication.host_share.
    SharedReplicaReader` can sit on it: the host's one fetch takes the slot)."""

    def __init__(self, restore: HintedRestore, reader: Any) -> None:
        self.restore, self.reader = restore, reader

    def copies(self, checkpoint: str, **kwargs: Any) -> dict:
        return self.reader.copies(checkpoint, **kwargs)

    def read(self, checkpoint: str, file: str) -> bytes:
        r = self.restore
        if checkpoint != r.checkpoint or file == METADATA or not r._placing() or \
                file not in {h.path for h in r.hints}:
            return self.reader.read(checkpoint, file)
        r._acquire(file)
        try:
            return self.reader.read(checkpoint, file)
        finally:
            r._release(file)


__all__ = ["HintedRestore", "ScheduledReader"]
