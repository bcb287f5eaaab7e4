"""The training site's transfers: the control actions of predictive replication and the replica's publish.

``replicate.start`` plans a checkpoint's units and queues those written in the lane (``extend``: a DCP rank adds its
file), ``replicate.written`` releases units as the writer reports bytes, ``replicate.commit`` records the source
commit, ``replicate.abort``/``urgent``/``wait``/``pause``/``resume`` steer a :class:`Transfer`; once the site holds
every unit :meth:`TransferSender._maybe_publish` sends ``replica.commit``. The windows themselves leave from
:mod:`foresight.replication.send_windows`. A mixin of :class:`~foresight.replication.service.ReplicationService`,
whose constructor holds the state it uses.

Example::

    svc.start({"name": "step-100", "src": "/data/ckpt/step-100", "site": "eval-b"})
    svc.commit({"name": "step-100", "path": "/data/ckpt/step-100"})
    svc.wait({"name": "step-100", "timeout": 60})   # {"path": ..., "bytes_sent": ..., ...}
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa

from foresight.errors import CheckpointError, NodeError, ProtocolError
from foresight.replication.flight_calls import json_body, put_body, _command
from foresight.replication.units import Unit, check_file_name, check_name, data_files, meta_files, plan_units

log = logging.getLogger("foresight.replicate")


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
    merge: dict[str, Any] | None = None  # the site merges as units arrive (groups, depth, reshard)
    streaming: bool = False  # started by a writer still writing (files declared): units leave as it reports them
    layout_calls: list[threading.Thread] = field(default_factory=list)  # replica.layout calls under way
    done: threading.Event = field(default_factory=threading.Event)


class TransferSender:
    """The sender's control actions on :class:`Transfer` objects (mixed into ``ReplicationService``)."""

    def start(self, b: dict[str, Any]) -> dict[str, Any]:
        """Queue the units of ``b["name"]``'s data files in ``b["src"]`` for ``b["site"]``.

        Without ``files`` the data files are complete. With ``files`` (``[[name, size], ...]``, declared by a
        writer that is still writing) only units inside ``written`` (``{file: bytes written}``) leave now; the
        rest leave as :meth:`written` reports their bytes (send while saving). With ``extend`` (each rank of a
        DCP save declares its own file) the files join the transfer of that name in progress, if any; files it
        already has are ignored (a rank's late call after the commit found the file on disk). With ``merge``
        (``{"groups": ..., "depth": ..., "reshard": ...}``) the site merges the units as they arrive, from the
        chunks the writer sends next (:meth:`layout`); without them it merges at the commit."""
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
                if b.get("merge") is not None and old.merge is None:
                    old.merge = dict(b["merge"])
                    self._ship_layout(old, {})
                self._release(old, b.get("written") or {})
                return {"units": len(added), "bytes": sum(u.length for u in added)}
        units = plan_units(listed, unit_bytes)
        # open now: the writer renames the directory at its commit, open descriptors survive that
        fds = {f: os.open(os.path.join(src, f), os.O_RDONLY | os.O_CLOEXEC) for f in {u.file for u in units}}
        t = Transfer(name, b["site"], src, float(b.get("priority", 1.0)), units, fds)
        t.written = dict(listed) if declared is None else {}
        t.streaming = declared is not None
        t.held = list(units)
        t.unit_bytes = unit_bytes
        t.merge = None if b.get("merge") is None else dict(b["merge"])
        with self._lock:
            old = self.transfers.get(name)
            clash = old is not None and not old.done.is_set()
            if not clash:
                self.transfers[name] = t
        if clash:
            self._close_fds(t)
            if b.get("extend") and old.src == src:  # another rank's start got in first: join it
                return self.start(b)
            raise CheckpointError("replication of this checkpoint is already in progress", name=name)
        if t.merge is not None:  # the site hears of the merge now; the files' chunks follow (replicate.layout)
            self._ship_layout(t, {})
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

    def _put_replicate_layout(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """``DoPut replicate.layout`` (a body of any size, unlike an action): see :meth:`layout`."""
        cmd = _command(descriptor)
        self.check_token(cmd)
        writer.write(pa.py_buffer(json.dumps(self.layout({**json_body(reader, "replicate.layout"),
                                                          "name": cmd["name"]})).encode()))

    def layout(self, b: dict[str, Any]) -> dict[str, Any]:
        """The writer of ``b["name"]`` (started with ``merge``) describes its data files ``files``: their chunks
        (``rows`` of :func:`~foresight.replication.merge.chunk_rows`), the data files to expect in all
        (``files_expected``) and the merged files' metadata (``meta``); they go on to the site."""
        t = self._transfer(b["name"])
        if t.merge is None:
            raise ProtocolError("replicate.layout for a transfer started without merge", name=t.name)
        self._ship_layout(t, b)
        return {}

    def _ship_layout(self, t: Transfer, b: dict[str, Any]) -> None:
        """Send the site the merge wanted and the chunks ``b`` describes (see :meth:`layout`), off the caller's
        thread (the first windows need not wait; the site merges units journaled before it came). The replica is
        published only after these calls end, so the site knows of the merge before the commit."""
        if t.merge is None:
            return
        cmd = {"name": t.name, "token": self.token}
        body = json.dumps({"rows": b.get("rows") or [], "merge": t.merge, "meta": b.get("meta") or {},
                           "files": b.get("files") or [], "files_expected": b.get("files_expected")}).encode()

        def ship() -> None:
            try:
                self._retrying(t.site, lambda client, attempt: put_body(client, "replica.layout", cmd, body))
            except Exception as e:  # noqa: BLE001 - the replica goes on; the site merges nothing (logged)
                self.layout_failures += 1
                log.warning("shipping the layout for merging failed; the site will not merge this checkpoint",
                            extra={"checkpoint": t.name, "error": str(e)[:300]})

        th = threading.Thread(target=ship, name="foresight-repl-layout", daemon=True)
        with self._lock:
            t.layout_calls.append(th)
        th.start()

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
            try:  # an advertisement for readers: the replica does not wait on it
                self.resolver.register(t.name, path, self.endpoint, source=True)
            except NodeError as e:
                with self._lock:
                    self.sending["register_failures"] += 1
                log.warning("source copy not registered in etcd; the replica is sent anyway",
                            extra={"checkpoint": t.name, "error": str(e)[:300]})
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

    def wait(self, b: dict[str, Any], cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Block until the replica is published (at most ``timeout`` and the node's cap; ends when the caller goes
        away: :mod:`~foresight.replication.waits`)."""
        t = self._transfer(b["name"])
        self._bounded_wait(t.done, b.get("timeout"), cancelled, "the replica", name=t.name)
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
        for th in list(t.layout_calls):  # the site hears of the merge before the commit
            th.join(self.retry_s)
        try:
            names = sorted(t.meta)
            cmd = {"op": "replica.commit", "name": t.name, "units": len(t.units), "source_site": self.site,
                   "files": [[n, len(t.meta[n])] for n in names], "token": self.token, "early": not all_acked}
            body = b"".join(t.meta[n] for n in names)  # index + COMMIT, or DCP .metadata: any size

            res = self._retrying(t.site, lambda client, attempt: put_body(client, "replica.commit", cmd, body))
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
