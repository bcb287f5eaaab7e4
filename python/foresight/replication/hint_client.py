"""The client side of replication hints: declare a restart's hot files, watch the copies, read them spread out.

* :func:`set_replication_hints` derives the hints from a DCP checkpoint and the world size that will load it
  (:func:`~foresight.replication.hints.derive_dcp_hints`), or takes them ready-made, and sends them with the job's
  token to a storage node of the cluster, which plans and starts the extra copies
  (:mod:`foresight.replication.replica_manager`).
* :func:`replication_progress` / :func:`wait_for_replicas` report the copies (made, pending, failed, bytes, time).
* :class:`ReplicaReader` reads a checkpoint file from the least loaded live copy (its own in-flight reads per node
  plus the load nodes advertise in etcd), verifies the bytes against the file's xxh3, and on any failure or
  mismatch tries the next copy, the base copies last. A wrong hint can cost time, never a wrong byte.

Example::

    hints = set_replication_hints("job-7/step-100", etcd=ep, job="job-7", token=tok, ttl_s=600,
                                  checkpoint_dir="/ckpt/job-7/step-100", world_size=2048)
    wait_for_replicas("job-7/step-100", etcd=ep, job="job-7", token=tok, timeout=60)
    with ReplicaReader(ep, job="job-7", token=tok) as reader:
        meta = reader.read("job-7/step-100", ".metadata")
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from foresight.checksum import xxh3_many
from foresight.cluster.auth import call_options, connect
from foresight.cluster.membership import DEFAULT_PREFIX, Cluster
from foresight.errors import NodeError
from foresight.replication.hints import FileHint, derive_dcp_hints
from foresight.replication.replica_etcd import live_copies
from foresight.replication.replica_requests import ckpt_key

DEFAULT_TIMEOUT = 60.0
log = logging.getLogger("foresight.replicate")


def _action(location: str, action: str, body: dict, *, job: str, token: str, timeout: float = DEFAULT_TIMEOUT,
            client: Any = None) -> dict:
    import pyarrow.flight as flight

    own = client is None
    client = client or connect(location)
    try:
        out = list(client.do_action(flight.Action(action, json.dumps(body).encode()),
                                    call_options(job, token, timeout=timeout)))
    finally:
        if own:
            client.close()
    return json.loads(out[0].body.to_pybytes())


def _cluster_action(action: str, body: dict, *, job: str, token: str, etcd: str | None, node: str | None,
                    prefix: str | None, client: Any = None) -> dict:
    """Send ``action`` to ``node`` (over ``client`` if given: a caller polling one node keeps one connection), or
    to the live nodes in random order until one answers (a refusal is final; a node that died but still has a
    lease is skipped)."""
    import pyarrow.flight as flight

    if node is not None:
        return _action(node, action, body, job=job, token=token, client=client)
    if etcd is None:
        raise ValueError("give etcd=<endpoint> or node=<location>")

    locations = [r["location"] for r in Cluster(etcd, prefix=prefix or DEFAULT_PREFIX).nodes().values()]
    random.shuffle(locations)
    errors = []
    for loc in locations:
        try:
            return _action(loc, action, body, job=job, token=token)
        except (flight.FlightUnavailableError, flight.FlightTimedOutError) as e:
            errors.append(f"{loc}: {str(e)[:120]}")
    raise NodeError("no live storage node answered", etcd=etcd, action=action, errors=" | ".join(errors) or None)


def publish_checkpoint(node: str, checkpoint: str, *, job: str, token: str) -> dict:
    """Tell the node at ``node`` to register its files of ``checkpoint`` (its base copies)."""
    return _action(node, "replicas.publish", {"job": job, "checkpoint": checkpoint}, job=job, token=token)


def set_replication_hints(checkpoint: str, *, job: str, token: str, ttl_s: float, etcd: str | None = None,
                          node: str | None = None, checkpoint_dir: str | None = None, world_size: int | None = None,
                          replicated_readers: int | None = None, hints: Sequence[FileHint] | None = None,
                          allow_partial: bool = False, prefix: str | None = None, ranks_per_host: int = 1,
                          cold_bytes: int = 0, cold_reads: int = 0, copies_join: bool = False,
                          client: Any = None) -> dict:
    """Declare the files a restart of ``world_size`` ranks will read from ``checkpoint`` (named ``<job>/...``).

    Hints come from ``checkpoint_dir`` (a local copy of the DCP checkpoint) and ``world_size``, or from ``hints``.
    With ``ranks_per_host`` > 1 the ranks of a host share their reads (:mod:`foresight.replication.host_share`):
    a file read by at least that many ranks has one reader per host, ``ceil(readers / ranks_per_host)``.
    ``cold_bytes`` and ``cold_reads`` (all ranks together) are what the ranks read before the hinted files (a
    cold-first schedule, :class:`~foresight.replication.restore_schedule.HintedRestore`): placement runs meanwhile,
    so the planner counts only the part of its cost beyond that head start. ``copies_join``: the ranks are not
    held for the copies (they read the base copies meanwhile; new copies take the later readers), so a copy pays
    when the base copies would still be busy with the file when it lands.
    Returns the node's plan: per file the readers, replicas wanted and placed, new nodes, the cap that bit and
    the bytes the file granularity copies in vain; ``copy_bytes`` and ``new_replicas`` in total.
    Refused (``pyarrow.flight.FlightServerError`` naming the reason) for unknown files, sizes that differ,
    absurd reader counts, a TTL out of bounds, or a plan over the job's quota (unless ``allow_partial``).
    ``client``: a Flight client connected to ``node``, reused (one connection for the hint and its progress).
    """
    if hints is None:
        if checkpoint_dir is None or world_size is None:
            raise ValueError("give hints=, or checkpoint_dir= and world_size= to derive them")
        hints = derive_dcp_hints(checkpoint_dir, world_size, replicated_readers=replicated_readers)
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host {ranks_per_host} < 1")
    if ranks_per_host > 1:
        hints = [dataclasses.replace(h, readers=-(-h.readers // ranks_per_host)) if h.readers >= ranks_per_host
                 else h for h in hints]
    body = {"job": job, "checkpoint": checkpoint, "ttl_s": ttl_s, "files": [h.to_dict() for h in hints],
            "allow_partial": allow_partial}
    if cold_bytes or cold_reads:
        body.update(cold_bytes=int(cold_bytes), cold_reads=int(cold_reads))
    if copies_join:
        body["copies_join"] = True
    return _cluster_action("set_replication_hints", body, job=job, token=token, etcd=etcd, node=node, prefix=prefix,
                           client=client)


def replication_progress(checkpoint: str, *, job: str, token: str, etcd: str | None = None, node: str | None = None,
                         prefix: str | None = None, client: Any = None) -> dict:
    """Copies made, pending and failed for the checkpoint's live hint; ``complete`` once none is pending;
    ``place_s`` (hint accepted -> last copy registered) and ``steps_s``, the slowest copy's time per step
    (``pickup`` by its target, ``pull`` from a holder, ``register``); ``records``: the hinted files' live copies,
    ``{file: {node: record}}`` (what :meth:`ReplicaReader.merge_files` takes)."""
    return _cluster_action("replicas.progress", {"job": job, "checkpoint": checkpoint}, job=job, token=token,
                           etcd=etcd, node=node, prefix=prefix, client=client)


def release_replication_hints(checkpoint: str, *, job: str, token: str, etcd: str | None = None,
                              node: str | None = None, prefix: str | None = None) -> dict:
    """End the hint now (the restart is over): its copies are reclaimed once no read holds them."""
    return _cluster_action("replicas.release", {"job": job, "checkpoint": checkpoint}, job=job, token=token,
                           etcd=etcd, node=node, prefix=prefix)


def wait_for_replicas(checkpoint: str, *, job: str, token: str, etcd: str | None = None, node: str | None = None,
                      timeout: float = 300.0, poll_s: float = 0.1, prefix: str | None = None,
                      client: Any = None) -> dict:
    """Poll :func:`replication_progress` until every copy task is done or failed; NodeError after ``timeout`` or
    when the hint is gone (its TTL ended or it was released) before that. ``client``: as set_replication_hints."""
    deadline = time.monotonic() + timeout
    while True:
        p = replication_progress(checkpoint, job=job, token=token, etcd=etcd, node=node, prefix=prefix,
                                 client=client)
        if p["complete"]:
            return p
        if not p["hint_live"]:
            raise NodeError("no live hint for the checkpoint (expired or released before its copies were placed)",
                            checkpoint=checkpoint, done=p["done"])
        if time.monotonic() > deadline:
            raise NodeError("replicas not placed in time", checkpoint=checkpoint, pending=p["pending"],
                            copying=p["copying"], timeout=timeout)
        time.sleep(poll_s)


class ReplicaReader:
    """Reads checkpoint files from the least loaded live copy, verified; thread-safe (share one per process).

    Args:
        etcd: cluster endpoint(s); job, token: the job's credentials (the checkpoint is named ``<job>/...``).
        refresh_s: how long a checkpoint's copy list is reused before etcd is asked again.
        load_refresh_s: how long the nodes' advertised loads are reused (they change with every storm).
        retry_s: how long a node that failed a read is avoided.
        max_stale_s: bounded staleness. While etcd is unreachable, a copy list fetched at most this long ago is
            still used (logged, counted in ``stats["stale_lists"]``; the copies themselves are verified on every
            read, so a stale list costs a retry, never a wrong byte); etcd is asked again every ``refresh_s``.
            Past the bound, reads fail with the etcd error.

    Refreshes are single-flight: one thread asks etcd for a checkpoint's copies while the others keep reading from
    the list they have (or wait for the answer when they have none); ``stats["copy_refreshes"]`` counts the asks.
    """

    def __init__(self, etcd: str, *, job: str, token: str, prefix: str | None = None, refresh_s: float = 2.0,
                 load_refresh_s: float = 0.5, retry_s: float = 5.0, timeout: float = DEFAULT_TIMEOUT,
                 max_stale_s: float = 60.0) -> None:
        self.cluster = Cluster(etcd, prefix=prefix or DEFAULT_PREFIX)
        self.job, self.token = job, token
        self.refresh_s, self.retry_s, self.timeout, self.max_stale_s = refresh_s, retry_s, timeout, max_stale_s
        self.load_refresh_s = load_refresh_s
        self._loads_at = -1e9
        self._lock = threading.Lock()
        self._copies: dict[str, tuple[float, dict[str, dict[str, dict]]]] = {}
        self._refreshing: dict[str, threading.Event] = {}  # single flight: the checkpoints being asked for
        self._etcd_retry_at = -1e9  # after etcd failed, the cached lists serve until then
        self._advertised: dict[str, float] = {}
        self._inflight: dict[str, int] = {}
        self._down: dict[str, float] = {}
        self._clients: dict[str, Any] = {}
        self._rng = random.Random()
        self.stats: dict[str, Any] = {"reads": 0, "bytes": 0, "retries": 0, "verify_failures": 0, "by_node": {},
                                      "copy_refreshes": 0, "stale_lists": 0, "file_refreshes": 0}

    # -- copies ------------------------------------------------------------------------------------------
    def copies(self, checkpoint: str, *, force: bool = False) -> dict[str, dict[str, dict]]:
        """``{file: {node: record}}`` of live copies (cached for ``refresh_s``; see ``max_stale_s``)."""
        now = time.monotonic()
        with self._lock:
            hit = self._copies.get(checkpoint)
            usable = hit is not None and now - hit[0] < self.max_stale_s
            if hit is not None and ((not force and now - hit[0] < self.refresh_s) or
                                    (usable and now < self._etcd_retry_at)):
                return hit[1]
            flight = self._refreshing.get(checkpoint)
            if flight is None:
                flight = self._refreshing[checkpoint] = threading.Event()
                self.stats["copy_refreshes"] += 1
                mine = True
            else:
                mine = False
        if not mine:  # another thread is asking etcd: read from what we have, or wait for its answer
            if usable:
                return hit[1]
            flight.wait(self.cluster.timeout * len(self.cluster.endpoints) + 1.0)
            with self._lock:
                hit = self._copies.get(checkpoint)
            if hit is not None and time.monotonic() - hit[0] < self.max_stale_s:
                return hit[1]
            raise NodeError("no copy list: etcd did not answer", checkpoint=checkpoint)
        try:
            out = self._fetch_copies(checkpoint)
        except NodeError as e:
            with self._lock:
                del self._refreshing[checkpoint]
                self._etcd_retry_at = time.monotonic() + self.refresh_s
                if usable:
                    self.stats["stale_lists"] += 1
            flight.set()
            if not usable:
                raise
            log.warning("etcd unreachable: reading from the cached copy list",
                        extra={"checkpoint": checkpoint, "age_s": round(now - hit[0], 3), "error": str(e)[:200]})
            return hit[1]
        with self._lock:
            self._copies[checkpoint] = (now, out)
            del self._refreshing[checkpoint]
        flight.set()
        return out

    def _fetch_copies(self, checkpoint: str, files: Sequence[str] = ()) -> dict[str, dict[str, dict]]:
        """The live copies of ``checkpoint`` from etcd: every file's, or only those of ``files`` (a range each);
        the live nodes and every range in one round trip (a restore polls this while its copies are placed)."""
        nodes = self.cluster.key("nodes") + "/"
        base = self.cluster.key("replicas", ckpt_key(checkpoint)) + "/"
        (listed, *ranges), _ = self.cluster.get_many([nodes, *([base + f"{f}/" for f in files] or [base])])
        return live_copies(base, ranges, {k[len(nodes):] for k, _ in listed})

    def refresh_files(self, checkpoint: str, files: Sequence[str]) -> dict[str, dict[str, dict]]:
        """Re-read the copies of ``files`` alone (a restart's hot files while their copies are placed: a range per
        file, not the checkpoint's thousands of shard records) into the cached list, which keeps its age; the
        whole list is fetched when none is cached. Returns the updated list."""
        if not files:
            return self.copies(checkpoint)
        with self._lock:
            hit = self._copies.get(checkpoint)
        if hit is None:
            return self.copies(checkpoint)
        fresh = self._fetch_copies(checkpoint, files)
        return self.merge_files(checkpoint, {f: fresh.get(f, {}) for f in files})

    def merge_files(self, checkpoint: str, listed: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
        """Put ``listed`` (``{file: {node: record}}`` of some files' live copies: e.g. the hinted files' records a
        node's ``replicas.progress`` reports) in place of those files' entries in the cached list, which keeps its
        age (the whole list is fetched first when none is cached). Returns the updated list."""
        with self._lock:
            hit = self._copies.get(checkpoint)
        if hit is None:
            self.copies(checkpoint)
        with self._lock:
            at, cached = self._copies[checkpoint]
            merged = {**cached, **{f: dict(recs) for f, recs in listed.items()}}
            self._copies[checkpoint] = (at, merged)
            self.stats["file_refreshes"] += 1
        return merged

    def refresh_loads(self, *, force: bool = False) -> dict[str, float]:
        """The in-flight reads each node advertises (reused for ``load_refresh_s``; one thread asks etcd)."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._loads_at < self.load_refresh_s:
                return self._advertised
            self._loads_at = now  # claimed: the other threads keep the values they have meanwhile
        lb = self.cluster.key("replicas", ".load") + "/"
        try:
            advertised = {k[len(lb):]: float(v.get("inflight", 0)) for k, v in self.cluster._get_prefix(lb)}
        except NodeError:  # etcd away: choose by our own reads alone
            advertised = {}
        with self._lock:
            self._advertised = advertised
        return advertised

    def _order(self, recs: dict[str, dict]) -> list[dict]:
        """Copies by load (ours in flight + advertised), ties at random; nodes that failed lately last."""
        now = time.monotonic()
        with self._lock:
            keyed = [((self._down.get(n, 0) > now), self._inflight.get(n, 0) + self._advertised.get(n, 0),
                      self._rng.random(), r) for n, r in recs.items()]
        keyed.sort(key=lambda k: k[:3])
        return [k[3] for k in keyed]

    def _client(self, location: str) -> Any:
        with self._lock:
            c = self._clients.get(location)
            if c is None:
                c = self._clients[location] = connect(location)
            return c

    # -- reads -------------------------------------------------------------------------------------------
    def read(self, checkpoint: str, file: str) -> bytes:
        """The whole file's bytes, verified against its xxh3; NodeError naming the file when no copy serves it."""
        errors = []
        self.refresh_loads()
        for attempt in range(2):  # second round: a fresh copy list (copies placed or lost since)
            recs = self.copies(checkpoint, force=attempt > 0).get(file, {})
            for rec in self._order(recs):
                try:
                    data = self._read_from(rec, checkpoint, file)
                except Exception as e:  # dead node, reclaimed copy, refusal: try the next copy
                    errors.append(f"{rec['node']}: {str(e)[:200]}")
                    with self._lock:
                        self._down[rec["node"]] = time.monotonic() + self.retry_s
                        self.stats["retries"] += 1
                    continue
                return data
        raise NodeError("no live copy served the file", checkpoint=checkpoint, file=file,
                        errors=" | ".join(errors[-4:]) or "no copy registered")

    def _read_from(self, rec: dict, checkpoint: str, file: str) -> bytes:
        import numpy as np
        import pyarrow.flight as flight

        node = rec["node"]
        ticket = json.dumps({"kind": "ckpt.get", "job": self.job, "checkpoint": checkpoint, "file": file}).encode()
        with self._lock:
            self._inflight[node] = self._inflight.get(node, 0) + 1
        try:
            reader = self._client(rec["location"]).do_get(flight.Ticket(ticket),
                                                           call_options(self.job, self.token, timeout=self.timeout))
            parts = []
            for chunk in reader:
                col = chunk.data.column(0)
                parts.extend(col[i].as_py() for i in range(len(col)))
            data = b"".join(parts)
        finally:
            with self._lock:
                self._inflight[node] -= 1
        n = len(data)
        if n != rec["size"] or int(xxh3_many(np.frombuffer(data, np.uint8), np.zeros(1), np.array([n]))[0]) != int(
                rec["xxh3"], 16):
            with self._lock:
                self.stats["verify_failures"] += 1
            raise NodeError("copy failed verification (size or xxh3)", node=node, file=file, size=len(data))
        with self._lock:
            self.stats["reads"] += 1
            self.stats["bytes"] += len(data)
            self.stats["by_node"][node] = self.stats["by_node"].get(node, 0) + 1
        return data

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __enter__(self) -> "ReplicaReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ReplicaReader", "publish_checkpoint", "release_replication_hints", "replication_progress",
           "set_replication_hints", "wait_for_replicas"]
