"""Merge a checkpoint at the evaluation site while its units arrive, publish it once the replica is.

The sender ships the checkpoint's *layout* first (``replica.layout``: each data file's stored chunks, the merge
wanted: module groups, evaluation world size), so the site lays the merged safetensors files out up front
(:class:`~foresight.replication.merge_plan.MergePlan`: headers written before any byte lands). Then each unit,
once verified against its xxh3 and durable in the replica (journaled), is read back and its chunks' bytes copied
to their places in the merged files, while later units are still on the wire: commit -> merged approaches
max(transfer left, merge) instead of their sum. Bytes of a unit that fails verification are never journaled, so
never merged; the unit sent again is.

At the source commit the replica is verified and published (:meth:`ReplicaBuilder.finalize`); only then does
the merge compare its layout with the checkpoint's own metadata (a difference: the output is laid out again from
the metadata, logged and counted in ``stats["relayouts"]``), copy any byte range not merged yet (units journaled
before the layout arrived), sync, and publish the merged directory by rename under
``<root>/.merged/<job>/<step>``. A merged output is never visible before the replica is.

Example::

    m = ArrivalMerge(replica_tmp, replica_final, out_final, {"groups": {"vision.": "vision"}, "reshard": 2})
    m.add_layout(rows, files=["__0_data.bin"], files_expected=2, meta={"source_format": "dcp"})
    m.arrived([(0, "__0_data.bin", 0, 33554432)])      # after the unit is journaled
    m.committed(replica_final)                          # after the replica is published
    m.wait(60)                                          # {"vision": [".../vision-rank00000-of-00002..."]}
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from foresight.checkpoint import store
from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir
from foresight.replication.merge import chunk_rows, chunks_from_rows, chunks_of
from foresight.replication.merge_plan import MergePlan
from foresight.replication.source import LocalSource
from foresight.replication.units import check_file_name, data_files

log = logging.getLogger("foresight.replicate")

FILL_BYTES = 32 << 20  # a range not merged on arrival is read back in pieces of this size at the commit


class ArrivalMerge:
    """One checkpoint merged as its units arrive (one worker thread; the receiver's handlers feed it)."""

    def __init__(self, replica_tmp: str, replica_final: str, out_final: str, spec: Mapping[str, Any]) -> None:
        self.replica_tmp, self.replica_final, self.out_final = replica_tmp, replica_final, out_final
        parent, leaf = os.path.split(out_final)
        self.out_tmp = os.path.join(parent, f".merging-{leaf}")
        groups, depth, reshard = spec.get("groups"), spec.get("depth") or 1, spec.get("reshard")
        if groups is not None and not isinstance(groups, dict):  # checked here: the site hears of it by name
            raise CheckpointError("merge groups must map name prefixes to group names", got=repr(groups)[:40])
        for k, v in (("depth", depth), ("reshard", reshard)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20):
                raise CheckpointError(f"merge {k} must be an integer >= 1", got=repr(v)[:40])
        self.groups = {str(k): str(v) for k, v in groups.items()} if groups else None
        self.depth, self.reshard = depth, reshard
        self.rows: list[list[Any]] = []
        self.files: set[str] = set()
        self.files_expected: int | None = None
        self.meta: dict[str, str] = {}
        self.plan: MergePlan | None = None
        self.events: list[list[Any]] = []  # ["journaled" | "merged", unit id], ["committed"], ["published"], ...
        self.stats = {"units_merged": 0, "bytes_copied": 0, "bytes_filled_at_commit": 0, "relayouts": 0}
        self.paths: dict[str, list[str]] | None = None
        self.error: str | None = None
        self._todo: list[tuple[int, str, int, int]] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._merged: dict[str, list[tuple[int, int]]] = {}  # byte ranges merged per data file
        self._commit_path: str | None = None
        self._in: dict[str, int] = {}
        self._out: list[int] = []
        self._cv = threading.Condition()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foresight-arrival-merge", daemon=True)
        self._thread.start()

    # -- fed by the receiver's handlers (never block on the merge) ---------------------------------------
    def add_layout(self, rows: list[list[Any]], *, files: Iterable[str], files_expected: int | None,
                   meta: Mapping[str, Any]) -> None:
        """Chunks of data files ``files`` (a DCP rank ships its own file); the output is planned once
        ``files_expected`` files are described (None: at the commit, from the checkpoint's metadata)."""
        chunks_from_rows(rows)  # a bad row is refused now, naming it
        if not isinstance(meta, Mapping) or isinstance(files, (str, bytes)) or not (
                files_expected is None or (isinstance(files_expected, int) and not isinstance(files_expected, bool))):
            raise CheckpointError("replica.layout wants meta as an object, files as a list and files_expected as an "
                                  "integer", got=repr((type(meta).__name__, type(files).__name__, files_expected))[:80])
        with self._cv:
            self.rows += rows
            self.files |= {check_file_name(str(f)) for f in files}
            if files_expected is not None:
                self.files_expected = int(files_expected)
            self.meta.update({str(k): str(v) for k, v in meta.items()})
            self._cv.notify_all()

    def arrived(self, extents: Iterable[tuple[int, str, int, int]]) -> None:
        """Units ``(id, file, offset, length)`` verified and durable in the replica (journaled)."""
        with self._cv:
            for e in extents:
                if (e[1], e[2], e[3]) in self._seen:
                    continue
                self._seen.add((e[1], e[2], e[3]))
                self.events.append(["journaled", int(e[0])])
                self._todo.append(tuple(e))
            self._cv.notify_all()

    def committed(self, path: str) -> None:
        """The replica is verified and published at ``path``: finish the merge and publish it."""
        with self._cv:
            self._commit_path = path
            self.events.append(["committed"])
            self._cv.notify_all()

    @property
    def finished(self) -> threading.Event:
        """Set once the merge is published or failed (what a bounded wait waits on)."""
        return self._done

    def wait(self, timeout: float | None) -> dict[str, list[str]]:
        if not self._done.wait(timeout):
            raise CheckpointError("timed out waiting for the merged output", path=self.out_final)
        if self.error:
            raise CheckpointError(f"merging as units arrive failed: {self.error}", path=self.out_final)
        assert self.paths is not None
        return self.paths

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {"done": self._done.is_set(), "error": self.error, "paths": self.paths,
                    "events": list(self.events), "stats": dict(self.stats), "planned": self.plan is not None}

    # -- the worker -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: (self.plan is None and self._ready_to_plan())
                                      or (self.plan is not None and self._todo) or self._commit_path is not None)
                    if self.plan is None and self._ready_to_plan():
                        self._start(chunks_from_rows(self.rows), dict(self.meta))
                    todo, commit = (self._todo, self._commit_path) if self.plan is not None else ([], None)
                    if self.plan is not None:
                        self._todo = []
                for uid, f, off, n in todo:
                    self._merge_range(f, off, n)
                    with self._cv:
                        self.events.append(["merged", uid])
                        self.stats["units_merged"] += 1
                if commit is not None or (self.plan is None and self._commit_path is not None):
                    self._finish(commit or self._commit_path)
                    return
        except Exception as e:  # noqa: BLE001 - reported by wait() / replica.merged, the replica is unaffected
            log.warning("merge as units arrive failed", extra={"path": self.out_final, "error": str(e)[:300]})
            self.error = str(e)
            shutil.rmtree(self.out_tmp, ignore_errors=True)
        finally:
            self._close()
            self._done.set()

    def _ready_to_plan(self) -> bool:
        return self.files_expected is not None and len(self.files) >= self.files_expected

    def _start(self, chunks: list[Any], meta: dict[str, str]) -> None:
        """Lay the output out and write the headers into preallocated hidden files."""
        self._close()
        shutil.rmtree(self.out_tmp, ignore_errors=True)
        self.plan = MergePlan(chunks, meta, groups=self.groups, depth=self.depth, reshard=self.reshard)
        self._merged = {}
        os.makedirs(self.out_tmp)
        for f in self.plan.files:
            fd = os.open(os.path.join(self.out_tmp, f.name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._out.append(fd)
            if f.size:
                os.posix_fallocate(fd, 0, f.size)
            _pwrite(fd, memoryview(f.header), 0)

    def _source_fd(self, file: str) -> int:
        fd = self._in.get(file)
        if fd is None:
            for d in (self.replica_tmp, self.replica_final):  # published meanwhile: the open descriptor survives
                try:
                    fd = os.open(os.path.join(d, check_file_name(file)), os.O_RDONLY | os.O_CLOEXEC)
                    break
                except FileNotFoundError:
                    continue
            else:
                raise CheckpointError("replica data file not found for merging", file=file, path=self.replica_tmp)
            self._in[file] = fd
        return fd

    def _merge_range(self, file: str, offset: int, length: int) -> None:
        """Copy the output bytes held in ``[offset, offset + length)`` of replica file ``file``."""
        assert self.plan is not None
        src, fi, dst, n = self.plan.segments_in(file, offset, length)
        if len(src):
            lo, hi = int(src.min()), int((src + n).max())
            buf = _pread(self._source_fd(file), lo, hi - lo, file)
            mv = memoryview(buf)
            for s, f, d, k in zip((src - lo).tolist(), fi.tolist(), dst.tolist(), n.tolist()):
                _pwrite(self._out[f], mv[s:s + k], d)
            self.stats["bytes_copied"] += int(n.sum())
        self._merged.setdefault(file, []).append((offset, offset + length))

    def _finish(self, path: str) -> None:
        """The replica is published: check the layout against its metadata, fill what was not merged, publish."""
        chunks, meta = chunks_of(LocalSource(path))
        shipped = chunk_rows(chunks_from_rows(self.rows))
        if self.plan is None or sorted(map(repr, chunk_rows(chunks))) != sorted(map(repr, shipped)) \
                or meta != self.meta:
            if self.plan is not None:  # the shipped layout was not the checkpoint's: lay it out again
                log.warning("layout shipped for merging differs from the checkpoint's metadata; merging again",
                            extra={"path": path})
                self.stats["relayouts"] += 1
            self._close()
            self._start(chunks, meta)
        for file, size in data_files(path):
            for a, b in _gaps(self._merged.get(file, []), size):
                for pos in range(a, b, FILL_BYTES):
                    k = min(FILL_BYTES, b - pos)
                    self._merge_range(file, pos, k)
                    self.stats["bytes_filled_at_commit"] += k
        assert self.plan is not None
        for fd in self._out:
            os.fdatasync(fd)
        fsync_dir(self.out_tmp)
        os.makedirs(os.path.dirname(self.out_final), exist_ok=True)
        store.publish_dir(self.out_tmp, self.out_final)
        with self._cv:
            self.paths = {g: [os.path.join(self.out_final, n) for n in names] for g, names in self.plan.groups.items()}
            self.events.append(["published"])
            self.stats["published_at"] = time.time()

    def _close(self) -> None:
        for fd in [*self._in.values(), *self._out]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._in, self._out = {}, []


def _gaps(done: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of ``[0, size)`` that no range in ``done`` covers."""
    out, at = [], 0
    for a, b in sorted(done):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < size:
        out.append((at, size))
    return out


def _pread(fd: int, offset: int, length: int, file: str) -> bytearray:
    buf = bytearray(length)
    mv, pos = memoryview(buf), 0
    while pos < length:
        k = os.preadv(fd, [mv[pos:]], offset + pos)
        if k <= 0:
            raise CheckpointError("replica file shorter than its layout", file=file, offset=offset + pos)
        pos += k
    return buf


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)

