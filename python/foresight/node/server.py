"""The storage-node daemon: an Arrow Flight server that prepares each job's coming steps next to the data.

A job registers once (datasets and plan by name under the node's data root, plan digest, rank and world size, the
decode stage's transform specs and seed, the step it is on) and then only reports progress; the node resolves the
coming steps from the plan itself and keeps ``lead`` steps of its part decoded ahead (:mod:`foresight.node.queue`).
``DoGet`` streams a step's part as Arrow record batches; when the CPU guard is engaged the part is raw sample bytes
(marked ``raw``) that the client decodes with the same spec. See :mod:`foresight.node.protocol` for the messages.

Extending: ``server.register_action(name, decoder, handler, job_scoped=True)`` adds a ``DoAction``;
``server.register_put(kind, handler)`` adds a ``DoPut`` whose descriptor path starts with ``kind`` (checkpoint
replication plugs in here). Job-scoped handlers run only after the job's token was checked.

This module is the Flight server core (options, the action/DoGet/DoPut registries and entry points, stepping a
job's queue, shutdown); the built-in job actions and the job registry are :mod:`foresight.node.job_actions`, the
counting and cancelling of streams in flight :mod:`foresight.node.stream_drain`.

Example::

    with NodeServer("/data", location="grpc://127.0.0.1:0", cpu_threshold=80) as node:
        print(node.location)          # grpc://127.0.0.1:PORT
        node.wait_stopped()           # or node.stop() from a signal handler
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable

import pyarrow.flight as flight

# the decode stack, imported with the server so that a job's first registration does not pay for it (and time out)
import foresight.loader  # noqa: F401
import foresight.media  # noqa: F401
from foresight.bucket import BucketDataset, RetryPolicy, is_bucket_url
from foresight.bucket.opener import open_dataset
from foresight.cluster.auth import Admission, HeaderMiddlewareFactory, check_admin, read_pem
from foresight.cluster.metrics import NodeMetrics
from foresight.errors import ForesightError, NodeError, ProtocolError
from foresight.io import IOEngine
from foresight.node.engines import EnginePool
from foresight.node.guard import CpuGuard
from foresight.node.job_actions import JobActions
from foresight.node.bucket_root import BucketRootIndex, JobPrefetch
from foresight.node.jobs import NodeJob, resolve_under
from foresight.node.limits import WorkLimits
from foresight.node.protocol import (
    ACTION_DECODERS,
    MAX_MESSAGE_BYTES,
    decode_action,
    decode_ticket,
    parse_request,
)
from foresight.node.queue import Scheduler
from foresight.node.root_index import RootIndex, scan_root
from foresight.node.stream_drain import (CANCEL_WAIT_S, DEFAULT_SHUTDOWN_GRACE_S, CountedStream, InFlightStreams,
                                         cut_connections)
from foresight.plan import load_plan

log = logging.getLogger("foresight.node")


class NodeServer(JobActions, flight.FlightServerBase):
    """See the module docstring. Keyword-only options.

    Args:
        root: the data root; every dataset and plan name resolves inside it (names escaping it are refused). Or
            ``s3://bucket/prefix``: datasets in a bucket, read through ``cache_dir`` (see
            :mod:`foresight.node.bucket_root`); plans uploaded by clients are kept in the cache directory.
        cache_dir: the bucket root's local cache (node-local NVMe; default ``$FORESIGHT_BUCKET_CACHE``).
        cache_budget: bytes each bucket dataset's cache may hold (None: never evict); over it, each job's
            prefetcher evicts what its plan needs furthest in the future.
        cache_lookahead: steps past the last step the node read that a job's prefetcher fetches ahead.
        bucket_options: obstore S3 config keys over the standard ``AWS_*`` places; bucket_retry: the retry budget.
        location: ``grpc://host:port`` or ``grpc+tls://host:port`` (port 0 picks one; see :attr:`location`).
        tls: (certificate chain PEM path, private key PEM path) for ``grpc+tls``.
        client_ca: CA PEM path; when given, clients must present a certificate it signed (mutual TLS).
        node_id: name in the cluster (default: host-port).
        max_jobs: jobs registered at once; max_queue_bytes: cap of any job's queue; max_lead: cap of its lead.
        cpu_threshold: CPU percent (sustained) above which the node serves raw bytes (default 80; 0 = always raw).
        cpu_measure: whose CPU that is: ``process`` (the node's process tree, default), ``cgroup`` or ``machine``
            (see :mod:`foresight.node.guard`).
        decode_threads: threads of each job's decode pool (default: CPU count); workers: step-preparing threads.
        served_shards: ``fingerprint -> shard list or None (all)``; the cluster's placement when in a cluster.
        job_idle_s: a job not heard from for this long is dropped (frees its slot and memory).
        max_plan_bytes: largest plan accepted by upload (``DoPut ["plan", digest]``, kept under ``root/.uploads``).
        limits: caps on a job's output per sample and per step part and on its decode memory, checked from its
            specs at registration (:class:`~foresight.node.limits.WorkLimits`; default: its defaults).
        rescan_s: how often the root is rescanned for datasets added, removed or repacked (0: only when a job
            registers a dataset the node does not know or whose manifest changed); a job whose dataset changed
            is refused from then on (:mod:`foresight.node.root_index`).
        shutdown_grace_s: on :meth:`stop`, how long streams in flight may run on (new calls are refused meanwhile);
            then they are cancelled: :meth:`stop` returns within ``shutdown_grace_s + CANCEL_WAIT_S``.
        admission: ``"open"`` (a job without an issued token is bound by its first caller's token) or ``"issued"``
            (only tokens issued in the cluster admit); issued_tokens: ``job -> sha256 of its issued token or None``
            (:meth:`Cluster.job_token_digest`); see :class:`~foresight.cluster.auth.Admission`.
        max_jobs_per_caller: distinct jobs one caller may have registered at once (default ``max_jobs // 2``).
        admin_token: what the operator actions (``status``, ``replicas.stats``) need in the token header; empty:
            they are answered to callers on this host only (:func:`~foresight.cluster.auth.check_admin`).
            ``health`` (liveness, what the node advertises in etcd anyway) needs nothing.
    """

    def __init__(self, root: str, *, location: str = "grpc://127.0.0.1:0", tls: tuple[str, str] | None = None,
                 client_ca: str | None = None, node_id: str | None = None, max_jobs: int = 8,
                 max_queue_bytes: int = 1 << 30, max_lead: int = 8, cpu_threshold: float = 80.0,
                 guard_interval: float = 0.5, decode_threads: int | None = None, workers: int = 1,
                 served_shards: Callable[[str], Any] | None = None, job_idle_s: float = 600.0,
                 max_plan_bytes: int = 256 << 20, limits: WorkLimits | None = None, rescan_s: float = 10.0,
                 shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, admission: str = "open",
                 issued_tokens: Callable[[str], str | None] | None = None, max_jobs_per_caller: int | None = None,
                 cpu_measure: str = "process", cache_dir: str | None = None, cache_budget: int | None = None,
                 cache_lookahead: int = 8, bucket_options: dict[str, Any] | None = None,
                 bucket_retry: RetryPolicy = RetryPolicy(), admin_token: str = "") -> None:
        if is_bucket_url(root):  # checked before the port is bound: a bad bucket or bad keys never serve
            cache_dir = cache_dir or os.environ.get("FORESIGHT_BUCKET_CACHE")
            if not cache_dir:
                raise NodeError("a bucket root is read through a local cache: give --cache-dir (or set "
                                "FORESIGHT_BUCKET_CACHE)", root=root)
            self.index: RootIndex = BucketRootIndex(root, cache_dir, options=bucket_options, retry=bucket_retry)
        elif cache_dir is not None or cache_budget is not None:
            raise NodeError("--cache-dir and --cache-budget apply to an s3:// root only", root=root)
        elif not os.path.isdir(root):
            raise NodeError("data root is not a directory", root=root)
        else:
            self.index = RootIndex(root)
        self.bucket = self.index.url if isinstance(self.index, BucketRootIndex) else None
        self.cache_budget = cache_budget
        self.cache_lookahead = int(cache_lookahead)
        kwargs: dict[str, Any] = {"middleware": {"auth": HeaderMiddlewareFactory()}}
        if tls is not None:
            kwargs["tls_certificates"] = [flight.CertKeyPair(cert=read_pem(tls[0]), key=read_pem(tls[1]))]
        if client_ca is not None:
            kwargs["verify_client"] = True
            kwargs["root_certificates"] = read_pem(client_ca)
        super().__init__(location, **kwargs)
        scheme, _, rest = location.partition("://")
        self.location = f"{scheme}://{rest.rsplit(':', 1)[0]}:{self.port}"
        self.root = self.index.root  # a bucket root's local side: its cache directory
        self.node_id = node_id or f"{os.uname().nodename}-{self.port}"
        self.instance = f"{os.getpid()}-{time.time_ns()}"  # changes on restart: clients re-register
        self.max_jobs, self.max_queue_bytes, self.max_lead = int(max_jobs), int(max_queue_bytes), int(max_lead)
        self.admission = Admission(admission, issued=issued_tokens)
        self.admin_token = admin_token
        self.max_jobs_per_caller = max(1, self.max_jobs // 2 if max_jobs_per_caller is None else max_jobs_per_caller)
        self._callers: dict[str, tuple[str, str]] = {}  # node job id -> (caller, cluster job)
        self.decode_threads = decode_threads
        self.job_idle_s = float(job_idle_s)
        self.max_plan_bytes = int(max_plan_bytes)
        self.limits = limits or WorkLimits()
        self.served_shards = served_shards or (lambda fingerprint: None)
        self.metrics = NodeMetrics()
        self.guard = CpuGuard(cpu_threshold, interval=guard_interval, measure=cpu_measure).start()
        self.rescan_s = float(rescan_s)
        self._last_scan = time.monotonic()
        self._jobs: dict[str, NodeJob] = {}
        self._jobs_lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._opened: dict[tuple[str, str], Any] = {}
        self._open_lock = threading.Lock()
        self._engines = EnginePool(lambda: IOEngine(queue_depth=64))  # for steps prepared on call threads
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self.shutdown_grace_s = float(shutdown_grace_s)
        self._inflight = InFlightStreams()
        self._actions: dict[str, tuple[Callable, Callable, bool, int]] = {}
        self._puts: dict[str, Callable] = {}
        self._gets: dict[str, Callable] = {}
        for name, handler, scoped in (("health", self._health, False), ("status", self._status, False),
                                      ("register_job", self._register_job, False),
                                      ("progress", self._progress, True), ("unregister_job", self._unregister, True)):
            self.register_action(name, ACTION_DECODERS[name], handler, job_scoped=scoped)
        self.register_put("plan", self._put_plan)
        # each worker opens an engine and closes it when it ends (Scheduler.close joins them)
        self.scheduler = Scheduler(self._produce, workers=workers, engine_factory=lambda: IOEngine(queue_depth=64),
                                   on_change=self._queue_metrics)
        self._janitor = threading.Thread(target=self._janitor_loop, name="foresight-node-janitor", daemon=True)
        self._janitor.start()
        log.info("node serving", extra={"node": self.node_id, "location": self.location,
                                        "root": str(self.bucket or self.root),
                                        "datasets": len(self.datasets), "plans": len(self.plans),
                                        "cpu_threshold": cpu_threshold, "cpu_measure": cpu_measure})

    @property
    def datasets(self) -> dict[str, dict]:
        """``{name: {fingerprint, shards}}`` under the root as of the last scan (advertised in etcd and health)."""
        return self.index.datasets

    @property
    def plans(self) -> dict[str, str]:
        return self.index.plans

    # -- extension points -------------------------------------------------------------------------------------
    def register_action(self, name: str, decoder: Callable[[dict], dict], handler: Callable[[Any, dict], Any],
                        *, job_scoped: bool = True, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        """Add a ``DoAction``: ``decoder(json_object) -> request`` (raise ProtocolError), ``handler(context,
        request) -> JSON-able result``. Job-scoped requests must name ``job``; its token is checked first.
        ``max_bytes``: the largest body taken (an action that lists thousands of files needs more than the
        default)."""
        self._actions[name] = (decoder, handler, job_scoped, max_bytes)

    def register_put(self, kind: str, handler: Callable[[Any, Any, Any, Any], None]) -> None:
        """Add a ``DoPut`` for descriptors whose path starts with ``kind``: ``handler(context, descriptor,
        reader, writer)``; the caller's job token is checked with :meth:`authorize` by the handler."""
        self._puts[kind] = handler

    def register_get(self, kind: str, handler: Callable[[Any, dict], Any]) -> None:
        """Add a ``DoGet`` for JSON tickets whose ``kind`` field is ``kind``: ``handler(context, ticket_object)``
        returns a Flight data stream and checks the caller's credentials itself."""
        self._gets[kind] = handler

    def authorize_operator(self, context) -> None:
        """An operator action's caller: the admin token, else a caller on this host (see ``admin_token``)."""
        try:
            check_admin(context, self.admin_token)
        except flight.FlightUnauthenticatedError:
            self.metrics.refusals.labels("token").inc()
            raise

    def authorize(self, context, job_id: str) -> NodeJob:
        """The registered job named by the request, after checking the call's job header and token."""
        mw = context.get_middleware("auth")
        with self._jobs_lock:
            job = self._jobs.get(job_id)
        if job is None:
            self.metrics.refusals.labels("unknown_job").inc()
            raise flight.FlightServerError(f"foresight: unknown job {job_id!r} (register it first)")
        if mw is None or mw.job != job_id or not job.check_token(mw.token):
            self.metrics.refusals.labels("token").inc()
            raise flight.FlightUnauthenticatedError(f"foresight: bad or missing token for job {job_id!r}")
        job.last_seen = time.monotonic()
        return job

    # -- Flight entry points ----------------------------------------------------------------------------------
    def list_actions(self, context):
        return [(name, f"foresight node action {name}") for name in sorted(self._actions)]

    def do_action(self, context, action):
        name = action.type
        if self._draining.is_set() and name not in ("health", "status"):
            raise flight.FlightUnavailableError("foresight: node is shutting down")
        with _one_line_errors(self, "action", action=name[:40]):
            entry = self._actions.get(name)
            if entry is None:
                raise ProtocolError(f"unknown action; known: {sorted(self._actions)}", action=name[:40])
            decoder, handler, scoped, max_bytes = entry
            req = decode_action(name, action.body.to_pybytes(), {name: decoder}, max_bytes=max_bytes)
            if scoped:
                self.authorize(context, req["job"])
            result = handler(context, req)
        yield flight.Result(json.dumps(result, default=str).encode())

    def do_get(self, context, ticket):
        if self._draining.is_set():
            raise flight.FlightUnavailableError("foresight: node is shutting down")
        with _one_line_errors(self, "stream"), self._inflight.starting() as started:
            kind = _ticket_kind(ticket.ticket) if self._gets else None
            handler = self._gets.get(kind) if kind is not None else None
            if handler is not None:
                return handler(context, parse_request(ticket.ticket, "ticket"))
            t = decode_ticket(ticket.ticket)
            job = self.authorize(context, t["job"])
            if job.refused is not None:
                raise NodeError(job.refused, job=job.job)
            if t["rank"] != job.rank or not 0 <= t["step"] < job.plan.num_steps:
                raise ProtocolError("ticket names another rank or a step outside the plan", job=job.job,
                                    rank=t["rank"], step=t["step"])
            q = self.scheduler.queues.get(job.job)
            if q is None:
                raise NodeError("job was unregistered", job=job.job)
            part = q.take(t["step"], lambda s: self._produce_here(job, s))
            if job.prefetch is not None:  # the node reads no step up to this one again: the window moves on
                job.prefetch.advance(t["step"])
            self.scheduler.wake()
            self._queue_metrics(q)
            stream = flight.GeneratorStream(part.schema, CountedStream(self._inflight, part.batches))
            started()
        self.metrics.served(job.job, part.kind, nbytes=part.nbytes, samples=part.samples)
        self.metrics.copied.inc(part.copied_bytes)
        return stream

    # Flight's other RPCs: pyarrow's defaults answer UNIMPLEMENTED with the server's Python traceback
    def list_flights(self, context, criteria):
        raise _not_served("ListFlights")

    def get_flight_info(self, context, descriptor):
        raise _not_served("GetFlightInfo")

    def get_schema(self, context, descriptor):
        raise _not_served("GetSchema")

    def do_exchange(self, context, descriptor, reader, writer):
        raise _not_served("DoExchange")

    def do_put(self, context, descriptor, reader, writer):
        kind = descriptor.path[0].decode("utf-8", "replace") if descriptor.path else ""
        handler = self._puts.get(kind)
        if handler is None:
            raise flight.FlightServerError(f"foresight: no DoPut for {kind[:40]!r}; known: {sorted(self._puts)}")
        if self._draining.is_set():
            raise flight.FlightUnavailableError("foresight: node is shutting down")
        with _one_line_errors(self, "upload", kind=kind[:40]):
            return handler(context, descriptor, reader, writer)

    # -- internals ----------------------------------------------------------------------------------------
    def _open_cached(self, kind: str, name: str) -> Any:
        """Dataset or plan ``name`` under the root, opened once (keyed by its local path)."""
        bucket = self.bucket is not None and kind == "dataset"
        path = self.index.local_path(name) if bucket else resolve_under(self.root, name, kind)
        with self._open_lock:
            obj = self._opened.get((kind, path))
            if obj is None:
                try:
                    obj = self.index.open(name) if bucket else open_dataset(path) if kind == "dataset" else \
                        load_plan(path)
                except (OSError, ValueError) as e:
                    raise ProtocolError(f"cannot open {kind}: {e}"[:300]) from None
                self._opened[(kind, path)] = obj
            return obj

    def _start_prefetch(self, job: NodeJob, step: int) -> JobPrefetch | None:
        """The job's plan-driven prefetch into its bucket datasets' caches (None: no bucket dataset)."""
        if not any(isinstance(ds, BucketDataset) for ds in job.datasets):
            return None
        # the pinned window (the steps after the client's) covers every step the node's queue may be reading
        return JobPrefetch(job, start_step=step, lookahead=max(self.cache_lookahead, job.lead + 2),
                           budget_bytes=self.cache_budget)

    def _produce_here(self, job: NodeJob, step: int) -> Any:
        """A step prepared on the call thread that asked for it, with an engine borrowed for that step."""
        with self._engines.borrow() as engine:
            return self._produce(job, step, engine)

    def _produce(self, job: NodeJob, step: int, engine) -> Any:
        if job.refused is not None:  # its dataset changed: read nothing more through its old maps
            raise NodeError(job.refused, job=job.job)

        def corrupt(dataset: str, samples) -> None:
            self.metrics.corrupt_samples(job.job, dataset, len(samples))
            log.warning("sample bytes on this node fail their checksum; not decoded, the client decodes them",
                        extra={"node": self.node_id, "job": job.job, "dataset": dataset, "step": step,
                               "samples": [int(s) for s in samples[:32]]})

        return job.prepare(step, engine, raw=self.guard.engaged, decode_seconds=self.metrics.decoded,
                           corrupt=corrupt)

    def _queue_metrics(self, q) -> None:
        with q.cond:
            depth, lead, nbytes = len(q.ready), q.lead(), q.nbytes
        self.metrics.job_queue(q.job.job, depth=depth, lead=lead, nbytes=nbytes)

    def _janitor_loop(self) -> None:
        while not self._stopped.wait(min(1.0, self.rescan_s or 1.0)):
            self.metrics.cpu.set(self.guard.cpu_percent)
            self.metrics.guard.set(1 if self.guard.engaged else 0)
            now = time.monotonic()
            if self.rescan_s and now - self._last_scan >= self.rescan_s:
                self.rescan("periodic")
            with self._jobs_lock:
                idle = [j for j, job in self._jobs.items() if now - job.last_seen > self.job_idle_s]
            for j in idle:
                log.info("job idle, dropping", extra={"job": j})
                self._drop_job(j)

    # -- lifetime -----------------------------------------------------------------------------------------
    def stop(self) -> bool:
        """Refuse new calls; let streams in flight run for up to ``shutdown_grace_s``; cancel those still running
        (log line "cancelling in-flight streams"); free everything. Returns within ``shutdown_grace_s +
        CANCEL_WAIT_S``: True when gRPC shut down, False when it did not within that bound (the caller exits
        anyway). Idempotent; safe from any thread."""
        if self._draining.is_set():
            self._stopped.wait(self.shutdown_grace_s + CANCEL_WAIT_S)
            return self._stopped.is_set()
        self._draining.set()
        deadline = time.monotonic() + self.shutdown_grace_s
        log.info("node draining", extra={"node": self.node_id, "streams": self._inflight.count,
                                         "grace_s": self.shutdown_grace_s})
        # the listener stays open meanwhile: new callers hear "shutting down"
        self._inflight.wait_idle(self.shutdown_grace_s)
        grpc_stop = threading.Thread(target=self.shutdown, name="foresight-node-shutdown", daemon=True)
        grpc_stop.start()
        grpc_stop.join(max(0.0, deadline - time.monotonic()))
        if grpc_stop.is_alive():
            self._inflight.cancel()  # streams between two batches end at the next one
            streams = self._inflight.count
            cut = cut_connections(self.port)
            log.warning("shutdown grace over; cancelling in-flight streams",
                        extra={"node": self.node_id, "streams": streams, "connections_cut": cut,
                               "grace_s": self.shutdown_grace_s})
            self.metrics.refusals.labels("cancelled_at_shutdown").inc(streams)
            grpc_stop.join(CANCEL_WAIT_S)
        clean = not grpc_stop.is_alive()
        if not clean:
            log.error("gRPC did not shut down after cancelling streams", extra={"node": self.node_id})
        self.scheduler.close()
        for job_id in list(self._jobs):
            self._drop_job(job_id)
        self.guard.stop()
        self.metrics.close()
        self._engines.close()
        if isinstance(self.index, BucketRootIndex):
            self.index.close()
        self._stopped.set()
        log.info("node stopped", extra={"node": self.node_id, "clean": clean})
        return clean

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _ticket_kind(body: bytes) -> str | None:
    """The ``kind`` of a JSON ticket registered with :meth:`NodeServer.register_get` (None for step tickets).
    Parsed with the same bounds as every request (size, nesting): a hostile ticket is a ProtocolError."""
    if not body.startswith(b'{"kind"'):  # step tickets start with "job": skip parsing them twice
        return None
    kind = parse_request(body, "ticket").get("kind")
    return kind if isinstance(kind, str) else None


def _not_served(rpc: str) -> flight.FlightError:
    return flight.FlightServerError(f"foresight: the node does not serve {rpc}; it answers DoAction, DoGet, DoPut "
                                    "and ListActions")


def _for_caller(server: NodeServer, text: str) -> str:
    """``text`` as a remote caller may read it: the node's own absolute paths (its data root or bucket cache, as
    given and with symlinks resolved) become ``<root>``, so an error still names the file, relative to the root,
    without telling a caller where the node keeps its data. The node's log keeps the full paths."""
    for prefix in sorted({str(server.root).rstrip("/"), os.path.realpath(str(server.root))}, key=len, reverse=True):
        if len(prefix) > 1:  # the whole name only: a root /data leaves /data2 as it is
            text = re.sub(re.escape(prefix) + r"(?![\w.-])", "<root>", text)
    return text


@contextlib.contextmanager
def _one_line_errors(server: NodeServer, what: str, **context: Any):
    """Every failure of a request as one line to its caller: the project's errors (bad request, refusal) as
    ``foresight: <message>``; Flight's own (auth, unavailable) as they are; an OS error on the node's files (disk
    full, file too large, file gone) as ``foresight: <what> failed on the node: <reason> (errno, file)``, logged
    and counted as ``os_error``; anything else (a bug) logged with its
    traceback, counted as ``internal`` and answered ``foresight: internal error (<type>)``, never a traceback.
    What the caller reads names files relative to the data root (:func:`_for_caller`)."""
    try:
        yield
    except flight.FlightError as e:
        text = str(e)
        shown = _for_caller(server, text)
        if shown == text:
            raise
        raise type(e)(shown) from None
    except ForesightError as e:
        server.metrics.refusals.labels(type(e).__name__).inc()
        log.info(f"{what} refused", extra=dict(context, error=str(e)[:300]))
        raise flight.FlightServerError(_for_caller(server, f"foresight: {e}")[:1000]) from None
    except OSError as e:  # the node's disk or files (full, too large, gone, unreadable): a fault, not a bug
        server.metrics.refusals.labels("os_error").inc()
        detail = f"{e.strerror or e} (errno {e.errno}, file {e.filename})" if e.filename else f"{e.strerror or e}"
        log.warning(f"{what} failed on the node's files", extra=dict(context, error=detail[:300]))
        raise flight.FlightServerError(_for_caller(server, f"foresight: {what} failed on the node: {detail}")[:1000]) \
            from None
    except Exception as e:
        server.metrics.refusals.labels("internal").inc()
        log.exception(f"{what} failed inside the node", extra=context)
        raise flight.FlightServerError(f"foresight: internal error ({type(e).__name__}); see the node's log") \
            from None


__all__ = ["NodeServer", "scan_root"]
