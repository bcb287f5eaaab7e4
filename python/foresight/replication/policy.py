"""A job's replication policy: which checkpoints an evaluation site will read, and the hooks that ship them.

``Replication(every=1000, site="eval-b", node=..., job=...)`` is handed to the checkpoint writer, which calls
its hooks from its background thread: :meth:`Replication.data_started` when it creates a data file (its size
declared) and :meth:`Replication.data_progress` as its bytes are written (each unit leaves as soon as its bytes are
written, so the transfer overlaps the save; these calls go to the node on the policy's own background lane and
never block the writer), or :meth:`Replication.data_written` once a checkpoint's data files are on
disk (writers that do not report progress; the training site's node starts sending while the writer commits),
:meth:`Replication.committed` after the atomic commit (only now may the replica be published), and
:meth:`Replication.aborted` when the save failed (the partial replica is never published). Steps the schedule
does not name are not sent, unless :meth:`Replication.urgent` asks for one (an anomaly: evaluate now), which
also raises the priority of a transfer already in flight.

A replica is an extra: the hooks never raise. When the node cannot be reached (down, restarting), the hook logs a
warning, counts it in ``stats["hook_failures"]`` and keeps the step pending; pending steps are retried (started
from their committed directory, then committed) at the next hook, in :meth:`Replication.wait`, by
:meth:`Replication.retry_pending`, and every ``retry_every_s`` by a background thread.

The checkpoint directory must lie under the training site's node ``--root`` (the node reads the data files
itself and refuses paths outside its root); the replica's name is ``<job>/<directory name>``.

For ``torch.distributed.checkpoint``, :class:`ReplicatingStorageWriter` wraps foresight's DCP writer: each rank
declares its data file to the node as it creates it and reports its bytes as they are written (the units leave
during ``write_data``, as with the Checkpointer); the coordinator commits the replica once ``.metadata`` is in
place (``finish``), and the node adds any data file whose rank's call has not arrived by then.

The evaluation site may be a bucket (``site="s3://eval/replicas"``, no ``node``): the same hooks, the same units
and the same send-while-saving, but this process uploads each data file as a multipart upload whose parts end at
unit ends and publishes the checkpoint under ``<site>/<job>/`` with its marker last, after the commit
(:mod:`foresight.replication.bucket_site`). ``site`` names where the replica goes in both cases; a bucket needs no
node to send from, so ``node`` is left out rather than a second option added. ``keep`` and ``replica_ttl`` are
the bucket site's retention (a node site's replicas expire by its node's ``--replication-ttl``).

Example::

    rep = Replication(every=1000, site="eval-b", node="grpc://train-node:8815", job="llm-7b", importance=2.0)
    rep = Replication(every=1000, site="s3://eval/replicas", job="llm-7b")   # or: an evaluation site in a bucket
    ckpt = Checkpointer("/data/ckpt/llm-7b", replicate=rep)
    ...
    rep.urgent(step, severity=0.8)          # a loss spike: this step's evaluation jumps the queue
    rep.wait(step)                          # {"path": ..., "ready_at": ...}
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from foresight.bucket.objects import BucketPrefix
from foresight.bucket.url import BucketURL, is_bucket_url
from foresight.checkpoint import store
from foresight.checkpoint.dcp import ForesightStorageWriter, metadata_name
from foresight.errors import CheckpointError
from foresight.replication.bucket_site import RANK_WAIT_S, BucketSite
from foresight.replication.scheduler import priority_of
from foresight.replication.flight_calls import call, put_body
from foresight.replication.units import UNIT_BYTES, check_name, unit_ends
from foresight.replication.waits import TIMED_OUT

log = logging.getLogger("foresight.replicate")
RETRY_EVERY_S = 30.0  # a save whose replication could not be started is retried this often (in the background)


@dataclass
class Replication:
    """Replicate every ``every``-th step to ``site`` through the training site's node at ``node``, or, when
    ``site`` is a bucket URL (``s3://bucket/prefix``), straight from this process into ``<site>/<job>/``
    (:mod:`~foresight.replication.bucket_site`; no node: ``bucket_options`` go to its client,
    :class:`~foresight.bucket.objects.BucketPrefix`)."""

    every: int
    site: str
    node: str = ""
    job: str = ""
    importance: float = 1.0
    token: str = ""
    unit_bytes: int | None = None
    retry_every_s: float = RETRY_EVERY_S
    merge: dict[str, Any] | None = None  # the site merges units as they arrive: {"groups", "depth", "reshard"}
    bucket_options: dict[str, Any] | None = None  # a bucket site: BucketPrefix's options, retry, part_concurrency
    rank_wait_s: float = RANK_WAIT_S  # a bucket site: how long a DCP coordinator waits for another rank's parts
    keep: int | None = None  # a bucket site: the newest committed replicas kept (older ones deleted, marker first)
    replica_ttl: float | None = None  # a bucket site: seconds a replica is kept after its publish (never the newest)
    stats: dict[str, int] = field(default_factory=lambda: {"hook_failures": 0, "retried": 0}, repr=False)
    _pending: dict[int, str] = field(default_factory=dict, repr=False)  # step -> what the node still lacks
    _retry_thread: Any = field(default=None, repr=False)
    _ops: queue.Queue = field(default_factory=queue.Queue, repr=False)  # the background lane of node calls
    _lane: Any = field(default=None, repr=False)
    _progress: dict[int, dict[str, int]] = field(default_factory=dict, repr=False)  # latest, not yet sent
    _streamed: set[int] = field(default_factory=set, repr=False)  # steps announced by data_started
    _hook_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)  # hooks vs the retry thread
    _closed: threading.Event = field(default_factory=threading.Event, repr=False)
    _started: dict[int, str] = field(default_factory=dict, repr=False)
    _paths: dict[int, str] = field(default_factory=dict, repr=False)
    _sizes: dict[int, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _client: Any = field(default=None, repr=False)
    _site: Any = field(default=None, repr=False)  # the BucketSite of a bucket site (made on first use)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        check_name(self.job)
        if self.to_bucket:
            BucketURL.parse(self.site)  # a typo fails here, before any save
            try:  # so does an option the client does not take (a DCP writer's hooks would raise it mid-save)
                inspect.signature(BucketPrefix).bind(self.site, **(self.bucket_options or {}))
            except TypeError as e:
                takes = list(inspect.signature(BucketPrefix).parameters)[1:]
                raise ValueError(f"bucket_options: {e} (the bucket client takes {takes})") from e
            if self.merge is not None:
                raise ValueError("merge= needs an evaluation site's node; a bucket site keeps the checkpoint as saved")
            if self.keep is not None and self.keep < 1:
                raise ValueError(f"keep must be >= 1 or None, got {self.keep}")
            if self.replica_ttl is not None and self.replica_ttl < 0:
                raise ValueError(f"replica_ttl must be >= 0 seconds or None, got {self.replica_ttl}")
        elif self.keep is not None or self.replica_ttl is not None:
            raise ValueError("keep= and replica_ttl= are a bucket site's retention; a node site keeps its replicas "
                             "for its node's --replication-ttl")
        elif not self.node:
            raise ValueError(f"site {self.site!r} is reached through the training site's node: pass node=, or give "
                             "the site as a bucket URL (s3://bucket/prefix)")

    @property
    def to_bucket(self) -> bool:
        """Whether the evaluation site is a bucket (replicas sent from this process, no node)."""
        return is_bucket_url(self.site)

    def bucket_site(self) -> BucketSite:
        """The bucket site's sender (``<site>/<job>``), made on first use."""
        with self._lock:
            if self._site is None:
                self._site = BucketSite(f"{self.site.rstrip('/')}/{self.job}", unit_bytes=self.unit_bytes,
                                        bucket_options=self.bucket_options, rank_wait_s=self.rank_wait_s,
                                        keep=self.keep, replica_ttl=self.replica_ttl)
            return self._site

    def name(self, step: int, leaf: str | None = None) -> str:
        return f"{self.job}/{leaf or store.step_name(step)}"

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def progress_ends(self, size: int) -> list[int]:
        """Where a writer of a ``size``-byte data file reports progress (:meth:`data_progress`): at each transfer
        unit's end (:func:`~foresight.replication.units.unit_ends`: small units at the file's start and end), each
        4 KiB-aligned (direct I/O writes pieces that start aligned; a unit then leaves at the next report)."""
        ends = sorted({e - e % 4096 for e in unit_ends(size, int(self.unit_bytes or UNIT_BYTES))[:-1]} - {0})
        return [*ends, size] if size else []

    def _call(self, action: str, body: dict[str, Any], *, put: bytes | None = None) -> dict[str, Any]:
        """One action on the node (``put``: a ``DoPut action`` with this body instead, for a body of any size)."""
        from pyarrow import flight

        with self._lock:
            if self._client is None:
                self._client = flight.connect(self.node)
            client = self._client
        try:
            if put is not None:
                return put_body(client, action, {**body, "token": self.token}, put)
            return call(self.node, action, {**body, "token": self.token}, client=client)
        except flight.FlightError as e:
            if isinstance(e, flight.FlightUnavailableError):  # a fresh channel next time (no reconnect back-off)
                with self._lock:
                    if self._client is client:
                        self._client = None
                client.close()
            raise CheckpointError(f"replication {action} failed: {e}", node=self.node) from e

    def _priority(self, step: int, severity: float = 0.0) -> float:
        return priority_of(model_bytes=self._sizes.get(step, 0), importance=self.importance, severity=severity)

    # -- hooks called by the writer (never raise: a replica is an extra) --------------------------------
    def data_started(self, step: int, directory: str, files: list[tuple[str, int]], *,
                     leaf: str | None = None, shared: bool = False, layout: dict[str, Any] | None = None,
                     seq: int | None = None, save: str = "") -> None:
        """The writer created ``files`` (``[(name, size)]``) in ``directory`` and is writing them: their units
        leave as :meth:`data_progress` reports their bytes written (send while saving). Returns at once: the
        node calls go on a background lane, in order. ``shared``: other writers (the ranks of a DCP save) add
        their own files to the same checkpoint's transfer. ``layout`` (``rows``: the files' tensor chunks,
        ``files_expected``, ``meta``) lets a site asked to :attr:`merge` merge the units as they arrive.
        ``seq``: the commit sequence the save gets if it commits (a bucket site names the objects by it).
        ``save``: a DCP save's id, the same on every rank (a bucket site's abort record is named by it)."""
        self._sizes[step] = sum(int(n) for _, n in files)
        if not self.wants(step):
            return
        self.retry_pending()
        self._started[step] = self.name(step, leaf)
        self._streamed.add(step)
        for old in sorted(self._streamed)[:-8]:
            self._streamed.discard(old)
        if self.to_bucket:  # no node calls: the parts leave on the site's own threads as bytes are reported
            try:
                self.bucket_site().start(step, directory, files, seq=seq, save=save)
            except (OSError, ValueError) as e:  # the commit sends the committed directory whole
                self._failed("data_started", step, None, e)
            return
        self._submit("data_started", step, self._start_streaming, step, os.path.abspath(directory),
                     [[f, int(n)] for f, n in files], shared, layout)

    def _start_streaming(self, step: int, directory: str, files: list[list[Any]], shared: bool,
                         layout: dict[str, Any] | None) -> None:
        """The lane's start of a save still being written. A small save can commit (its temp directory renamed)
        before this call reaches the node, which then cannot open the files: not a failure, the commit sends
        the committed directory whole (one INFO line; the progress reports in between are dropped)."""
        try:
            self._start(step, directory, files, shared, layout)
        except CheckpointError:
            if os.path.isdir(directory):
                raise
            with self._lock:
                self._pending[step] = "start"
            log.info("replication: the save committed before its start reached the node; the commit sends it",
                     extra={"step": step, "node": self.node})

    def data_progress(self, step: int, written: dict[str, int]) -> None:
        """``written`` (``{file: bytes}``) of ``step``'s files are written: their units may leave. Returns at once;
        reports not yet sent are merged (only the latest counts)."""
        if step not in self._started:
            return
        if self.to_bucket:
            self.bucket_site().written(step, written)
            return
        with self._lock:
            first = step not in self._progress
            self._progress[step] = {**self._progress.get(step, {}), **written}
        if first:
            self._submit("data_progress", step, self._send_progress, step)

    def _send_progress(self, step: int) -> None:
        with self._lock:
            written = self._progress.pop(step, None)
            committed_first = self._pending.get(step) == "start"  # the commit sends the committed directory
        if written and not committed_first:
            self._call("replicate.written", {"name": self._started[step], "written": written})

    def _submit(self, hook: str, step: int, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._lane is None or not self._lane.is_alive():
                self._lane = threading.Thread(target=self._lane_loop, name="foresight-replication-lane", daemon=True)
                self._lane.start()
        self._ops.put((hook, step, fn, args))

    def _lane_loop(self) -> None:
        while True:
            hook, step, fn, args = self._ops.get()
            try:
                if fn is not None:
                    fn(*args)
            except CheckpointError as e:
                self._failed(hook, step, "start", e)  # the committed hook sends the whole directory
            finally:
                self._ops.task_done()
            if fn is None:
                return

    def _drain(self) -> None:
        """Wait until the background lane has made its calls (a commit must follow the starts it commits)."""
        if self._lane is not None:
            self._ops.join()

    def flush(self) -> None:
        """Wait until the calls the hooks queued are made. A rank of a DCP save calls it before handing its write
        results to the coordinator: its start, layout and progress then reach the node before the coordinator's
        commit can (else the commit could publish, and the site merge, without this rank's layout). A bucket
        site has no calls to wait for: the coordinator finds each rank's parts in the bucket."""
        if self.to_bucket:
            return
        self._drain()

    def data_written(self, step: int, directory: str, *, nbytes: int = 0, leaf: str | None = None) -> None:
        """The data files of ``step`` are written in ``directory`` (not yet committed)."""
        if step in self._streamed:
            return  # announced by data_started: its units are already leaving
        self._sizes[step] = nbytes
        if not self.wants(step):
            return
        self.retry_pending()
        name = self.name(step, leaf)
        self._started[step] = name
        if self.to_bucket:
            return  # the commit sends the committed directory
        try:
            self._start(step, os.path.abspath(directory))
        except CheckpointError as e:
            self._failed("data_written", step, "start", e)

    def committed(self, step: int, path: str) -> None:
        """``step`` is committed at ``path``: the replica may be published once its units arrived."""
        self._drain()
        self._paths[step] = os.path.abspath(path)
        for old in sorted(self._paths)[:-8]:  # remember a few recent steps for urgent evaluations
            del self._paths[old]
        with self._hook_lock:
            if step not in self._started:
                return
            if self.to_bucket:  # published on the site's thread; a failure comes back to _failed (then retried)
                self._pending.pop(step, None)
                self.bucket_site().publish(step, self._paths[step], on_error=functools.partial(
                    self._failed, "committed", step, "start"))
                return
            need = self._pending.get(step, "commit")
            try:
                if need == "start":  # the node missed the start (or lost it restarting): send the committed dir
                    try:
                        self._start(step, self._paths[step])
                    except CheckpointError as e:
                        if "already in progress" not in str(e):
                            raise  # else the node has it: committing is what it lacked
                self._call("replicate.commit", {"name": self._started[step], "path": self._paths[step]})
                self._pending.pop(step, None)
            except CheckpointError as e:
                self._failed("committed", step, need, e)

    def aborted(self, step: int) -> None:
        self._drain()
        name = self._started.pop(step, None)
        self._pending.pop(step, None)
        if name is not None and self.to_bucket:
            self.bucket_site().abort(step)  # its uploads aborted: nothing of it is ever visible
        elif name is not None:
            try:
                self._call("replicate.abort", {"name": name})
            except CheckpointError as e:  # the node never heard of it, or is down: nothing will be published
                self._failed("aborted", step, None, e)

    def _start(self, step: int, directory: str, files: list[list[Any]] | None = None, shared: bool = False,
               layout: dict[str, Any] | None = None) -> None:
        body = {"name": self._started[step], "src": directory, "site": self.site, "priority": self._priority(step),
                "unit_bytes": self.unit_bytes}
        if files is not None:  # still being written: units leave as their bytes are reported
            body.update(files=files, written={}, extend=shared)
        if self.merge is not None:  # without a layout the site merges at the commit, from the metadata
            body["merge"] = self.merge
        self._call("replicate.start", body)
        if self.merge is not None and layout is not None and files is not None:  # the chunks: any size
            self._call("replicate.layout", {"name": self._started[step]},
                       put=json.dumps({**layout, "files": [f for f, _ in files]}).encode())

    def _failed(self, hook: str, step: int, need: str | None, e: Exception) -> None:
        """Report a hook the node did not take (log line + ``stats``); keep the step for a later retry."""
        with self._lock:
            self.stats["hook_failures"] += 1
            if need is not None:
                self._pending[step] = need
        log.warning("replication hook failed; the save goes on, the replica will be retried",
                    extra={"hook": hook, "step": step, "node": self.node or self.site, "error": str(e)[:300]})
        if need is not None:
            self._ensure_retry_thread()

    def retry_pending(self) -> int:
        """Retry the steps the node missed (committed ones are started and committed again); returns how many
        are still pending."""
        with self._hook_lock:
            for step in sorted(self._pending):
                path = self._paths.get(step)
                if path is None:
                    continue  # not committed yet: its ``committed`` hook starts it
                self._pending[step] = "start"  # the node may have restarted and lost the transfer: send it whole
                with self._lock:
                    self.stats["retried"] += 1
                self.committed(step, path)
            return len(self._pending)

    def _ensure_retry_thread(self) -> None:
        with self._lock:
            if self._retry_thread is not None and self._retry_thread.is_alive():
                return
            self._retry_thread = threading.Thread(target=self._retry_loop, name="foresight-replication-retry",
                                                  daemon=True)
            self._retry_thread.start()

    def _retry_loop(self) -> None:
        while not self._closed.wait(self.retry_every_s):
            if not self.retry_pending():
                return

    # -- API for the training loop ---------------------------------------------------------------
    def urgent(self, step: int, severity: float = 1.0) -> str:
        """Evaluate ``step`` now: raise its transfer's priority, or start one for an unscheduled committed step."""
        prio = self._priority(step, severity)
        name = self._started.get(step)
        if self.to_bucket:  # its parts and publish go ahead of the other steps'; an unscheduled step is sent whole
            self.bucket_site().urgent(step)
            if name is None:
                path = self._paths.get(step)
                if path is None:
                    raise CheckpointError("step is not committed here (or too old to evaluate urgently)", step=step)
                name = self._started[step] = self.name(step, os.path.basename(path))
                self.committed(step, path)
            return name
        if name is not None:
            self._call("replicate.urgent", {"name": name, "priority": prio})
            return name
        path = self._paths.get(step)
        if path is None:
            raise CheckpointError("step is not committed here (or too old to evaluate urgently)", step=step)
        name = self.name(step, os.path.basename(path))
        self._call("replicate.start", {"name": name, "src": path, "site": self.site, "priority": prio,
                                       "unit_bytes": self.unit_bytes})
        self._started[step] = name
        self._call("replicate.commit", {"name": name, "path": path})
        self._pending.pop(step, None)
        return name

    def wait(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        """Block until ``step``'s replica is published; returns where and when."""
        name = self._started.get(step)
        if name is None:
            raise CheckpointError("step is not being replicated", step=step)
        if step in self._pending:
            self.retry_pending()
        if self.to_bucket:
            return self.bucket_site().wait(step, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # the node caps each call (--replication-max-wait-s): ask again until our own timeout
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return self._call("replicate.wait", {"name": name, "timeout": left})
            except CheckpointError as e:
                capped = TIMED_OUT in str(e) and "max_wait_s=" in str(e)
                if not capped or (deadline is not None and time.monotonic() >= deadline):
                    raise

    def close(self) -> None:
        self._closed.set()
        if self._lane is not None and self._lane.is_alive():
            self._ops.put(("close", -1, None, ()))
            self._lane.join(30)
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            site, self._site = self._site, None
        if site is not None:  # after the parts reported and the publishes queued
            site.close()


@functools.cache
def _dcp_writer_class() -> type:
    import torch.distributed
    class ReplicatingStorageWriter(ForesightStorageWriter):
        """:class:`~foresight.checkpoint.dcp.ForesightStorageWriter` that replicates per a :class:`Replication`.

        ``step`` names the checkpoint for the schedule; the replica's name is ``<job>/<directory name>``.
        """

        def __init__(self, path: str | os.PathLike, *, replicate: Replication, step: int, **kwargs: Any) -> None:
            super().__init__(path, **kwargs)
            if self.in_bucket:  # the replication node reads the checkpoint's local files
                raise ValueError(f"a replicated DCP checkpoint is written to a local directory, not {self.path}: "
                                 "give the bucket as drain_to=")
            self.replicate, self.step = replicate, step
            self._plan_save = ""  # the coordinator's id of this save, from the global plan (every rank's the same)
            self._unsettled: tuple[int, str] | None = None  # (step, path) of a save neither committed nor aborted

        def write_data(self, plan: Any, planner: Any) -> Any:
            # ranks of one save share the coordinator's id: a bucket site's abort record (no other rank: none)
            self._plan_save = (getattr(plan.storage_data, "save", "") or "") if (self._world() or 1) > 1 else ""
            self._unsettled = (self.step, self.path)
            try:
                return super().write_data(plan, planner)
            except BaseException:  # KeyboardInterrupt too: the parts already sent must not stay open uploads
                self._abort_unsettled()
                raise

        def _abort_unsettled(self) -> None:
            """End the replication of the save this writer started and no hook ended (its uploads aborted)."""
            if self._unsettled is not None:
                step, _ = self._unsettled
                self._unsettled = None
                self.replicate.aborted(step)

        def _settle_earlier(self) -> None:
            """A save that failed after its data was written but before ``finish`` (another rank failed, an
            interrupt between DCP's steps: DCP tells the writer nothing) is found here, at the next save or at
            close: no metadata in its directory means it never committed, so its replication is aborted."""
            if self._unsettled is not None:
                _, path = self._unsettled
                name = metadata_name(None if self.use_collectives else self.rank)
                if os.path.exists(os.path.join(path, name)):
                    self._unsettled = None  # committed (by the coordinator, for another rank's writer)
                else:
                    self._abort_unsettled()

        def reset(self, checkpoint_id: Any = None) -> None:
            self._settle_earlier()
            super().reset(checkpoint_id)

        def close(self) -> None:
            self._settle_earlier()
            super().close()

        def _world(self) -> int | None:
            return (torch.distributed.get_world_size() if self.use_collectives and
                    torch.distributed.is_available() and torch.distributed.is_initialized() else None)

        def _write_file(self, fio: Any, fd: int, view: memoryview, path: str) -> None:
            """This rank's data file in pieces ending where its units end, each reported as it lands: its units leave
            while the rest is written and while the other ranks write theirs (send while saving). The hooks
            never raise and return at once (the node calls go on the policy's background lane)."""
            total = len(view)
            ends = self.replicate.progress_ends(total) if self.replicate.wants(self.step) else []
            if not ends:
                super()._write_file(fio, fd, view, path)
                return
            name, leaf = os.path.basename(path), os.path.basename(os.path.normpath(self.path))
            layout = None
            if self.replicate.merge is not None:  # the site merges as units arrive: it needs the chunks first
                layout = {"rows": self._layout_rows, "files_expected": self._world(),
                          "meta": {"source_format": "dcp"}}
            self.replicate.data_started(self.step, self.path, [(name, total)], leaf=leaf, shared=True,
                                        layout=layout, save=self._plan_save)
            fio.write_reporting(fd, view, ends, lambda end: self.replicate.data_progress(self.step, {name: end}),
                                path=path)
            self.replicate.flush()  # before the results go to the coordinator, whose commit must follow our calls

        def finish(self, metadata: Any, results: Any) -> None:
            # the hooks never raise: a replication node that is down never fails the save (see Replication)
            leaf = os.path.basename(os.path.normpath(self.path))
            nbytes = sum(wr.size_in_bytes for wrs in results for wr in wrs)
            self.replicate.data_written(self.step, self.path, nbytes=nbytes, leaf=leaf)
            self._unsettled = None
            try:
                super().finish(metadata, results)
            except BaseException:
                self.replicate.aborted(self.step)
                raise
            self.replicate.committed(self.step, self.path)

    return ReplicatingStorageWriter


def __getattr__(name: str) -> Any:  # the DCP writer imports torch.distributed: only on use
    if name == "ReplicatingStorageWriter":
        return _dcp_writer_class()
    raise AttributeError(name)
