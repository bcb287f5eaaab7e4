"""Checkpoint reads any site serves: ``DoGet`` of ``ckpt.list``, ``ckpt.file`` and ``ckpt.read``.

``ckpt.list`` gives the data files and their sizes (a remote copy is pulled whole), ``ckpt.file`` one file (in wire
chunks, whatever its size),
``ckpt.read`` many byte ranges of one data file in one stream (a remote reader pays a round trip per file). A
replica registered in etcd is found by name. A mixin of :class:`~foresight.replication.service.ReplicationService`.

Example::

    svc.do_get({"kind": "ckpt.read", "name": "step-100", "file": "data.bin", "ranges": [[0, 4096]]})
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any

import pyarrow as pa
from pyarrow import flight

from foresight.errors import CheckpointError
from foresight.cluster.owned_stream import OwnedStream
from foresight.replication.flight_calls import SCHEMA, binary_batch
from foresight.replication.source import WIRE_CHUNK
from foresight.replication.units import check_file_name, check_name, data_files


class CheckpointReads:
    """The read handlers (mixed into ``ReplicationService``)."""

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
        # the file itself resolved too: a symlink in a checkpoint directory never serves bytes from outside the root
        path = self._under_root(os.path.join(self._checkpoint_dir(ticket["name"]), check_file_name(ticket["file"])))
        kind = ticket.get("kind")
        if kind not in ("ckpt.file", "ckpt.read"):
            raise CheckpointError("unknown DoGet ticket", kind=kind)
        ranges = [(int(o), int(n)) for o, n in ticket["ranges"]] if kind == "ckpt.read" else None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("not a regular file in the checkpoint", path=path)
            size = st.st_size
            if ranges is None:  # the whole file, in wire chunks: never held in memory at once, whatever its size
                ranges = [(0, size)]
            bad = [(o, n) for o, n in ranges if o < 0 or n < 0 or o + n > size]
            if bad:  # refused before the stream starts: the reader gets one clear error
                raise CheckpointError("range outside the checkpoint file", path=path, offset=bad[0][0],
                                      length=bad[0][1], size=size)
        except BaseException:
            os.close(fd)
            raise

        def batches():
            for off, n in ranges:
                for pos in range(0, n, WIRE_CHUNK):
                    k = min(WIRE_CHUNK, n - pos)
                    data = os.pread(fd, k, off + pos)
                    if len(data) != k:
                        raise CheckpointError("read past the end of a checkpoint file", path=path, offset=off + pos)
                    yield binary_batch(memoryview(data))

        return flight.GeneratorStream(SCHEMA, OwnedStream(batches(), lambda: os.close(fd)))
