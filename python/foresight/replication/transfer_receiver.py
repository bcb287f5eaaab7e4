"""The evaluation site's receiver: units arrive in windows, are journaled, and the replica is committed.

``DoPut replica.units`` (a window of units back to back: verified, synced once per file, journaled and acknowledged
together; a save's units sent before its commit written with O_DIRECT, see
:mod:`~foresight.replication.replica_file`; the older ``replica.unit`` takes one), ``replica.status`` (units journaled already, so a resumed transfer
skips them) and ``DoPut replica.commit`` (wait for windows still arriving, check every unit, verify, rename,
register under the replica TTL). ``DoPut replica.layout`` (the chunks of the checkpoint's data files and the merge
wanted) starts an :class:`~foresight.replication.arrival_merge.ArrivalMerge` that merges each unit once journaled,
published after the replica; ``replica.merged`` waits for it. The journal itself is
:class:`~foresight.replication.units.ReplicaBuilder`. A mixin of
:class:`~foresight.replication.service.ReplicationService`.

Example::

    svc.replica_status({"name": "step-100"})   # {"units": [0, 1], "extents": [[0, "data.bin", 0, 4194304], ...]}
    svc.replica_merged({"name": "job/step-100", "timeout": 60})   # {"paths": {"vision": [...]}, "events": ...}
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import pyarrow as pa
from pyarrow import flight

from foresight.checkpoint import store
from foresight.errors import CheckpointError, NodeError, ProtocolError
from foresight.replication.arrival_merge import ArrivalMerge
from foresight.replication.flight_calls import _chunks, _command, _unit_parts, json_body
from foresight.replication.units import DCP_METADATA, JOURNAL, ReplicaBuilder, check_file_name, check_name

MERGED = ".merged"  # merged outputs live in <root>/.merged/<job>/<step> (no checkpoint name starts with a dot)
KEEP_MERGES = 64  # finished merges whose events replica.merged still reports (their files stay either way), and
# checkpoints whose unit arrival times replicate.log reports


class TransferReceiver:
    """The receiving site's handlers (mixed into ``ReplicationService``)."""

    def replica_status(self, b: dict[str, Any]) -> dict[str, Any]:
        """Units journaled here: ``units`` (ids) and ``extents`` (``[id, file, offset, length]``)."""
        done = ReplicaBuilder(self.root, check_name(b["name"]), create=False).done_extents()
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
            done, syncs = rb.write_units(_unit_parts(reader), direct=bool(cmd.get("direct")))
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
            for k, n in rb.written.items():  # bytes written with O_DIRECT / buffered, O_DIRECT refusals
                self.received[k] += n
            arrivals, pieces = self._arrivals.pop(rb.name, ([], []))  # re-inserted: the most recent ones are kept
            arrivals.extend(rb.arrived)
            pieces.extend(rb.pieces)
            self._arrivals[rb.name] = arrivals, pieces
            for old in list(self._arrivals)[:max(0, len(self._arrivals) - KEEP_MERGES)]:
                del self._arrivals[old]
            merge = self._merges.get(rb.name)
        if merge is not None:  # verified and durable: the merge may read them back
            merge.arrived(rb.journaled)
        writer.write(pa.py_buffer(json.dumps({"units": done}).encode()))

    def arrivals(self, name: str) -> list[list[Any]]:
        """``[[unit id, length, time its last byte arrived], ...]`` of the units of ``name`` received here (of
        the last :data:`KEEP_MERGES` checkpoints): which units were here whole at a given moment."""
        with self._lock:
            return [list(a) for a in self._arrivals.get(check_name(name), ([], []))[0]]

    def arrived_pieces(self, name: str) -> list[list[Any]]:
        """``[[time it arrived, bytes], ...]`` of each piece of a unit body of ``name`` received here (a unit is
        sent in pieces of :data:`~foresight.replication.send_windows.UNIT_WIRE_CHUNK`): how many bytes had crossed
        the link at a given moment, units received in part included."""
        with self._lock:
            return [list(a) for a in self._arrivals.get(check_name(name), ([], []))[1]]

    def _put_commit(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """The source committed and every unit arrived: verify, publish by rename, register under the TTL."""
        cmd = _command(descriptor)
        self.check_token(cmd)
        rb = ReplicaBuilder(self.root, check_name(cmd["name"]), create=False)
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
        if rb.published(meta):  # a commit sent again after etcd failed it: the replica is in place already
            path = rb.final
        else:
            path = rb.finalize(meta, int(cmd["units"]))  # never published before every unit is journaled, verified
            with self._lock:
                merge = self._merges.get(rb.name)
            if merge is not None:  # the merged output is published after the replica, never before
                merge.committed(path)
        if self.resolver is not None:
            try:
                self.resolver.register(rb.name, path, self.endpoint, ttl=self.replica_ttl)
            except NodeError as e:  # unavailable, not refused: the sender sends the commit again (see above)
                raise flight.FlightUnavailableError(f"foresight: replica not registered, {e}; published at "
                                                    f"{path}"[:1000]) from None
        writer.write(pa.py_buffer(json.dumps({"path": path}).encode()))

    def _put_replica_layout(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """``DoPut replica.layout``: a JSON body of any size (a checkpoint's chunk list outgrows an action)."""
        cmd = _command(descriptor)
        self.check_token(cmd)
        answer = self.replica_layout({**json_body(reader, "replica.layout"), "name": cmd["name"]})
        writer.write(pa.py_buffer(json.dumps(answer).encode()))

    def replica_layout(self, b: dict[str, Any]) -> dict[str, Any]:
        """The sender describes data files ``files`` of ``name``: their chunks (``rows``, see
        :func:`~foresight.replication.merge.chunk_rows`), the files to expect in all, the output metadata, and the
        merge wanted (``merge``: ``groups``, ``depth``, ``reshard``). The first call starts the merge."""
        rb = ReplicaBuilder(self.root, check_name(b["name"]))
        if not isinstance(b.get("rows") or [], list) or not isinstance(b.get("merge") or {}, dict):
            raise ProtocolError("replica.layout wants rows as a list and merge as an object", name=rb.name)
        with self._lock:
            merge = self._merges.get(rb.name)
            fresh = merge is None or merge.status()["done"]
            if fresh:
                out = os.path.join(self.root, MERGED, *rb.name.split("/"))
                self._merges.pop(rb.name, None)
                merge = self._merges[rb.name] = ArrivalMerge(rb.tmp, rb.final, out, b.get("merge") or {})
                finished = [n for n, m in self._merges.items() if m.status()["done"]]
                for n in finished[:max(0, len(finished) - KEEP_MERGES)]:  # oldest first: their outputs stay
                    del self._merges[n]
        merge.add_layout(b.get("rows") or [], files=b.get("files") or [], files_expected=b.get("files_expected"),
                         meta=b.get("meta") or {})
        if fresh:  # units journaled before the layout came: merged too (a later window is reported by its handler)
            merge.arrived([(i, *e) for i, e in rb.done_extents().items() if e is not None])
            if not os.path.exists(os.path.join(rb.tmp, JOURNAL)) and _committed(rb.final):
                merge.committed(rb.final)  # published already: merge it all now
        return {"planned": merge.status()["planned"]}

    def replica_merged(self, b: dict[str, Any], cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        """The merge of ``name``: with ``wait`` (default) block until published (``timeout``) and return its paths;
        ``wait: false`` returns its state as it is (``done``, ``events``, ``stats``)."""
        name = check_name(b["name"])
        with self._lock:
            merge = self._merges.get(name)
        if merge is None:
            if not b.get("wait", True):  # not heard of (yet)
                return {"done": False, "planned": False, "events": [], "stats": {}, "paths": None, "error": None}
            raise CheckpointError("no merge of this checkpoint at this site (no replica.layout came)", name=name)
        if b.get("wait", True):
            self._bounded_wait(merge.finished, b.get("timeout"), cancelled, "the merged output", name=name)
            merge.wait(0)  # done: its error, if any
        return merge.status()


def _committed(path: str) -> bool:
    return store.is_committed(path) or os.path.exists(os.path.join(path, DCP_METADATA))
