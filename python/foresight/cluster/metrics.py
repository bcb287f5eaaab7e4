"""The node's Prometheus metrics, one registry per server (several servers may share a process in tests).

Per job: queue depth (steps ready), lead (steps decoded ahead of the job's progress), queued bytes, bytes and
samples served by kind (decoded or raw), raw (CPU-guard) parts, samples whose bytes failed their checksum on this
node (``samples_corrupt``; also per dataset); per modality: decode seconds; node: CPU percent,
guard engaged, jobs, and what it served in all (jobs gone included). ``foresight node status`` prints the same
numbers (the ``status`` action reads :meth:`NodeMetrics.snapshot`).

Example::

    m = NodeMetrics()
    port = m.serve_http(0)            # GET http://host:port/metrics
    m.served("j1", "decoded", nbytes=1 << 20, samples=4)
"""
from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class NodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("foresight_node_queue_depth_steps", "steps ready in the job's queue", ["job"],
                                 registry=r)
        self.lead = Gauge("foresight_node_lead_steps", "steps prepared ahead of the job's progress", ["job"],
                          registry=r)
        self.queue_bytes = Gauge("foresight_node_queue_bytes", "bytes held in the job's queue", ["job"], registry=r)
        self.bytes_served = Counter("foresight_node_bytes_served", "tensor bytes streamed", ["job", "kind"], registry=r)
        self.samples_served = Counter("foresight_node_samples_served", "samples streamed", ["job", "kind"], registry=r)
        self.parts_served = Counter("foresight_node_parts_served", "step parts streamed", ["job", "kind"], registry=r)
        self.decode_seconds = Counter("foresight_node_decode_seconds", "decode time (thread seconds)", ["modality"],
                                      registry=r)
        self.cpu = Gauge("foresight_node_cpu_percent", "node CPU, mean over the guard's window", registry=r)
        self.guard = Gauge("foresight_node_cpu_guard_engaged", "1 while the node serves raw bytes", registry=r)
        self.jobs = Gauge("foresight_node_jobs", "registered jobs", registry=r)
        self.copied = Counter("foresight_node_copied_bytes", "bytes copied to build record batches (0 for stacked "
                              "decoded tensors, which are sent from their own memory)", registry=r)
        self.corrupt = Counter("foresight_node_corrupt_samples", "samples whose bytes on this node failed the shard "
                               "map's xxh3 (never decoded or served; their clients decode them)", ["dataset"],
                               registry=r)
        self.rescans = Counter("foresight_node_root_rescans", "scans of the data root for datasets added, removed "
                               "or repacked", registry=r)
        self.dataset_changes = Counter("foresight_node_dataset_changes", "datasets added, removed or changed "
                                       "(repacked) under the root, seen by a rescan", ["change"], registry=r)
        self.refusals = Counter("foresight_node_refusals", "requests refused", ["reason"], registry=r)
        self._lock = threading.Lock()
        self._per_job: dict[str, dict[str, float]] = {}
        self._past: dict[str, float] = {}  # served counters of jobs gone (folded in by forget)
        self._decode: dict[str, float] = {}
        self._corrupt: dict[str, int] = {}  # per dataset, jobs gone included
        self._http = None

    def served(self, job: str, kind: str, *, nbytes: int, samples: int) -> None:
        self.bytes_served.labels(job, kind).inc(nbytes)
        self.samples_served.labels(job, kind).inc(samples)
        self.parts_served.labels(job, kind).inc()
        with self._lock:
            d = self._per_job.setdefault(job, {})
            for k, v in ((f"bytes_{kind}", nbytes), (f"samples_{kind}", samples), (f"parts_{kind}", 1)):
                d[k] = d.get(k, 0) + v

    def corrupt_samples(self, job: str, dataset: str, samples: int) -> None:
        """``samples`` of ``dataset`` failed their checksum while preparing a part of ``job``."""
        self.corrupt.labels(dataset).inc(samples)
        with self._lock:
            self._corrupt[dataset] = self._corrupt.get(dataset, 0) + samples
            d = self._per_job.setdefault(job, {})
            d["samples_corrupt"] = d.get("samples_corrupt", 0) + samples

    def decoded(self, modality: str, seconds: float) -> None:
        self.decode_seconds.labels(modality).inc(seconds)
        with self._lock:
            self._decode[modality] = self._decode.get(modality, 0.0) + seconds

    def job_queue(self, job: str, *, depth: int, lead: int, nbytes: int) -> None:
        self.queue_depth.labels(job).set(depth)
        self.lead.labels(job).set(lead)
        self.queue_bytes.labels(job).set(nbytes)
        with self._lock:
            self._per_job.setdefault(job, {}).update(queue_depth=depth, lead=lead, queue_bytes=nbytes)

    def forget(self, job: str) -> None:
        """The job left: drop its gauges and per-job entry; its served counts stay in the node's totals."""
        for g in (self.queue_depth, self.lead, self.queue_bytes):
            try:
                g.remove(job)
            except KeyError:
                pass
        with self._lock:
            for k, v in self._per_job.pop(job, {}).items():
                if k.startswith(("bytes_", "samples_", "parts_")):
                    self._past[k] = self._past.get(k, 0) + v

    def snapshot(self) -> dict[str, Any]:
        """The numbers behind the Prometheus endpoint, as plain data (per job: fallback_rate = parts raw or
        deferred / all parts)."""
        with self._lock:
            jobs = {j: dict(d) for j, d in self._per_job.items()}
            decode = dict(self._decode)
            totals = dict(self._past)
            corrupt = dict(self._corrupt)
        for d in jobs.values():
            for k, v in d.items():
                if k.startswith(("bytes_", "samples_", "parts_")):
                    totals[k] = totals.get(k, 0) + v
        for d in jobs.values():
            guarded = d.get("parts_raw", 0) + d.get("parts_deferred", 0)
            parts = d.get("parts_decoded", 0) + guarded
            d["fallback_rate"] = guarded / parts if parts else 0.0
        return {"jobs": jobs, "served": totals, "decode_seconds": decode, "corrupt_samples": corrupt,
                "cpu_percent": self.cpu._value.get(),
                "guard_engaged": bool(self.guard._value.get())}

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the ``/metrics`` endpoint; returns its port (``port=0`` picks a free one)."""
        from prometheus_client import start_http_server

        self._http, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


__all__ = ["NodeMetrics"]
