"""The node's own job actions: register, progress, unregister, health, status, plan upload; and root rescans.

:class:`JobActions` is the part of :class:`~foresight.node.server.NodeServer` that keeps the registered jobs (who
may register, how many per caller, re-registration after a client restart, dropping idle or unregistered jobs)
and answers the built-in actions (``DoAction``); the server registers these handlers in its action registry at
start-up, the same way extensions add theirs. It works on the server's state (``_jobs``, ``scheduler``, ``metrics``,
``index``).

Example (what a client's calls reach)::

    node.do_action(ctx, flight.Action("register_job", body))   # -> JobActions._register_job
    node.rescan("manual")                                        # datasets added, removed or repacked
"""
from __future__ import annotations

import logging
import os
import time

import pyarrow.flight as flight

from foresight.errors import ForesightError, NodeError, ProtocolError
from foresight.cluster.auth import caller_of, cluster_job
from foresight.node.bucket_root import bucket_status
from foresight.node.jobs import NodeJob, spec_digest
from foresight.node.plans import receive_plan
from foresight.node.protocol import PROTOCOL_VERSION
from foresight.node.root_index import Changes

log = logging.getLogger("foresight.node")


class JobActions:
    """The job registry and built-in actions of a :class:`~foresight.node.server.NodeServer` (a mixin: it uses the
    server's attributes set in ``NodeServer.__init__``)."""

    def rescan(self, why: str) -> Changes:
        """Rescan the root for datasets added, removed or repacked (see :mod:`foresight.node.root_index`): log and
        count each change, forget opened copies of the datasets that changed, and refuse from now on every job
        whose datasets are no longer the ones it opened."""
        changes = self.index.rescan()
        self._last_scan = time.monotonic()
        self.metrics.rescans.inc()
        for change, items in (("added", changes.added), ("removed", changes.removed), ("changed", changes.changed)):
            for name, fingerprint in items.items():
                self.metrics.dataset_changes.labels(change).inc()
                log.info(f"dataset {change} under the root", extra={"node": self.node_id, "dataset": name,
                                                                    "fingerprint": fingerprint, "scan": why})
        with self._open_lock:
            for name in list(changes.removed) + list(changes.changed):
                self._opened.pop(("dataset", os.path.realpath(os.path.join(self.root, name))), None)
        with self._jobs_lock:
            jobs = list(self._jobs.values())
        current = self.index.datasets
        for job in jobs:  # every job, every scan: one registered while a change was being noticed is caught too
            for name, ds in zip(job.dataset_names, job.datasets):
                now = current.get(name, {}).get("fingerprint")
                if job.refused is None and now != str(ds.fingerprint):
                    job.refused = (f"dataset {name!r} was {'removed' if now is None else 'repacked'} on this node "
                                   f"while job {job.job!r} used it (fingerprint {ds.fingerprint} -> {now}): the "
                                   "node no longer serves this job; its client decodes here")
                    self.metrics.refusals.labels("dataset_changed").inc()
                    log.warning("job refused: its dataset changed under the root",
                                extra={"node": self.node_id, "job": job.job, "dataset": name,
                                       "fingerprint": str(ds.fingerprint), "now": now})
        return changes

    # -- actions ------------------------------------------------------------------------------------------
    def _health(self, context, req: dict) -> dict:
        return {"ok": not self._draining.is_set(), "node": self.node_id, "instance": self.instance,
                "version": PROTOCOL_VERSION, "location": self.location, "datasets": self.datasets,
                "plans": self.plans, "cpu_percent": self.guard.cpu_percent, "guard": self.guard.engaged,
                "cpu_measure": self.guard.measure,
                "jobs": len(self._jobs), "max_jobs": self.max_jobs, "streams": self._inflight.count}

    def _status(self, context, req: dict) -> dict:
        self.authorize_operator(context)  # every job's name and progress, the bucket root: the operator's
        self.metrics.cpu.set(self.guard.cpu_percent)
        self.metrics.guard.set(1 if self.guard.engaged else 0)
        self.metrics.jobs.set(len(self._jobs))
        snap = self.metrics.snapshot()
        jobs = {}
        for job_id, q in list(self.scheduler.queues.items()):  # every registered job, with its queue as it is now
            with q.cond:
                live = {"queue_depth": len(q.ready), "lead": q.lead(), "queue_bytes": q.nbytes, "progress": q.progress}
            if q.job.prefetch is not None:
                live["prefetch"] = q.job.prefetch.stats()
            jobs[job_id] = dict(snap["jobs"].get(job_id, {"fallback_rate": 0.0}), **live)
        snap.update(jobs=jobs, node=self.node_id, instance=self.instance, location=self.location,
                    max_jobs=self.max_jobs, streams=self._inflight.count, cpu_measure=self.guard.measure)
        if self.bucket is not None:  # per bucket dataset opened: requests, bytes, cache hits and misses
            with self._open_lock:
                opened = dict(self._opened)
            snap.update(root=str(self.bucket), bucket=bucket_status(opened), failed_scans=self.index.failed_scans)
        return snap

    def _register_job(self, context, req: dict) -> dict:
        with self._register_lock:  # one registration at a time: two racing for one job id must not both open it
            return self._register_job_locked(context, req)

    def _register_job_locked(self, context, req: dict) -> dict:
        mw = context.get_middleware("auth")
        token = None if mw is None else mw.token
        if mw is None or mw.job != req["job"] or not token or len(token) < 8:
            self.metrics.refusals.labels("token").inc()
            raise flight.FlightUnauthenticatedError("foresight: register_job needs the job header and a token "
                                                    "of at least 8 characters")
        name, caller = cluster_job(req["job"], req["rank"]), caller_of(context)
        try:
            issued = self.admission.check(name, token)
        except flight.FlightError:
            self.metrics.refusals.labels("token").inc()
            raise
        with self._jobs_lock:
            old = self._jobs.get(req["job"])
            if old is not None and not old.check_token(token) and not issued:
                self.metrics.refusals.labels("token").inc()
                raise flight.FlightUnauthenticatedError(f"foresight: job {req['job']!r} is registered with "
                                                        "another token")
            if old is None and len(self._jobs) >= self.max_jobs:
                raise ProtocolError("node has as many jobs as it accepts", max_jobs=self.max_jobs)
            theirs = {n for j, (c, n) in self._callers.items() if c == caller and j != req["job"]}
            if name not in theirs and len(theirs) >= self.max_jobs_per_caller:
                self.metrics.refusals.labels("caller_limit").inc()
                raise ProtocolError("caller has as many jobs registered as one caller may",
                                    caller=caller, max_jobs_per_caller=self.max_jobs_per_caller)
        if old is not None and not old.check_token(token):
            log.info("job re-attached with its issued token; the earlier registration is dropped",
                     extra={"job": req["job"]})
        if old is not None:  # re-registration (client restart): start over at its step
            self._drop_job(req["job"])
        if self.index.stale(req["datasets"]):  # a dataset added or repacked since the last scan: see it now
            self.rescan("registration")
        req = dict(req, lead=min(req["lead"], self.max_lead), queue_bytes=min(req["queue_bytes"], self.max_queue_bytes))
        job = NodeJob.open(req, token=token, node=self.node_id, served_shards=self.served_shards,
                           decode_threads=self.decode_threads, open_cache=self._open_cached, limits=self.limits)
        try:
            job.prefetch = self._start_prefetch(job, req["step"])
        except BaseException:
            job.close()
            raise
        with self._jobs_lock:
            if len(self._jobs) >= self.max_jobs:
                job.close()
                raise ProtocolError("node has as many jobs as it accepts", max_jobs=self.max_jobs)
            self._jobs[job.job] = job
            self._callers[job.job] = (caller, name)
        q = self.scheduler.add(job)
        with q.cond:
            q.set_progress(req["step"] - 1)
        self.metrics.jobs.set(len(self._jobs))
        log.info("job registered", extra={"job": job.job, "rank": job.rank, "world_size": job.world_size,
                                          "lead": job.lead, "queue_bytes": job.queue_bytes})
        return dict(job.describe(), instance=self.instance, spec_digest=spec_digest(job.specs), bounds=job.bounds)

    def _progress(self, context, req: dict) -> dict:
        q = self.scheduler.queues.get(req["job"])
        if q is None:
            raise NodeError("job was unregistered", job=req["job"])
        with q.cond:
            q.set_progress(req["step"])
            lead = q.lead()
        if q.job.prefetch is not None:
            q.job.prefetch.advance(req["step"])
        self._queue_metrics(q)
        return {"job": req["job"], "progress": q.progress, "lead": lead}

    def _unregister(self, context, req: dict) -> dict:
        self._drop_job(req["job"])
        return {"job": req["job"], "unregistered": True}

    def _put_plan(self, context, descriptor, reader, writer) -> None:
        """A plan uploaded by a client that is about to register a job (any caller with a job header and a token
        of 8+ characters; the upload is capped in bytes and kept only if it verifies against its digest)."""
        mw = context.get_middleware("auth")
        if mw is None or not mw.job or not mw.token or len(mw.token) < 8:
            raise flight.FlightUnauthenticatedError("foresight: a plan upload needs the job header and a token")
        if len(descriptor.path) != 2:
            raise flight.FlightServerError("foresight: plan upload descriptor is ['plan', digest]")
        digest = descriptor.path[1].decode("utf-8", "replace")
        try:
            rel = receive_plan(self.root, digest, reader, max_bytes=self.max_plan_bytes,
                               find_dataset=self._dataset_by_fingerprint)
        except ForesightError as e:
            self.metrics.refusals.labels("plan_upload").inc()
            raise flight.FlightServerError(f"foresight: {e}") from None
        self.plans[digest] = rel
        log.info("plan uploaded", extra={"digest": digest, "path": rel, "job": mw.job})

    def _dataset_by_fingerprint(self, fingerprint: str):
        """The dataset under the root with this fingerprint, opened (a compact plan upload derives from it)."""
        name = next((n for n, info in self.datasets.items() if info.get("fingerprint") == fingerprint), None)
        return None if name is None else self._open_cached("dataset", name)

    # -- registry ---------------------------------------------------------------------------------------
    def _drop_job(self, job_id: str) -> None:
        with self._jobs_lock:
            job = self._jobs.pop(job_id, None)
            self._callers.pop(job_id, None)
        q = self.scheduler.remove(job_id)
        if q is not None:
            with q.cond:  # wait for workers preparing its steps before closing its files
                while q.producing:
                    q.cond.wait(timeout=1.0)
        if job is not None:
            job.close()
            self.metrics.forget(job_id)
            self.metrics.jobs.set(len(self._jobs))
            log.info("job dropped", extra={"job": job_id})
