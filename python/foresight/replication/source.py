"""Where a reader's checkpoint bytes come from: a local directory, or a remote site's node over Flight.

Both answer the same two questions: a small file's bytes (``index.json``, DCP ``.metadata``) and many
extents at once. Extents are coalesced (:func:`foresight.io.coalesce.coalesce`) into few large reads; a
remote source sends all of one file's reads in one ``DoGet``, so a merge pays one round trip per file, not
per tensor. ``per_extent=True`` is the baseline a remote filesystem gives (one request per tensor).

Example::

    src = LocalSource("/eval/replicas/job/step-00001000")
    region, tr = src.read_extents(["__0_data.bin"], np.array([0, 0]), np.array([0, 4096]), np.array([10, 20]))
    first = tr.view(region, 0)
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from foresight.errors import CheckpointError
from foresight.io.coalesce import Transfers, coalesce
from foresight.replication.units import check_file_name, check_name

MAX_GAP = 1 << 20  # a remote round trip costs far more than reading a 1 MiB hole
MAX_TRANSFER = 64 << 20
WIRE_CHUNK = 8 << 20  # bytes per Flight record batch


def plan_reads(file_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, *, per_extent: bool) -> Transfers:
    if per_extent:  # no merging: each extent its own request
        return coalesce(file_ids, offsets, lengths, max_gap=0, max_transfer=1, align=1)
    return coalesce(file_ids, offsets, lengths, max_gap=MAX_GAP, max_transfer=MAX_TRANSFER, align=1)


class LocalSource:
    """A checkpoint directory on this site."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.requests = 0  # read requests issued (one per coalesced transfer)

    def read_file(self, fname: str) -> bytes:
        path = os.path.join(self.path, check_file_name(fname))
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise CheckpointError("checkpoint file missing", path=path) from e

    def read_extents(self, files: list[str], file_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, *,
                     per_extent: bool = False) -> tuple[np.ndarray, Transfers]:
        tr = plan_reads(file_ids, offsets, lengths, per_extent=per_extent)
        region = np.empty(tr.total_bytes, np.uint8)
        fds = {}
        try:
            for f, off, n, dest in zip(tr.t_file.tolist(), tr.t_offset.tolist(), tr.t_length.tolist(),
                                       tr.t_dest.tolist()):
                if f not in fds:
                    fds[f] = os.open(os.path.join(self.path, check_file_name(files[f])), os.O_RDONLY | os.O_CLOEXEC)
                view = memoryview(region)[dest:dest + n]
                got = 0
                while got < n:
                    k = os.preadv(fds[f], [view[got:]], off + got)
                    if k <= 0:
                        raise CheckpointError("checkpoint file shorter than its index", path=files[f], offset=off + got)
                    got += k
                self.requests += 1
        except FileNotFoundError as e:
            raise CheckpointError("checkpoint data file missing", path=e.filename) from e
        finally:
            for fd in fds.values():
                os.close(fd)
        return region, tr


class RemoteSource:
    """A checkpoint held by another site's node (read with ``DoGet``; see :mod:`.service`)."""

    def __init__(self, endpoint: str, name: str, *, token: str = "") -> None:
        from pyarrow import flight

        self.endpoint, self.name, self.token = endpoint, check_name(name), token
        self._client = flight.connect(endpoint)
        self.requests = 0  # round trips
        self.bytes = 0  # payload bytes received

    def close(self) -> None:
        self._client.close()

    def _get(self, ticket: dict[str, Any]) -> Any:
        from pyarrow import flight

        self.requests += 1
        try:
            # the node routes JSON tickets by a leading "kind" field
            return self._client.do_get(flight.Ticket(json.dumps({**ticket, "token": self.token}).encode()))
        except flight.FlightError as e:
            raise CheckpointError(f"remote read failed: {e}", endpoint=self.endpoint, name=self.name,
                                  file=ticket.get("file")) from e

    def _table(self, ticket: dict[str, Any]) -> Any:
        from pyarrow import flight

        try:
            return self._get(ticket).read_all()  # a server-side refusal surfaces on the first read
        except flight.FlightError as e:
            raise CheckpointError(f"remote read failed: {e}", endpoint=self.endpoint, name=self.name,
                                  file=ticket.get("file")) from e

    def read_file(self, fname: str) -> bytes:
        table = self._table({"kind": "ckpt.file", "name": self.name, "file": check_file_name(fname)})
        body = b"".join(c.as_py() for c in table.column(0))
        self.bytes += len(body)
        return body

    def _land(self, reader: Any, region: np.ndarray, pos: int, end: int, fname: str) -> int:
        for chunk in reader:
            col = chunk.data.column(0)  # binary rows, in the order the ranges were asked for
            offs = np.frombuffer(col.buffers()[1], np.int32)[col.offset:col.offset + len(col) + 1]
            body = memoryview(col.buffers()[2])[int(offs[0]):int(offs[-1])] if len(col) else memoryview(b"")
            if pos + len(body) > end:
                raise CheckpointError("remote read returned too many bytes", name=self.name, file=fname)
            region[pos:pos + len(body)] = np.frombuffer(body, np.uint8)
            pos += len(body)
            self.bytes += len(body)
        return pos

    def list_files(self) -> list[tuple[str, int]]:
        """``(name, size)`` of the remote checkpoint's data files."""
        table = self._table({"kind": "ckpt.list", "name": self.name})
        return [(check_file_name(n), int(sz)) for n, sz in json.loads(b"".join(c.as_py() for c in table.column(0)))]

    def read_extents(self, files: list[str], file_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, *,
                     per_extent: bool = False) -> tuple[np.ndarray, Transfers]:
        from pyarrow import flight

        tr = plan_reads(file_ids, offsets, lengths, per_extent=per_extent)
        region = np.empty(tr.total_bytes, np.uint8)
        order = np.argsort(tr.t_dest, kind="stable")
        groups: list[tuple[int, list[int]]] = []
        for k in order.tolist():
            f = int(tr.t_file[k])
            if per_extent or not groups or groups[-1][0] != f:
                groups.append((f, []))
            groups[-1][1].append(k)
        for f, ks in groups:
            ranges = [[int(tr.t_offset[k]), int(tr.t_length[k])] for k in ks]
            reader = self._get({"kind": "ckpt.read", "name": self.name, "file": check_file_name(files[f]),
                                "ranges": ranges})
            pos, end = int(tr.t_dest[ks[0]]), int(tr.t_dest[ks[-1]] + tr.t_length[ks[-1]])
            try:
                pos = self._land(reader, region, pos, end, files[f])
            except flight.FlightError as e:
                raise CheckpointError(f"remote read failed: {e}", endpoint=self.endpoint, name=self.name,
                                      file=files[f]) from e
            if pos != end:
                raise CheckpointError("remote read returned too few bytes", name=self.name, file=files[f],
                                      got=pos, expected=end)
        return region, tr
