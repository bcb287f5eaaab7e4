"""The evaluation site's receiver: units arrive in windows, are journaled, and the replica is committed.

``DoPut replica.units`` (a window of units back to back: verified, synced once per file, journaled and acknowledged
together; the older ``replica.unit`` takes one), ``replica.status`` (units journaled already, so a resumed transfer
skips them) and ``DoPut replica.commit`` (wait for windows still arriving, check every unit, verify, rename,
register under the replica TTL). The journal itself is :class:`~foresight.replication.units.ReplicaBuilder`. A
mixin of :class:`~foresight.replication.service.ReplicationService`.

Example::

    svc.replica_status({"name": "step-100"})   # {"units": [0, 1], "extents": [[0, "data.bin", 0, 4194304], ...]}
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from foresight.errors import CheckpointError
from foresight.replication.flight_calls import _chunks, _command, _unit_parts
from foresight.replication.units import ReplicaBuilder, check_file_name, check_name


class TransferReceiver:
    """The receiving site's handlers (mixed into ``ReplicationService``)."""

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
