"""One site's replication handlers over Arrow Flight: send replicas, receive them, serve checkpoint reads.

The same handlers run on every site's node; which role they play depends on the call:

- training site (sender; every action but ``replication.ping`` checks the replication token):
  ``replicate.start`` (the data files are written, or being written with their sizes declared: cut them into
  units, queue those written in the :class:`~.scheduler.PriorityLane`; ``extend``: a DCP rank adds its own file to
  the transfer), ``replicate.written`` (a writer's
  progress: the units it completed leave now), ``replicate.commit`` (the source committed: the replica may now
  be published), ``replicate.abort``, ``replicate.urgent`` (raise a transfer's priority), ``replicate.wait``,
  ``replicate.pause``/``replicate.resume`` (``{"units": n}`` lets exactly n more units go: throttling, and a
  deterministic order for tests), ``replicate.log`` (units in the order they went on the wire);
- evaluation site (receiver): ``DoPut`` of ``replica.units`` (a window of units back to back, each opened by its
  JSON header in the batch metadata; verified, synced once per file, journaled and acknowledged together; a unit
  journaled already is drained; each sending thread keeps two windows unacknowledged; the older ``replica.unit``
  takes one), ``replica.status`` (units already journaled, with their extents: a resumed transfer skips them),
  ``DoPut`` of ``replica.commit`` (the source's index and COMMIT or ``.metadata``, sent as soon as every unit is on
  the wire; wait while windows of it are being received, check every unit is journaled, verify every tensor,
  rename, register in etcd under the replica TTL);
- any site: ``DoGet`` of ``ckpt.file`` / ``ckpt.read`` / ``ckpt.list`` (a small file; many byte ranges of one
  data file in one stream, so a remote reader pays a round trip per file; the data files and sizes),
  ``replication.ping``.

They are mounted into the storage-node daemon's handler registry (:meth:`ReplicationService.mount` on a
:class:`foresight.node.server.NodeServer`; ``foresight node serve --site eval-b --route train-a=URL`` does it).

Example::

    svc = ReplicationService("train-a", "/data/ckpt", etcd="http://127.0.0.1:2379",
                             routes={"eval-b": "grpc://wan-gateway:9000"})
    svc.mount(node_server)
"""
from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from pyarrow import flight

from foresight.errors import CheckpointError, ForesightError, ProtocolError
from foresight.replication.resolver import Resolver
from foresight.replication.scheduler import PriorityLane
from foresight.replication.source import WIRE_CHUNK
from foresight.replication.units import (
    UNIT_BYTES,
    ReplicaBuilder,
    Unit,
    check_file_name,
    check_name,
    data_files,
    meta_files,
    plan_units,
    read_unit,
)

log = logging.getLogger("foresight.replicate")
SCHEMA = pa.schema([("data", pa.binary())])
RETRY_S = 60.0  # how long a sender waits for a site that is down or restarting before the transfer fails
BACKOFF = (0.25, 4.0)  # first and longest pause between attempts (doubling)
WINDOW_BYTES = 64 << 20  # a sender's window: units sent back to back under one acknowledgement (one sync per file)
WINDOW_UNITS = 64
WINDOWS_IN_FLIGHT = 2  # per sending thread: the next window streams while the previous one is synced and acked
# a site whose node answers but has not mounted replication yet (it is starting): wait for it like for one down
_NOT_MOUNTED = ("no DoPut for 'replica.", "unknown action")


def binary_batch(view: memoryview) -> pa.RecordBatch:
    """One row of ``view``'s bytes, without copying them."""
    offsets = pa.py_buffer(np.array([0, len(view)], np.int32).tobytes())
    arr = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(view)])
    return pa.record_batch([arr], schema=SCHEMA)


@dataclass
class _Window:
    """Units of one transfer sent under one acknowledgement; ``stream`` is its open DoPut awaiting the answer."""

    t: Transfer
    units: list[Unit]
    todo: list[Unit] = field(default_factory=list)  # those the site did not hold already
    client: Any = None
    stream: tuple[Any, Any] | None = None
    error: Exception | None = None


@dataclass
class Transfer:
    name: str
    site: str
    src: str
    priority: float
    units: list[Unit]
    fds: dict[str, int]
    started: float = field(default_factory=time.time)
    meta: dict[str, bytes] | None = None  # set at the source COMMIT
    committed_at: float | None = None
    acked: set[int] = field(default_factory=set)
    skip: set[int] | None = None  # units the receiver already holds (resume)
    bytes_sent: int = 0
    units_put: int = 0  # units that went on the wire (a resumed transfer skips those the site holds)
    held: list[Unit] = field(default_factory=list)  # units whose bytes the writer has not written yet
    written: dict[str, int] = field(default_factory=dict)  # bytes written so far per file (a save in progress)
    written_at: float | None = None  # when the last unit's bytes were written (all units released)
    unit_bytes: int = 0
    bytes_left_at_commit: int | None = None  # bytes not yet acknowledged by the site at the source commit
    path: str | None = None  # the published replica
    ready_at: float | None = None
    error: str | None = None
    status_at: float | None = None  # when the receiver said which units it already holds
    status_asked: bool = False
    put: set[int] = field(default_factory=set)  # units on the wire (their window written whole), maybe unacknowledged
    publishing: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class ReplicationService:
    """Replication handlers of the node at ``site`` serving checkpoints under ``root``.

    Args:
        routes: ``{site: flight endpoint}`` of the other sites' nodes (a WAN gateway address, say); sites not
            listed are looked up in etcd.
        replica_ttl: seconds a received replica stays registered (its etcd lease).
        retry_s: how long a sender waits (retrying with back-off) for a site that is down or still starting;
            after a restart the transfer resumes with the units the site has not journaled.
        streams: units in flight at once per sender (the WAN link stays busy during each unit's round trip).
    """

    def __init__(self, site: str, root: str, *, etcd: str | None = None, routes: dict[str, str] | None = None,
                 endpoint: str = "", token: str = "", unit_bytes: int = UNIT_BYTES, streams: int = 2,
                 replica_ttl: int = 3600, fifo: bool = False, retry_s: float = RETRY_S) -> None:
        self.site, self.root, self.token, self.retry_s = site, os.path.realpath(root), token, float(retry_s)
        self.endpoint, self.routes, self.unit_bytes, self.replica_ttl = endpoint, dict(routes or {}), unit_bytes, replica_ttl
        os.makedirs(self.root, exist_ok=True)
        self.resolver = None
        if etcd:
            self.resolver = Resolver(etcd, site=site)
        self.lane = PriorityLane(fifo=fifo)
        self.transfers: dict[str, Transfer] = {}
        self.sent_log: list[tuple[str, int]] = []
        self.retries = 0  # attempts repeated because a site was down or starting
        self.received = {"windows": 0, "units": 0, "syncs": 0}  # as a receiving site
        self._receiving: dict[str, int] = {}  # windows being received per checkpoint
        self.sending = {"windows": 0, "in_flight_max": 0}  # as a sender: windows put, most unacknowledged at once
        self._lock = threading.Condition()
        self._clients: dict[tuple[str, int], flight.FlightClient] = {}
        self._workers = [threading.Thread(target=self._send_loop, name=f"foresight-repl-send-{i}", daemon=True)
                         for i in range(streams)]
        for w in self._workers:
            w.start()

    def close(self) -> None:
        self.lane.close()
        for w in self._workers:
            w.join(10)
        for t in self.transfers.values():
            self._close_fds(t)
        for c in self._clients.values():
            c.close()
        if self.resolver is not None:
            self.resolver.close()

    # -- registry for a node daemon --------------------------------------------------------------
    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """Every action but ``replication.ping`` (which tells only the site's name) checks the token first."""
        control = {
            "replicate.start": self.start, "replicate.written": self.written, "replicate.commit": self.commit,
            "replicate.abort": self.abort,
            "replicate.urgent": self.urgent, "replicate.wait": self.wait, "replicate.pause": self.pause,
            "replicate.resume": self.resume,
            "replicate.log": lambda b: {"sent": self.sent_log, "received": self.received, "sending": self.sending},
            "replica.status": self.replica_status,
        }
        out: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"replication.ping": lambda b: {"site": self.site}}
        for name, fn in control.items():
            out[name] = functools.partial(self._checked, fn)
        return out

    def _checked(self, fn: Callable[[dict[str, Any]], dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
        self.check_token(body)
        return fn(body)

    def check_token(self, body: dict[str, Any]) -> None:
        """Sites of one deployment share a replication token (node-to-node calls carry no job)."""
        if self.token and not hmac.compare_digest(str(body.get("token", "")).encode(), self.token.encode()):
            raise ProtocolError("bad or missing replication token")

    def mount(self, server: Any) -> None:
        """Register the actions, DoPut and DoGet kinds on a node server's handler registry."""
        for name, fn in self.handlers().items():
            server.register_action(name, _decoder(name), _clear_errors(lambda context, req, fn=fn: fn(req)),
                                   job_scoped=False)
        server.register_put("replica.unit", _clear_errors(self._put_unit))
        server.register_put("replica.units", _clear_errors(self._put_units))
        server.register_put("replica.commit", _clear_errors(self._put_commit))
        for kind in ("ckpt.read", "ckpt.file", "ckpt.list"):
            server.register_get(kind, _clear_errors(lambda context, ticket: self.do_get(ticket)))
        if not self.endpoint:
            self.endpoint = server.location
        if self.resolver is not None:
            self.resolver._etcd.put(f"/foresight/sites/{self.site}/replication", self.endpoint)

    def _under_root(self, path: str) -> str:
        real = os.path.realpath(path)
        if os.path.commonpath([self.root, real]) != self.root:
            raise CheckpointError("path is outside this node's root", path=path, root=self.root)
        return real

    # -- sender ----------------------------------------------------------------------------------
    def start(self, b: dict[str, Any]) -> dict[str, Any]:
        """Queue the units of ``b["name"]``'s data files in ``b["src"]`` for ``b["site"]``.

        Without ``files`` the data files are complete. With ``files`` (``[[name, size], ...]``, declared by a
        writer that is still writing) only units inside ``written`` (``{file: bytes written}``) leave now; the
        rest leave as :meth:`written` reports their bytes (send while saving). With ``extend`` (each rank of a
        DCP save declares its own file) the files join the transfer of that name in progress, if any; files it
        already has are ignored (a rank's late call after the commit found the file on disk)."""
        name, src = check_name(b["name"]), self._under_root(b["src"])
        declared = b.get("files")
        listed = [(check_file_name(str(f)), int(n)) for f, n in declared] if declared is not None else data_files(src)
        unit_bytes = int(b.get("unit_bytes") or self.unit_bytes)
        if b.get("extend"):
            with self._lock:
                old = self.transfers.get(name)
                joins = old is not None and old.src == src and (
                    not old.done.is_set() or {f for f, _ in listed} <= {u.file for u in old.units})
            if joins:
                added = self._declare(old, listed, src, unit_bytes)
                self._release(old, b.get("written") or {})
                return {"units": len(added), "bytes": sum(u.length for u in added)}
        units = plan_units(listed, unit_bytes)
        # open now: the writer renames the directory at its commit, open descriptors survive that
        fds = {f: os.open(os.path.join(src, f), os.O_RDONLY | os.O_CLOEXEC) for f in {u.file for u in units}}
        t = Transfer(name, b["site"], src, float(b.get("priority", 1.0)), units, fds)
        t.written = dict(listed) if declared is None else {}
        t.held = list(units)
        t.unit_bytes = unit_bytes
        with self._lock:
            old = self.transfers.get(name)
            if old is not None and not old.done.is_set():
                self._close_fds(t)
                raise CheckpointError("replication of this checkpoint is already in progress", name=name)
            self.transfers[name] = t
        self._release(t, b.get("written") or {})
        if not units:
            self._maybe_publish(t)
        return {"units": len(units), "bytes": sum(u.length for u in units)}

    def _declare(self, t: Transfer, files: list[tuple[str, int]], directory: str, unit_bytes: int) -> list[Unit]:
        """Add ``files`` (those ``t`` lacks) to transfer ``t``, their units held until written; returns them."""
        with self._lock:
            known = {u.file: u.file_size for u in t.units}
            clash = [(f, n, known[f]) for f, n in files if f in known and known[f] != n]
            if clash:
                raise ProtocolError("file declared again with another size", name=t.name, file=clash[0][0],
                                    size=clash[0][1], declared=clash[0][2])
            new = [(f, n) for f, n in files if f not in known]
            if not new or t.done.is_set():
                return []
            base = len(t.units)
            added = [dataclasses.replace(u, id=base + u.id) for u in plan_units(new, unit_bytes)]
            for f in {u.file for u in added}:
                t.fds[f] = os.open(os.path.join(directory, f), os.O_RDONLY | os.O_CLOEXEC)
            t.units.extend(added)
            t.held.extend(added)
            t.written_at = None
        return added

    def written(self, b: dict[str, Any]) -> dict[str, Any]:
        """The writer of ``b["name"]`` has written ``b["written"]`` (``{file: bytes}``): those units may leave."""
        t = self._transfer(b["name"])
        if not isinstance(b["written"], dict):
            raise ProtocolError("written must map file names to byte counts", name=t.name)
        return {"released": self._release(t, b["written"]), "held": len(t.held)}

    def _release(self, t: Transfer, written: dict[str, Any]) -> int:
        """Move the held units now fully written to the lane (in file order); returns how many."""
        with self._lock:
            for f, n in written.items():
                t.written[check_file_name(str(f))] = max(int(n), t.written.get(str(f), 0))
            ready = [u for u in t.held if u.offset + u.length <= t.written.get(u.file, 0)]
            if not ready or t.done.is_set():
                return 0
            t.held = [u for u in t.held if u.offset + u.length > t.written.get(u.file, 0)]
            if not t.held:
                t.written_at = time.time()
        self.lane.add(t.name, ready, t.priority)
        return len(ready)

    def commit(self, b: dict[str, Any]) -> dict[str, Any]:
        """The source of ``b["name"]`` committed at ``b["path"]``: register it; publish the replica when sent."""
        t = self._transfer(b["name"])
        path = self._under_root(b["path"])
        # data files no writer declared (a rank whose call has not arrived yet): complete now that it committed
        self._declare(t, data_files(path), path, t.unit_bytes)
        t.meta = meta_files(path)
        t.committed_at = time.time()
        with self._lock:
            t.bytes_left_at_commit = sum(u.length for u in t.units if u.id not in t.acked)
            unreported = {u.file: u.file_size for u in t.held}
        if unreported:  # the writer committed without reporting every byte: committed means all are written
            self._release(t, unreported)
        if self.resolver is not None:
            self.resolver.register(t.name, path, self.endpoint, source=True)
        self._maybe_publish(t)
        return {"units": len(t.units)}

    def abort(self, b: dict[str, Any]) -> dict[str, Any]:
        t = self._transfer(b["name"])
        self.lane.remove(t.name)
        with self._lock:  # a window acknowledged from now on is not recorded (see _settle)
            t.error = "aborted: the source save failed"
            t.done.set()
        self._close_fds(t)
        return {}

    def urgent(self, b: dict[str, Any]) -> dict[str, Any]:
        t = self._transfer(b["name"])
        t.priority = float(b["priority"])
        self.lane.reprioritize(t.name, t.priority)
        return {}

    def wait(self, b: dict[str, Any]) -> dict[str, Any]:
        t = self._transfer(b["name"])
        if not t.done.wait(b.get("timeout")):
            raise CheckpointError("timed out waiting for the replica", name=t.name)
        if t.error:
            raise CheckpointError(f"replication failed: {t.error}", name=t.name, site=t.site)
        return {"path": t.path, "units": len(t.units), "bytes_sent": t.bytes_sent, "units_put": t.units_put,
                "started": t.started, "written_at": t.written_at, "bytes_left_at_commit": t.bytes_left_at_commit,
                "status_at": t.status_at,
                "committed_at": t.committed_at, "ready_at": t.ready_at}

    def pause(self, b: dict[str, Any]) -> dict[str, Any]:
        self.lane.set_budget(0)
        return {}

    def resume(self, b: dict[str, Any]) -> dict[str, Any]:
        self.lane.set_budget(None if b.get("units") is None else int(b["units"]))
        return {}

    def _transfer(self, name: str) -> Transfer:
        with self._lock:
            t = self.transfers.get(check_name(name))
        if t is None:
            raise CheckpointError("no replication of this checkpoint on this node", name=name)
        return t

    def _close_fds(self, t: Transfer) -> None:
        for fd in t.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        t.fds = {}

    def _client(self, site: str) -> flight.FlightClient:
        endpoint = self.routes.get(site)
        if endpoint is None and self.resolver is not None:
            endpoint = _site_endpoint(self.resolver, site)
        if endpoint is None:
            raise CheckpointError("no route to site", site=site)
        key = (endpoint, threading.get_ident())  # a connection per sending thread: each its own TCP flow control
        with self._lock:
            c = self._clients.get(key)
            if c is None:
                c = self._clients[key] = flight.connect(endpoint, generic_options=[
                    ("grpc.use_local_subchannel_pool", 1)])  # gRPC would share one connection among them
        return c

    def _drop_client(self, client: flight.FlightClient | None) -> None:
        """Forget a channel that failed: the next attempt connects afresh."""
        with self._lock:
            for k, c in list(self._clients.items()):
                if c is client:
                    del self._clients[k]

    def _retrying(self, site: str, fn: Callable[[flight.FlightClient, int], Any], *,
                  first_pause: bool = False) -> Any:
        """``fn(client, attempt)``; a site that is down or still starting (restarting) is waited for, with
        back-off, for up to ``retry_s``, each attempt on a fresh channel (``first_pause``: the caller saw the
        site fail already: pause before the first attempt too)."""
        deadline = time.monotonic() + self.retry_s
        pause = BACKOFF[0]
        attempt = 0
        if first_pause:
            self.retries += 1
            time.sleep(pause)
            pause = min(pause * 2, BACKOFF[1])
        while True:
            client = self._client(site)
            try:
                return fn(client, attempt)
            except (flight.FlightUnavailableError, flight.FlightServerError) as e:
                if isinstance(e, flight.FlightServerError) and not any(m in str(e) for m in _NOT_MOUNTED):
                    raise  # a refusal (bad token, bad unit): retrying cannot help
                self._drop_client(client)
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("site unreachable or starting, retrying",
                            extra={"site": site, "attempt": attempt, "error": str(e)[:200]})
                self.retries += 1
                time.sleep(pause)
                pause = min(pause * 2, BACKOFF[1])
                attempt += 1

    def _call(self, site: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps({**body, "token": self.token}).encode()
        res = self._retrying(site, lambda c, attempt: list(c.do_action(flight.Action(action, data))))
        return json.loads(res[0].body.to_pybytes()) if res else {}

    def _send_loop(self) -> None:
        """One sending thread: windows of a transfer's units, up to ``WINDOWS_IN_FLIGHT`` of them unacknowledged. A
        companion thread collects the acknowledgements, so the next window streams while the site syncs and
        acknowledges the previous one, and a unit released meanwhile (a save in progress) leaves at once."""
        slots = threading.Semaphore(WINDOWS_IN_FLIGHT)
        unacked = [0]
        acks: queue.Queue[_Window | None] = queue.Queue()

        def collect() -> None:
            while (w := acks.get()) is not None:
                try:
                    self._settle(w)
                finally:
                    with self._lock:
                        unacked[0] -= 1
                    slots.release()

        collector = threading.Thread(target=collect, name=f"{threading.current_thread().name}-acks", daemon=True)
        collector.start()
        try:
            while True:
                slots.acquire()  # at most WINDOWS_IN_FLIGHT unacknowledged: the other threads take the next units
                item = self.lane.pop()
                if item is None:
                    return  # the lane is closed
                name, unit = item
                # a window: this transfer's next units, sent back to back in one stream under one acknowledgement
                units = [unit, *self.lane.take(name, max(1, min(WINDOW_UNITS, WINDOW_BYTES // max(1, unit.length))) - 1)]
                with self._lock:
                    t = self.transfers.get(name)
                if t is None or t.done.is_set():
                    slots.release()
                    continue
                w = _Window(t, units)
                with self._lock:
                    unacked[0] += 1
                    self.sending["windows"] += 1
                    self.sending["in_flight_max"] = max(self.sending["in_flight_max"], unacked[0])
                try:
                    self._ask_status(t)
                    w.todo = [u for u in units if u.id not in (t.skip or ())]
                    if w.todo:
                        w.client = self._client(t.site)
                        w.stream = self._put_window(w.client, t, w.todo)
                except (flight.FlightUnavailableError, flight.FlightServerError) as e:
                    w.stream, w.error = None, e  # retried (or reported) when the window settles
                except Exception as e:  # noqa: BLE001 - recorded on the transfer, raised by replicate.wait
                    self._fail(t, e)
                    w.todo, w.units = [], []
                acks.put(w)
                if w.error is None and w.units:
                    with self._lock:
                        t.put.update(u.id for u in units)
                    self._maybe_publish(t, early=True)
        finally:
            acks.put(None)
            collector.join()

    def _settle(self, w: _Window) -> None:
        """Wait for window ``w``'s acknowledgement (a window the site dropped is sent again, by unit, with the
        retries of :meth:`_retrying`); then its units count as acknowledged and the replica may be published."""
        t = w.t
        if t.done.is_set():  # aborted or failed meanwhile: that is the transfer's outcome
            if w.stream is not None:
                try:
                    _ack(*w.stream)  # still end the call (an abandoned stream holds its channel)
                except Exception:  # noqa: BLE001 - the transfer's outcome is decided already
                    pass
            return
        try:
            if w.todo:
                sent = None
                if w.stream is not None:
                    try:
                        sent = self._window_acked(t, w.todo, *w.stream)
                    except (flight.FlightUnavailableError, flight.FlightServerError) as e:
                        w.error = e
                if sent is None:
                    if isinstance(w.error, flight.FlightServerError) and \
                            not any(m in str(w.error) for m in _NOT_MOUNTED):
                        raise w.error  # a refusal (bad token, bad unit): retrying cannot help
                    self._drop_client(w.client)
                    log.warning("site unreachable or starting, retrying",
                                extra={"site": t.site, "attempt": 0, "error": str(w.error)[:200]})
                    sent = self._retrying(t.site, lambda c, attempt: self._resend(c, t, w.todo), first_pause=True)
                with self._lock:
                    t.bytes_sent += sum(u.length for u in sent)
                    t.units_put += len(sent)
            with self._lock:
                if t.done.is_set():
                    return  # aborted while the window was acknowledged: not progress of a transfer that ended
                now = time.time()
                t.acked.update(u.id for u in w.units)
                self.sent_log.extend((t.name, u.id, now) for u in w.units)
            self._maybe_publish(t)
        except Exception as e:  # noqa: BLE001 - recorded on the transfer, raised by replicate.wait
            self._fail(t, e)

    def _fail(self, t: Transfer, e: Exception) -> None:
        if t.done.is_set():
            return  # aborted meanwhile: that is the transfer's outcome
        log.warning("replication failed", extra={"checkpoint": t.name, "error": str(e)})
        t.error = str(e)
        self.lane.remove(t.name)
        self._close_fds(t)
        t.done.set()

    def _put_window(self, client: flight.FlightClient, t: Transfer, units: list[Unit]) -> tuple[Any, Any]:
        """``units`` back to back in one ``DoPut replica.units`` (written, not yet acknowledged); the site verifies
        each, makes them durable together (one sync per file) and acknowledges them at once."""
        cmd = {"op": "replica.units", "name": t.name, "token": self.token}
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("replica.units", json.dumps(cmd)), SCHEMA)
        try:
            for u in units:
                body, digest = read_unit(t.fds[u.file], u)
                mv = memoryview(body)
                header = pa.py_buffer(json.dumps(u.header(digest)).encode())
                for pos in range(0, max(len(mv), 1), WIRE_CHUNK):
                    batch = binary_batch(mv[pos:pos + WIRE_CHUNK])
                    if pos == 0:
                        writer.write_with_metadata(batch, header)
                    else:
                        writer.write_batch(batch)
            writer.done_writing()
        except BaseException:
            try:
                writer.close()  # end the call: the site drops the cut unit, nothing of it is journaled
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
            raise
        return writer, reader

    def _window_acked(self, t: Transfer, units: list[Unit], writer: Any, reader: Any) -> list[Unit]:
        answer = _ack(writer, reader)  # verified and durable at the site
        if sorted(answer["units"]) != sorted(u.id for u in units):
            raise CheckpointError("site acknowledged other units than sent", name=t.name,
                                  sent=len(units), acked=len(answer["units"]))
        return units

    def _ask_status(self, t: Transfer) -> None:
        """Ask the site once which of ``t``'s units it holds (a resumed transfer skips them), without waiting:
        the windows that leave before the answer arrives cost no round trip, and the site drops the units of
        them it journaled already (see :meth:`ReplicaBuilder.write_units`)."""
        with self._lock:
            if t.status_asked:
                return
            t.status_asked = True

        def ask() -> None:
            try:
                held = self._held_at_site(t)
            except Exception as e:  # noqa: BLE001 - the windows meet the same trouble and retry by unit
                log.warning("replica status failed; windows go without it", extra={"checkpoint": t.name,
                                                                                  "error": str(e)[:200]})
                held = set()
            with self._lock:
                t.skip = (t.skip or set()) | held
                t.status_at = time.time()

        threading.Thread(target=ask, name="foresight-repl-status", daemon=True).start()

    def _held_at_site(self, t: Transfer) -> set[int]:
        """Ids of ``t``'s units the site journaled already. A unit counts only if the site journaled that id for
        the same extent: a transfer planned again (files declared in another order) never skips a unit by id."""
        res = self._call(t.site, "replica.status", {"name": t.name})
        if "extents" not in res:
            return set(res["units"])  # a site that journals ids alone
        have = {int(i): (f, int(o), int(n)) for i, f, o, n in res["extents"]}
        with self._lock:
            units = list(t.units)
        return {u.id for u in units if have.get(u.id) == (u.file, u.offset, u.length)}

    def _resend(self, client: flight.FlightClient, t: Transfer, units: list[Unit]) -> list[Unit]:
        """A window again after the site dropped it (restarted?): resume by unit, from what it journaled."""
        done = self._held_at_site(t)
        with self._lock:
            t.skip = (t.skip or set()) | done
        todo = [u for u in units if u.id not in done]
        return self._window_acked(t, todo, *self._put_window(client, t, todo)) if todo else []

    def _maybe_publish(self, t: Transfer, *, early: bool = False) -> None:
        """Publish ``t``'s replica once its source committed and the site acknowledged every unit; ``early``: as soon
        as every unit is on the wire (the site publishes only once it journaled them all, so the publish round trip
        overlaps the last windows' sync and acknowledgement; if a window fails the site says so and the
        acknowledgements publish it later). ``t`` is done once published and every acknowledgement is in."""
        with self._lock:
            if t.done.is_set() or t.publishing:
                return
            all_acked = len(t.acked) >= len(t.units)
            if t.path is not None:  # published early: done with the last acknowledgement
                if all_acked:
                    self._close_fds(t)
                    t.done.set()
                return
            if t.meta is None or not (all_acked or (early and len(t.acked | t.put) >= len(t.units))):
                return
            t.publishing = True
        try:
            names = sorted(t.meta)
            cmd = {"op": "replica.commit", "name": t.name, "units": len(t.units), "source_site": self.site,
                   "files": [[n, len(t.meta[n])] for n in names], "token": self.token, "early": not all_acked}
            body = b"".join(t.meta[n] for n in names)  # index + COMMIT, or DCP .metadata: any size

            def put(client: flight.FlightClient, attempt: int) -> dict[str, Any]:
                writer, reader = client.do_put(flight.FlightDescriptor.for_path("replica.commit", json.dumps(cmd)),
                                               SCHEMA)
                mv = memoryview(body)
                for pos in range(0, max(len(mv), 1), WIRE_CHUNK):
                    writer.write_batch(binary_batch(mv[pos:pos + WIRE_CHUNK]))
                writer.done_writing()
                return _ack(writer, reader)

            res = self._retrying(t.site, put)
        except Exception as e:  # noqa: BLE001
            if not all_acked and "units missing" in str(e):
                with self._lock:  # a window did not make it: it is resent, its acknowledgement publishes
                    t.publishing = False
                log.info("early publish refused: units missing at the site", extra={"checkpoint": t.name})
                self._maybe_publish(t)  # the last acknowledgement may have come in meanwhile
                return
            t.error = f"publishing the replica failed: {e}"
            self._close_fds(t)
            t.done.set()
            return
        with self._lock:
            t.path, t.ready_at, t.publishing = res["path"], time.time(), False
        self._maybe_publish(t)

    # -- receiver --------------------------------------------------------------------------------
    def replica_status(self, b: dict[str, Any]) -> dict[str, Any]:
        """Units journaled here: ``units`` (ids) and ``extents`` (``[id, file, offset, length]``)."""
        done = ReplicaBuilder(self.root, check_name(b["name"])).done_extents()
        return {"units": sorted(done), "extents": [[i, *e] for i, e in sorted(done.items()) if e is not None]}

    def _put_unit(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        cmd = _command(descriptor)
        self.check_token(cmd)
        ReplicaBuilder(self.root, check_name(cmd["name"])).write_unit(cmd["header"], _chunks(reader))
        writer.write(pa.py_buffer(b"{}"))

    def _put_units(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """A window of units back to back (each opened by a JSON header in its first batch's metadata)."""
        cmd = _command(descriptor)
        self.check_token(cmd)
        rb = ReplicaBuilder(self.root, check_name(cmd["name"]))
        with self._lock:
            self._receiving[rb.name] = self._receiving.get(rb.name, 0) + 1
        try:
            done, syncs = rb.write_units(_unit_parts(reader))
        finally:
            with self._lock:
                self._receiving[rb.name] -= 1
                if not self._receiving[rb.name]:
                    del self._receiving[rb.name]
                self._lock.notify_all()
        with self._lock:
            self.received["windows"] += 1
            self.received["units"] += len(done)
            self.received["syncs"] += syncs
        writer.write(pa.py_buffer(json.dumps({"units": done}).encode()))

    def _put_commit(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """The source committed and every unit arrived: verify, publish by rename, register under the TTL."""
        cmd = _command(descriptor)
        self.check_token(cmd)
        rb = ReplicaBuilder(self.root, check_name(cmd["name"]))
        body = b"".join(bytes(c) for c in _chunks(reader))
        meta, pos = {}, 0
        for fname, n in cmd["files"]:
            meta[check_file_name(str(fname))] = body[pos:pos + int(n)]
            pos += int(n)
        if pos != len(body):
            raise CheckpointError("commit body does not match its file list", name=rb.name)
        if cmd.get("early"):  # sent with the last windows: wait while they are still being received here
            with self._lock:
                self._lock.wait_for(lambda: not self._receiving.get(rb.name) or
                                    len(rb.done_units()) >= int(cmd["units"]), timeout=self.retry_s)
        path = rb.finalize(meta, int(cmd["units"]))  # never published before every unit is journaled and verified
        if self.resolver is not None:
            self.resolver.register(rb.name, path, self.endpoint, ttl=self.replica_ttl)
        writer.write(pa.py_buffer(json.dumps({"path": path}).encode()))

    # -- reads -----------------------------------------------------------------------------------
    def _checkpoint_dir(self, name: str) -> str:
        path = os.path.join(self.root, *check_name(name).split("/"))
        if self.resolver is not None and not os.path.isdir(path):
            mine = [c for c in self.resolver.copies(name) if c["site"] == self.site]
            if mine:
                path = mine[0]["path"]
        return self._under_root(path)

    def do_get(self, ticket: dict[str, Any]) -> flight.FlightDataStream:
        self.check_token(ticket)
        if ticket.get("kind") == "ckpt.list":  # the data files and their sizes (a remote copy is pulled whole)
            body = json.dumps(data_files(self._checkpoint_dir(ticket["name"]))).encode()
            return flight.RecordBatchStream(pa.Table.from_batches([binary_batch(memoryview(body))]))
        path = os.path.join(self._checkpoint_dir(ticket["name"]), check_file_name(ticket["file"]))
        if ticket.get("kind") == "ckpt.file":
            with open(path, "rb") as f:
                return flight.RecordBatchStream(pa.Table.from_batches([binary_batch(memoryview(f.read()))]))
        if ticket.get("kind") != "ckpt.read":
            raise CheckpointError("unknown DoGet ticket", kind=ticket.get("kind"))
        ranges = [(int(o), int(n)) for o, n in ticket["ranges"]]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        bad = [(o, n) for o, n in ranges if o < 0 or n < 0 or o + n > size]
        if bad:  # refused before the stream starts: the reader gets one clear error
            os.close(fd)
            raise CheckpointError("range outside the checkpoint file", path=path, offset=bad[0][0],
                                  length=bad[0][1], size=size)

        def batches():
            try:
                for off, n in ranges:
                    for pos in range(0, n, WIRE_CHUNK):
                        k = min(WIRE_CHUNK, n - pos)
                        data = os.pread(fd, k, off + pos)
                        if len(data) != k:
                            raise CheckpointError("read past the end of a checkpoint file", path=path,
                                                  offset=off + pos)
                        yield binary_batch(memoryview(data))
            finally:
                os.close(fd)

        return flight.GeneratorStream(SCHEMA, batches())


def _site_endpoint(resolver: Any, site: str) -> str | None:
    v = resolver._etcd.get(f"/foresight/sites/{site}/replication")
    return v[0].decode() if v else None


def call(endpoint: str, action: str, body: dict[str, Any] | None = None, *, client: Any = None) -> dict[str, Any]:
    """One ``DoAction`` with a JSON body; returns the JSON answer."""
    c = client or flight.connect(endpoint)
    try:
        res = list(c.do_action(flight.Action(action, json.dumps(body or {}).encode())))
    finally:
        if client is None:
            c.close()
    return json.loads(res[0].body.to_pybytes()) if res else {}


_REQUIRED = {
    "replication.ping": (), "replicate.start": ("name", "src", "site"), "replicate.written": ("name", "written"),
    "replicate.commit": ("name", "path"),
    "replicate.abort": ("name",), "replicate.urgent": ("name", "priority"), "replicate.wait": ("name",),
    "replicate.pause": (), "replicate.resume": (), "replicate.log": (), "replica.status": ("name",),
}


def _clear_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """OS and lookup errors become :class:`CheckpointError` naming the file, which the node reports as a refusal
    (instead of a Python traceback in an UNKNOWN status)."""

    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            raise CheckpointError(f"replication: {e.strerror or e}", path=e.filename) from e
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ForesightError):
                raise
            raise ProtocolError(f"replication request is malformed: {e!r}") from e

    return wrapped


def _decoder(action: str) -> Callable[[Any], dict[str, Any]]:
    """The node's request check for one action: a JSON object with the fields the handler needs."""

    def decode(o: Any) -> dict[str, Any]:
        if not isinstance(o, dict):
            raise ProtocolError("request must be a JSON object", action=action)
        missing = [k for k in _REQUIRED[action] if k not in o]
        if missing:
            raise ProtocolError("request lacks fields", action=action, missing=missing)
        if "name" in o and not isinstance(o["name"], str):
            raise ProtocolError("name must be a string", action=action)
        return o

    return decode


def _command(descriptor: Any) -> dict[str, Any]:
    if len(descriptor.path) != 2:
        raise ProtocolError("replication DoPut wants the path [kind, JSON command]")
    try:
        cmd = json.loads(descriptor.path[1])
    except ValueError as e:
        raise ProtocolError(f"replication DoPut command is not JSON: {e}") from None
    if not isinstance(cmd, dict) or not isinstance(cmd.get("name"), str):
        raise ProtocolError("replication DoPut command must be an object naming the checkpoint")
    return cmd


def _chunks(reader: Any) -> Any:
    for chunk in reader:
        col = chunk.data.column(0)
        offs = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + len(col) + 1]
        if len(col):
            yield memoryview(col.buffers()[2])[int(offs[0]):int(offs[-1])]


def _ack(writer: Any, reader: Any) -> dict[str, Any]:
    """The site's JSON answer to a DoPut. A stream the site dropped (it died or restarted) has none: its error
    surfaces at close; a refusal stays a ``FlightServerError``, anything else means the site is unavailable."""
    answer = reader.read()
    try:
        writer.close()
    except flight.FlightServerError:
        raise
    except flight.FlightError as e:
        raise flight.FlightUnavailableError(f"site dropped the stream: {e}") from e
    if answer is None:
        raise flight.FlightUnavailableError("site closed the stream without an answer")
    return json.loads(answer.to_pybytes())


def _unit_parts(reader: Any) -> Any:
    """``(header or None, body bytes)`` per record batch of a ``replica.units`` stream."""
    for chunk in reader:
        header = json.loads(chunk.app_metadata.to_pybytes()) if chunk.app_metadata is not None else None
        if header is not None and not isinstance(header, dict):
            raise ProtocolError("unit header must be a JSON object")
        col = chunk.data.column(0)
        offs = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + len(col) + 1]
        yield header, (memoryview(col.buffers()[2])[int(offs[0]):int(offs[-1])] if len(col) else b"")
