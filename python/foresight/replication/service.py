"""One site's replication handlers over Arrow Flight: send replicas, receive them, serve checkpoint reads.

The same handlers run on every site's node; which role they play depends on the call:

- training site (sender; every action but ``replication.ping`` checks the replication token):
  ``replicate.start`` (the data files are written, or being written with their sizes declared: cut them into
  units, queue those written in the :class:`~.scheduler.PriorityLane`; ``extend``: a DCP rank adds its own file to
  the transfer), ``replicate.written`` (a writer's
  progress: the units it completed leave now), ``replicate.commit`` (the source committed: the replica may now
  be published), ``replicate.abort``, ``replicate.urgent`` (raise a transfer's priority), ``replicate.wait`` (at most ``max_wait_s`` per call, ended
  when its caller goes away: :mod:`~foresight.replication.waits`),
  ``replicate.pause``/``replicate.resume`` (``{"units": n}`` lets exactly n more units go: throttling, and a
  deterministic order for tests), ``replicate.log`` (units in the order they were acknowledged; with ``name``,
  also ``arrived``: when each unit of that checkpoint arrived whole, and ``arrived_pieces``: when each piece of
  their bodies arrived, as the receiving site);
- evaluation site (receiver): ``DoPut`` of ``replica.units`` (a window of units back to back, each opened by its
  JSON header in the batch metadata; verified, synced once per file, journaled and acknowledged together; a unit
  journaled already is drained; ``direct``: units of a save in progress, written with O_DIRECT (``received``
  counts ``direct_bytes``/``buffered_bytes``); each sending thread keeps two full windows' bytes unacknowledged; the older
  ``replica.unit`` takes one), ``replica.status`` (units already journaled, with their extents: a resumed
  transfer skips them),
  ``DoPut`` of ``replica.commit`` (the source's index and COMMIT or ``.metadata``, sent as soon as every unit is on
  the wire; wait while windows of it are being received, check every unit is journaled, verify every tensor,
  rename, register in etcd under the replica TTL);
- any site: ``DoGet`` of ``ckpt.file`` / ``ckpt.read`` / ``ckpt.list`` (a small file; many byte ranges of one
  data file in one stream, so a remote reader pays a round trip per file; the data files and sizes),
  ``replication.ping``.

This module is the facade (constructor, handler table, :meth:`ReplicationService.mount`); the handlers live in
mixins, one job each: :mod:`~foresight.replication.transfer_sender` (transfers, publish),
:mod:`~foresight.replication.send_windows` (windows in flight, acknowledgements, retries),
:mod:`~foresight.replication.transfer_receiver` (units, journal, commit),
:mod:`~foresight.replication.checkpoint_reads` (``ckpt.*``) and :mod:`~foresight.replication.flight_calls`
(the wire schema, :func:`call`). They are mounted into the storage-node daemon's handler registry
(:meth:`ReplicationService.mount` on a :class:`foresight.node.server.NodeServer`;
``foresight node serve --site eval-b --route train-a=URL`` does it).

Example::

    svc = ReplicationService("train-a", "/data/ckpt", etcd="http://127.0.0.1:2379",
                             routes={"eval-b": "grpc://wan-gateway:9000"})
    svc.mount(node_server)
"""
from __future__ import annotations

import functools
import hmac
import math
import os
import re
import threading
from typing import Any, Callable

from pyarrow import flight

from foresight.errors import CheckpointError, ForesightError, ProtocolError
from foresight.replication.checkpoint_reads import CheckpointReads
from foresight.replication.resolver import Resolver
from foresight.replication.scheduler import PriorityLane
from foresight.replication.send_windows import RETRY_S, WindowSender
from foresight.replication.transfer_receiver import TransferReceiver
from foresight.replication.transfer_sender import Transfer, TransferSender
from foresight.replication.units import UNIT_BYTES
from foresight.replication.waits import MAX_WAIT_S, wait_event


class ReplicationService(TransferSender, WindowSender, TransferReceiver, CheckpointReads):
    """Replication handlers of the node at ``site`` serving checkpoints under ``root``.

    Args:
        routes: ``{site: flight endpoint}`` of the other sites' nodes (a WAN gateway address, say); sites not
            listed are looked up in etcd.
        replica_ttl: seconds a received replica stays registered (its etcd lease).
        retry_s: how long a sender waits (retrying with back-off) for a site that is down or still starting;
            after a restart the transfer resumes with the units the site has not journaled.
        max_wait_s: the longest one ``replicate.wait``/``replica.merged`` call holds a server thread (a caller
            asking more, or no timeout, hears "timed out ... at most N s" and asks again).
        streams: units in flight at once per sender (the WAN link stays busy during each unit's round trip).
    """

    def __init__(self, site: str, root: str, *, etcd: str | None = None, routes: dict[str, str] | None = None,
                 endpoint: str = "", token: str = "", unit_bytes: int = UNIT_BYTES, streams: int = 2,
                 replica_ttl: int = 3600, fifo: bool = False, retry_s: float = RETRY_S,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        if not (math.isfinite(float(max_wait_s)) and float(max_wait_s) > 0):  # 0: every wait answered at once,
            raise ValueError(f"max_wait_s={max_wait_s!r}: not a positive number of seconds")  # its caller asks again
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
        self.layout_failures = 0  # replica.layout calls that failed (the site then does not merge on arrival)
        # as a receiving site; bodies written with O_DIRECT or buffered (unaligned ends; a file system refusing it)
        self.received = {"windows": 0, "units": 0, "syncs": 0, "direct_bytes": 0, "buffered_bytes": 0,
                         "direct_refused": 0}
        self._receiving: dict[str, int] = {}  # windows being received per checkpoint
        # per checkpoint: (unit, length, arrived at) of each unit, (arrived at, bytes) of each piece of their bodies
        self._arrivals: dict[str, tuple[list[tuple[int, int, float]], list[tuple[float, int]]]] = {}
        self._merges: dict[str, Any] = {}  # checkpoints merged here as their units arrive (ArrivalMerge)
        # as a sender: windows put, most unacknowledged at once, windows sent again after a unit arrived damaged
        self.sending = {"windows": 0, "in_flight_max": 0, "resent_corrupt": 0, "register_failures": 0}
        self.max_wait_s = float(max_wait_s)
        self.waiters = 0  # server threads in replicate.wait / replica.merged now
        self.wait_capped = 0  # waits answered "timed out" at max_wait_s
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
            "replicate.log": lambda b: {"sent": self.sent_log, "received": self.received, "sending": self.sending,
                                        "layout_failures": self.layout_failures, "waiters": self.waiters,
                                        "wait_capped": self.wait_capped,
                                        **({"arrived": self.arrivals(b["name"]),
                                            "arrived_pieces": self.arrived_pieces(b["name"])}
                                           if b.get("name") else {})},
            "replica.status": self.replica_status, "replica.merged": self.replica_merged,
        }
        out: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"replication.ping": lambda b: {"site": self.site}}
        for name, fn in control.items():
            out[name] = functools.partial(self._checked, fn)
        return out

    def _checked(self, fn: Callable[..., dict[str, Any]], body: dict[str, Any], *extra: Any) -> dict[str, Any]:
        self.check_token(body)
        return fn(body, *extra)

    def _bounded_wait(self, event: threading.Event, timeout: float | None, cancelled: Callable[[], bool] | None,
                      what: str, **context: Any) -> None:
        """:func:`~foresight.replication.waits.wait_event` under the node's cap, counted (``replicate.log``:
        ``waiters`` now, ``wait_capped`` so far)."""
        with self._lock:
            self.waiters += 1
        try:
            wait_event(event, timeout, max_wait_s=self.max_wait_s, cancelled=cancelled, what=what, **context)
        except CheckpointError as e:
            if "max_wait_s" in e.context:
                with self._lock:
                    self.wait_capped += 1
            raise
        finally:
            with self._lock:
                self.waiters -= 1

    def check_token(self, body: dict[str, Any]) -> None:
        """Sites of one deployment share a replication token (node-to-node calls carry no job)."""
        if self.token and not hmac.compare_digest(str(body.get("token", "")).encode(), self.token.encode()):
            raise ProtocolError("bad or missing replication token")

    def mount(self, server: Any) -> None:
        """Register the actions, DoPut and DoGet kinds on a node server's handler registry."""
        for name, fn in self.handlers().items():
            if name in _WAITING:  # the wait ends when its caller goes away
                handler = _clear_errors(lambda context, req, fn=fn: fn(req, context.is_cancelled))
            else:
                handler = _clear_errors(lambda context, req, fn=fn: fn(req))
            server.register_action(name, _decoder(name), handler, job_scoped=False)
        server.register_put("replica.unit", _clear_errors(self._put_unit))
        server.register_put("replica.units", _clear_errors(self._put_units))
        server.register_put("replica.commit", _clear_errors(self._put_commit))
        server.register_put("replica.layout", _clear_errors(self._put_replica_layout))
        server.register_put("replicate.layout", _clear_errors(self._put_replicate_layout))
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


#: Actions that block until something happens: bounded by the node's cap and their caller's presence.
_WAITING = frozenset({"replicate.wait", "replica.merged"})

_REQUIRED = {
    "replication.ping": (), "replicate.start": ("name", "src", "site"), "replicate.written": ("name", "written"),
    "replicate.commit": ("name", "path"),
    "replicate.abort": ("name",), "replicate.urgent": ("name", "priority"), "replicate.wait": ("name",),
    "replicate.pause": (), "replicate.resume": (), "replicate.log": (), "replica.status": ("name",),
    "replica.merged": ("name",),
}


def _number(v: Any, lo: float, hi: float) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi


#: Fields the handlers store or act on later (in the sending threads): checked before any handler runs, so a
#: wrong type or value is refused with the field's name instead of failing later where no caller hears of it.
_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "name": lambda v: isinstance(v, str), "src": lambda v: isinstance(v, str), "path": lambda v: isinstance(v, str),
    "site": lambda v: isinstance(v, str) and _SITE.match(v) is not None,
    "priority": lambda v: _number(v, 0.0, 1e12),
    "timeout": lambda v: _number(v, 0.0, 365 * 86400.0),
    "units": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 40,
    "unit_bytes": lambda v: isinstance(v, int) and not isinstance(v, bool) and 4096 <= v <= 1 << 34,
}
_FIELD_WANTED = {"name": "a string", "src": "a string", "path": "a string",
                 "site": "a site name of 1-128 characters [A-Za-z0-9._-]", "priority": "a number in [0, 1e12]",
                 "timeout": "a number of seconds in [0, 1 year]", "units": "an integer >= 0",
                 "unit_bytes": "an integer in [4096, 16 GiB]"}
_SITE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _clear_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """OS and lookup errors become :class:`CheckpointError` naming the file, which the node reports as a refusal
    (instead of a Python traceback in an UNKNOWN status)."""

    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            raise CheckpointError(f"replication: {e.strerror or e}", path=e.filename) from e
        except (KeyError, TypeError, ValueError, OverflowError) as e:
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
        for field, check in _FIELD_CHECKS.items():
            if o.get(field) is not None and not check(o[field]):
                raise ProtocolError(f"{field} must be {_FIELD_WANTED[field]}", action=action, got=repr(o[field])[:40])
        return o

    return decode
