"""A restart's read schedule around its replication hint: no rank waits for placement, every copy joins the reads
as soon as it is registered.

Sending a hint and waiting for its copies before the ranks start puts the placement (one planning call, then the
copies) on the restart's clock. :class:`HintedRestore` sends the hint from a thread of its own the moment the
restart is declared (one node, one connection for the hint and its progress polls) and lets the ranks start at once:

* :meth:`HintedRestore.order`: ``.metadata`` first (a rank needs it to plan its reads); then, while the copies are
  placed, every rank reads its cold files (its own shards, spread over every node) before the hinted (hot) ones, so
  placement runs behind the cold reads and the hot reads find the new copies; with per-host sharing a host's ranks
  other than local rank 0 (which fetches for the host) always read their own files first. Nobody is held: a rank
  that reaches a hot file before its copies land reads the copies that exist.
* :class:`ScheduledReader` (:meth:`HintedRestore.scheduled`): admission, not a hold. While placement runs, a hot
  fetch goes when fewer than ``depth`` fetches of the file are in flight per listed copy, else it waits for one to
  end or a copy to join: a node serves its reads in arrival order, so a fetch sent to a base copy's full queue
  would wait there even after new copies land (with 512 ranks reading a file on 3 copies, each queue holds ~170
  reads); waiting here, it goes to whichever copy frees first, new ones included.
* while placement runs, the node that took the hint is asked for its progress every ``poll_s`` over the hint's
  connection; the reply carries the hinted files' copy records, which go into the reader's list
  (:meth:`~foresight.replication.hint_client.ReplicaReader.merge_files`), so each copy takes readers the moment it is
  registered, not when the last one is. (When the hint went to the cluster instead, the list is re-read from etcd:
  a range per hot file, :meth:`~foresight.replication.hint_client.ReplicaReader.refresh_files`.)

Placement is over when every planned copy is listed (or the plan places none, or the node reports every task done or
failed, or a failure: logged, the base copies serve); then every rank reads in its own order. The hint says the
ranks are not held (``copies_join``) and how much they read besides (``cold_bytes``, ``cold_reads``), so the
planner sizes the copies for the restore's finish (:func:`~foresight.replication.replica_plan.paying_replicas`).
A hint costs time at worst, never a byte.

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
from foresight.replication.hint_client import replication_progress, set_replication_hints
from foresight.replication.hints import METADATA, FileHint

log = logging.getLogger("foresight.replication.restore_schedule")


class HintedRestore:
    """The hint of one restart, sent in the background, and the order its ranks read in (see the module docstring).

    Args:
        checkpoint: ``<job>/...``; etcd, job, token: as
            :func:`~foresight.replication.hint_client.set_replication_hints`.
        hints: the hot files (e.g. :func:`~foresight.replication.hints.derive_dcp_hints`); may be set before start.
        reader: a :class:`~foresight.replication.hint_client.ReplicaReader` whose list of the hinted files' copies
            is kept current while the copies are placed (the ranks are told of each one as it lands).
        ranks_per_host, cold_bytes, cold_reads, ttl_s: passed with the hint.
        timeout: longest wait for the copies; past it (or on any failure) the ranks read the copies that exist.
        poll_s: how often the node is asked for its progress (the copies' records with it) while placement runs;
            progress_s: without the hint's connection, how often a node is asked for the tasks' progress while the
            copies' list is re-read from etcd every ``poll_s`` (failed copies end the wait).
        node: the node (location) to send the hint to and poll; default one live node at random. If it does not
            answer, the hint goes to the cluster (any live node).
        depth: hot fetches in flight per listed copy while placement runs (:class:`ScheduledReader`).

    Attributes after :meth:`join`: ``plan`` (the node's plan), ``placed`` (its progress once every copy was
    listed; asked after the ranks were told, it also folds the placement's time into the cluster's mean), ``place_s`` (hint sent -> every planned copy listed for the ranks), ``joined_s``
    (hint sent -> each new copy first listed), ``error`` (why the hint did not help, or None); ``stats``:
    ``fallbacks`` (the chosen node did not answer: the hint went to the cluster), ``failures`` (the hint did not
    help: base copies), ``polls`` (list re-reads while placing).
    """

    def __init__(self, checkpoint: str, *, etcd: str, job: str, token: str, hints: Sequence[FileHint] = (),
                 reader: Any = None, ranks_per_host: int = 1, cold_bytes: int = 0, cold_reads: int = 0,
                 ttl_s: float = 600.0, timeout: float = 600.0, poll_s: float = 0.05, progress_s: float = 0.5,
                 node: str | None = None, depth: int = 4) -> None:
        self.checkpoint, self.etcd, self.job, self.token = checkpoint, etcd, job, token
        self.hints, self.reader, self.ranks_per_host = list(hints), reader, ranks_per_host
        self.cold_bytes, self.cold_reads, self.ttl_s = cold_bytes, cold_reads, ttl_s
        self.timeout, self.poll_s, self.progress_s, self.node = timeout, poll_s, progress_s, node
        self.planned = threading.Event()  # the plan is back (or the hint failed)
        self.ready = threading.Event()  # every planned copy is listed for the ranks (or none, or failed)
        self.plan: dict | None = None
        self.placed: dict | None = None
        self.error: str | None = None
        self.place_s: float | None = None
        self.joined_s: list[float] = []
        self.t0 = 0.0
        self._thread: threading.Thread | None = None
        self.stats = {"fallbacks": 0, "failures": 0, "polls": 0}
        self.depth = depth
        self._slots = threading.Condition()
        self._inflight: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # listed copies of each hinted file (updated as copies join)
        self.peak: dict[str, int] = {}  # most fetches of each hinted file in flight at once through the slots
        self.held_s = 0.0  # fetch time spent waiting for a slot, all fetches together

    # -- placement -------------------------------------------------------------------------------------------
    def start(self) -> "HintedRestore":
        """Send the hint now (from a thread of its own); the ranks may start reading at once."""
        self.t0 = time.perf_counter()
        if self.reader is not None:
            try:
                self._count(self.reader.copies(self.checkpoint))
            except NodeError as e:  # no list yet: slots assume the base replication
                log.warning("no copy list for the schedule",
                            extra={"checkpoint": self.checkpoint, "error": str(e)[:200]})
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
                self.planned.set()
            if self.plan.get("new_replicas"):
                self._join_copies(node, client, args)
                self.place_s = time.perf_counter() - self.t0
                self.ready.set()  # the ranks read in their own order now
                with self._slots:
                    self._slots.notify_all()
                if self.placed is None:  # the node's account of it (and its placement time into the cluster's mean)
                    self.placed = replication_progress(self.checkpoint, **args, node=node, client=client)
            self.place_s = self.place_s if self.place_s is not None else time.perf_counter() - self.t0
        except Exception as e:  # the restart goes on from the copies that exist; said once, kept for the caller
            self.error = str(e)[:300]
            self.stats["failures"] += 1
            log.warning("replication hint did not help: reading the copies that exist",
                        extra={"checkpoint": self.checkpoint, "error": self.error})
        finally:
            self.planned.set()
            self.ready.set()
            with self._slots:
                self._slots.notify_all()  # placement over: every waiting fetch goes
            if client is not None:
                client.close()

    def _join_copies(self, node: str | None, client: Any, args: dict) -> None:
        """Until every planned copy is listed: every ``poll_s`` ask the node that took the hint for its progress,
        which carries the hinted files' copy records (one Flight call on the connection the hint went over: the
        restoring process's threads compete for its interpreter, and a Flight call runs in C++ where an etcd
        request runs in Python), and give them to the reader (each copy joins the reads as it lands). Without that
        connection (the hint went to the cluster) re-read the copies from etcd every ``poll_s`` and ask a node for
        the progress every ``progress_s``. Over when the tasks are (failed copies never appear); an error when the
        hint is gone."""
        want = {(f["path"], n) for f in self.plan.get("files", []) for n in f.get("new_nodes", [])}
        files = sorted({f for f, _ in want})
        seen: set[tuple[str, str]] = set()
        deadline = time.monotonic() + self.timeout
        asked = time.monotonic()
        while True:
            p = None
            if self.reader is not None:
                if client is not None:  # the node that took the hint lists the copies placed: no etcd reads here
                    p = replication_progress(self.checkpoint, **args, node=node, client=client)
                    records = p.get("records", {})
                    listed = self.reader.merge_files(self.checkpoint, {f: records.get(f, {}) for f in files})
                else:
                    listed = self.reader.refresh_files(self.checkpoint, files)
                if self._joined(listed, want, seen) == want:
                    return
            if p is None and (self.reader is None or time.monotonic() - asked >= self.progress_s):
                asked = time.monotonic()
                p = replication_progress(self.checkpoint, **args, node=node, client=client)
                if p["complete"] and self.reader is not None:  # the last copies registered since the list was read
                    self._joined(self.reader.refresh_files(self.checkpoint, files), want, seen)  # join too
            if p is not None:
                if p["complete"]:
                    self.placed = p
                    return
                if not p["hint_live"]:
                    raise NodeError("no live hint for the checkpoint (expired or released before its copies were "
                                    "placed)", checkpoint=self.checkpoint, done=p["done"])
            if time.monotonic() > deadline:
                raise NodeError("replicas not placed in time", checkpoint=self.checkpoint, timeout=self.timeout,
                                listed=len(seen), planned=len(want))
            time.sleep(self.poll_s)

    def _joined(self, listed: dict, want: set[tuple[str, str]], seen: set[tuple[str, str]]) -> set:
        """The hinted files' copies as just listed: the slots follow them, each planned copy first listed now is
        timed into ``joined_s`` and added to ``seen`` (returned)."""
        self.stats["polls"] += 1
        self._count(listed)
        new = {(f, n) for f, n in want if n in listed.get(f, {})} - seen
        self.joined_s += [time.perf_counter() - self.t0] * len(new)
        seen |= new
        return seen

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 60)

    # -- the ranks' side -------------------------------------------------------------------------------------
    def order(self, files: Sequence[str], *, local_rank: int | None = None) -> list[str]:
        """``files`` in the schedule's order: ``.metadata`` first; then, while the hint's copies are being placed,
        the cold files before the hinted ones (placement runs behind the cold reads). Once placement is over: the
        order given.

        With per-host sharing, give ``local_rank`` (the rank's index on its host): the host's one fetch of each hot
        file is local rank 0's, and the other ranks read their own cold files while it runs, instead of waiting
        for it, whether placement is over or not."""
        hinted = {h.path for h in self.hints}
        meta = [f for f in files if f == METADATA]
        hot = [f for f in files if f != METADATA and f in hinted]
        cold = [f for f in files if f != METADATA and f not in hinted]
        shared = local_rank is not None and self.ranks_per_host > 1
        if hot and (self.placing or (shared and local_rank > 0)):
            return meta + cold + hot
        return meta + [f for f in files if f != METADATA]

    def scheduled(self, reader: Any) -> "ScheduledReader":
        """``reader`` (a ReplicaReader) with the hinted files' fetches admitted through this schedule's slots."""
        return ScheduledReader(self, reader)

    def _count(self, listed: dict) -> None:
        """The hinted files' listed copies (the slots per file), waking fetches a new copy has room for."""
        with self._slots:
            self._counts = {h.path: len(listed.get(h.path, {})) for h in self.hints}
            self._slots.notify_all()

    def _acquire(self, file: str) -> None:
        """A fetch slot for ``file``: at most ``depth`` fetches in flight per listed copy while placement runs."""
        t = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        with self._slots:
            while self.placing and self._inflight.get(file, 0) >= self.depth * max(1, self._counts.get(file, 1)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._slots.wait(min(left, self.poll_s * 4))
            self._inflight[file] = self._inflight.get(file, 0) + 1
            self.peak[file] = max(self.peak.get(file, 0), self._inflight[file])
            self.held_s += time.perf_counter() - t

    def _release(self, file: str) -> None:
        with self._slots:
            self._inflight[file] -= 1
            self._slots.notify_all()

    @property
    def placing(self) -> bool:
        """The hint was sent and its copies are not all listed yet (nor has it failed)."""
        return self._thread is not None and not self.ready.is_set()


class ScheduledReader:
    """A ReplicaReader front whose hinted files (not ``.metadata``) are fetched through the schedule's slots while
    placement runs; other reads and the copy list pass straight through (a :class:`~foresight.replication.
    host_share.SharedReplicaReader` can sit on it: the host's one fetch takes the slot)."""

    def __init__(self, restore: HintedRestore, reader: Any) -> None:
        self.restore, self.reader = restore, reader

    def copies(self, checkpoint: str, **kwargs: Any) -> dict:
        return self.reader.copies(checkpoint, **kwargs)

    def read(self, checkpoint: str, file: str) -> bytes:
        r = self.restore
        if checkpoint != r.checkpoint or file == METADATA or not r.placing or \
                file not in {h.path for h in r.hints}:
            return self.reader.read(checkpoint, file)
        r._acquire(file)
        try:
            return self.reader.read(checkpoint, file)
        finally:
            r._release(file)


__all__ = ["HintedRestore", "ScheduledReader"]
