"""The training site's sending threads: windows of units in flight, their acknowledgements, retries, status.

Each sending thread takes a transfer's next units from the lane as one window (a ``DoPut replica.units``), keeps
windows unacknowledged up to :class:`InFlight`'s bounds (:data:`WINDOWS_IN_FLIGHT` full windows' bytes; a save in
progress releases its units a few at a time, and those small windows go without waiting for the acknowledgements
of the previous ones; a companion thread collects the answers), asks the site
once which units it holds already, and waits (with back-off, up to ``retry_s``) for a site that is down or
restarting, resending a dropped window by unit. A mixin of
:class:`~foresight.replication.service.ReplicationService`, whose constructor starts the threads.

Example::

    svc = ReplicationService("train-a", "/data/ckpt", routes={"eval-b": "grpc://wan-gateway:9000"}, streams=2)
    svc.sending   # {"windows": ..., "in_flight_max": ...}
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
from pyarrow import flight

from foresight.errors import CheckpointError
from foresight.replication.flight_calls import SCHEMA, _ack, _site_endpoint, binary_batch
from foresight.replication.transfer_sender import Transfer
from foresight.replication.units import Unit, read_unit

log = logging.getLogger("foresight.replicate")

RETRY_S = 60.0  # how long a sender waits for a site that is down or restarting before the transfer fails
BACKOFF = (0.25, 4.0)  # first and longest pause between attempts (doubling)
WINDOW_BYTES = 64 << 20  # a sender's window: units sent back to back under one acknowledgement (one sync per file)
WINDOW_UNITS = 64
WINDOWS_IN_FLIGHT = 2  # per sending thread, full windows' bytes unacknowledged: the next one streams while the
# previous one is synced and acknowledged
UNIT_WIRE_CHUNK = 1 << 20  # a unit's body goes in record batches this large: the site writes (and reports) the
# first bytes of a unit while the rest is on the way, not once a whole 8 MiB batch arrived
MAX_WINDOWS_IN_FLIGHT = 16  # per sending thread, however small (units released one by one while a save writes them)
# a site whose node answers but has not mounted replication yet (it is starting): wait for it like for one down
_NOT_MOUNTED = ("no DoPut for 'replica.", "unknown action")
# a unit whose bytes changed on the way (the site checks each against the xxh3 the sender computed): sent again,
# read afresh from the source, at most this many times per window before the transfer fails
_CORRUPT = "unit checksum mismatch"
CORRUPT_RESENDS = 3


class InFlight:
    """What one sending thread has unacknowledged: it may put another window while fewer than ``windows`` are
    unacknowledged and their bytes are under ``nbytes``. A bound on bytes, not on windows alone: a save in progress
    releases its units as they are written, each leaving in a small window of its own, and a count of windows would
    hold the next ones back for a round trip and the site's sync (the units then pile up behind the acknowledgements
    and are still to send at the commit); full windows of a committed checkpoint stay ``nbytes / WINDOW_BYTES``.

    >>> f = InFlight(windows=3, nbytes=100)
    >>> f.add(60); f.room(timeout=0), f.add(50), f.room(timeout=0)
    (True, None, False)
    >>> f.done(60); f.room(timeout=0)
    True
    """

    def __init__(self, *, windows: int = MAX_WINDOWS_IN_FLIGHT, nbytes: int = WINDOWS_IN_FLIGHT * WINDOW_BYTES) -> None:
        self.max_windows, self.max_bytes = windows, nbytes
        self.windows = self.bytes = 0
        self._cv = threading.Condition()

    def room(self, timeout: float | None = None) -> bool:
        """Wait until another window may go (``timeout``: at most that long); returns whether it may."""
        with self._cv:
            return self._cv.wait_for(lambda: self.windows < self.max_windows and self.bytes < self.max_bytes,
                                     timeout)

    def add(self, nbytes: int) -> None:
        with self._cv:
            self.windows += 1
            self.bytes += nbytes

    def done(self, nbytes: int) -> None:
        with self._cv:
            self.windows -= 1
            self.bytes -= nbytes
            self._cv.notify_all()


@dataclass
class _Window:
    """Units of one transfer sent under one acknowledgement; ``stream`` is its open DoPut awaiting the answer."""

    t: Transfer
    units: list[Unit]
    nbytes: int = 0
    todo: list[Unit] = field(default_factory=list)  # those the site did not hold already
    client: Any = None
    stream: tuple[Any, Any] | None = None
    error: Exception | None = None


class WindowSender:
    """The sending threads' loop, windows, acknowledgements and retries (mixed into ``ReplicationService``)."""

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
        """One sending thread: windows of a transfer's units, unacknowledged within :class:`InFlight`'s bounds. A
        companion thread collects the acknowledgements, so the next window streams while the site syncs and
        acknowledges the previous one, and a unit released meanwhile (a save in progress) leaves at once."""
        in_flight = InFlight()
        acks: queue.Queue[_Window | None] = queue.Queue()

        def collect() -> None:
            while (w := acks.get()) is not None:
                try:
                    self._settle(w)
                finally:
                    in_flight.done(w.nbytes)

        collector = threading.Thread(target=collect, name=f"{threading.current_thread().name}-acks", daemon=True)
        collector.start()
        try:
            while True:
                in_flight.room()  # the other threads take the next units meanwhile
                item = self.lane.pop()
                if item is None:
                    return  # the lane is closed
                name, unit = item
                # a window: this transfer's next units, sent back to back in one stream under one acknowledgement
                # (at most WINDOW_BYTES: a file's first units are small, the ones after them whole)
                units = [unit, *self.lane.take(name, WINDOW_UNITS - 1, max_bytes=WINDOW_BYTES - unit.length)]
                with self._lock:
                    t = self.transfers.get(name)
                if t is None or t.done.is_set():
                    continue
                w = _Window(t, units, nbytes=sum(u.length for u in units))
                in_flight.add(w.nbytes)
                with self._lock:
                    self.sending["windows"] += 1
                    self.sending["in_flight_max"] = max(self.sending["in_flight_max"], in_flight.windows)
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
                resends = 0
                while sent is None and _CORRUPT in str(w.error) and resends < CORRUPT_RESENDS:
                    resends += 1  # the site dropped a unit that arrived damaged (nothing of it journaled): again
                    with self._lock:
                        self.sending["resent_corrupt"] += 1
                    log.warning("a unit arrived damaged at the site; sending it again",
                                extra={"checkpoint": t.name, "site": t.site, "error": str(w.error)[:200]})
                    try:
                        sent = self._retrying(t.site, lambda c, attempt: self._resend(c, t, w.todo))
                    except flight.FlightServerError as e:
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
        # units of a save in progress: the site writes them with O_DIRECT, so its intake keeps pace with the save;
        # after the commit, through its page cache, which its verification then reads (see replica_file)
        direct = t.streaming and t.committed_at is None
        cmd = {"op": "replica.units", "name": t.name, "token": self.token, "direct": direct}
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("replica.units", json.dumps(cmd)), SCHEMA)
        try:
            for u in units:
                body, digest = read_unit(t.fds[u.file], u)
                mv = memoryview(body)
                header = pa.py_buffer(json.dumps(u.header(digest)).encode())
                for pos in range(0, max(len(mv), 1), UNIT_WIRE_CHUNK):
                    batch = binary_batch(mv[pos:pos + UNIT_WIRE_CHUNK])
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
