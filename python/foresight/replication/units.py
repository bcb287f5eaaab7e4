"""Coalesced transfer units: a checkpoint's data files cut into large byte ranges, and the replica they build.

A WAN round trip costs ~100 ms whatever the size, so a checkpoint crosses sites as a few large *units*
(``UNIT_BYTES``, tens of MiB) instead of thousands of tensors: round trips per checkpoint = units. Each unit
carries its place (file, offset, length, file size) and the xxh3 of its body. The receiver writes units into a
hidden temp directory, journals each one only after its body verified and reached the disk (a cut transfer
resumes from the journal), and publishes the replica with one ``rename`` only after the source's commit
arrived and every tensor verified against the checkpoint's own per-tensor xxh3. So a replica that is visible
is complete; a cut transfer leaves only the hidden temp directory.

Example::

    units = plan_units(data_files("/ckpt/step-00000100"))
    rb = ReplicaBuilder("/eval/replicas", "job/step-00000100")
    for u in units:
        rb.write_unit(u.header(unit_xxh3), [body])
    rb.finalize({"index.json": ..., "COMMIT": ...}, expected_units=len(units))
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from foresight.checkpoint import store
from foresight.checkpoint.safe_pickle import load_dcp_metadata
from foresight.checksum import xxh3_many
from foresight.errors import CheckpointError
from foresight.io.durable import fsync_dir
from foresight.replication.replica_file import ReplicaFile

# Measured (bench/remote_merge.py --unit-sweep; 256 MiB over a 100 ms, 1 Gbit/s link, 2 units in flight):
# 1 MiB 12.8 MB/s, 4 MiB 34, 16 MiB 87, 32 MiB 100, 64 MiB 76 (too few units left to keep both streams busy).
UNIT_BYTES = 32 << 20
TAIL_SHARE = 4  # a file's units shrink to a quarter of what is left once under 4 units are left (unit_ends)
HEAD_UNITS = 4  # a file's first units: unit/16, /8, /4, /2 (unit_ends): the first leaves after little is written
DCP_METADATA = ".metadata"
_NAME_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
JOURNAL = ".units"
#: Most units one checkpoint is cut into (32 TiB at the default unit size): a plan past it is refused before it is
#: built, so a declared size of 2**60 bytes (a hostile or broken writer) cannot make the node loop and allocate.
MAX_UNITS = 1 << 20
#: Largest data file a site receives (64 TiB): a unit header's sizes and offsets past it are refused.
MAX_FILE_BYTES = 1 << 46


def check_name(name: str) -> str:
    """A checkpoint name (``job/step-00000100``): slash-separated safe parts, never escaping a root."""
    if not isinstance(name, str):
        raise CheckpointError("checkpoint name must be a string", got=repr(name)[:40])
    parts = name.split("/")
    if not name or not all(_NAME_PART.match(p) for p in parts):
        raise CheckpointError("bad checkpoint name (parts must be [A-Za-z0-9._-], no '..', no leading dot)",
                              name=name)
    return name


def check_file_name(name: str) -> str:
    if not isinstance(name, str):
        raise CheckpointError("file name in a checkpoint must be a string", got=repr(name)[:40])
    if "/" in name or not (_NAME_PART.match(name) or name == DCP_METADATA):
        raise CheckpointError("bad file name in a checkpoint", name=name)
    return name


def is_data_file(name: str) -> bool:
    return name.endswith(".bin")


def data_files(path: str) -> list[tuple[str, int]]:
    """``(name, size)`` of the data files of a checkpoint directory (committed or still being written)."""
    return sorted((n, os.stat(os.path.join(path, n)).st_size) for n in os.listdir(path) if is_data_file(n))


def meta_files(path: str) -> dict[str, bytes]:
    """The small files that make a checkpoint complete (``index.json`` + ``COMMIT``, or DCP ``.metadata``)."""
    names = [n for n in os.listdir(path) if n in (store.INDEX, store.COMMIT, DCP_METADATA)]
    if not (store.COMMIT in names or DCP_METADATA in names):
        raise CheckpointError("checkpoint is not committed (no COMMIT or .metadata)", path=path)
    out = {}
    for n in names:
        with open(os.path.join(path, n), "rb") as f:
            out[n] = f.read()
    return out


@dataclass(frozen=True)
class Unit:
    """Bytes ``[offset, offset + length)`` of data file ``file`` (``file_size`` bytes in all)."""

    id: int
    file: str
    offset: int
    length: int
    file_size: int

    def header(self, xxh3: int) -> dict[str, Any]:
        return {"id": self.id, "file": self.file, "offset": self.offset, "length": self.length,
                "file_size": self.file_size, "xxh3": f"{xxh3:016x}"}


def unit_ends(size: int, unit_bytes: int = UNIT_BYTES) -> list[int]:
    """Where a file of ``size`` bytes is cut into units: the end offset of each, in order.

    Units are ``unit_bytes`` long in the middle of the file. The first ones ramp up from ``unit_bytes / 16``,
    doubling (:data:`HEAD_UNITS` of them): a file sent while it is written has its first unit complete (and on the
    wire) after a sixteenth of a unit is written, not a whole one, so the link fills that much sooner. The file's
    last ``TAIL_SHARE * unit_bytes`` bytes shrink with what is left (a quarter of it, 4 KiB-aligned, down to
    ``unit_bytes / 16``): its last unit completes moments before the commit, so a small last unit leaves little to
    send after it.

    >>> ends = unit_ends(48 << 20, 8 << 20)   # unit sizes in MiB: 0.5, 1, 2, 4, 8, 8, 6.1, 4.6, ..., 0.5, 0.3
    >>> [round((b - a) / 2**20, 1) for a, b in zip([0] + ends[:8], ends[:8])], len(ends)
    ([0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 6.1, 4.6], 19)
    """
    if unit_bytes < 4096:
        raise ValueError(f"unit_bytes must be >= 4096, got {unit_bytes}")
    smallest = max(4096, unit_bytes // 16 // 4096 * 4096)
    ends, off = [], 0
    while off < size:
        left = size - off
        head = smallest << len(ends) if len(ends) < HEAD_UNITS else unit_bytes
        off += min(left, unit_bytes, head, max(smallest, left // TAIL_SHARE // 4096 * 4096))
        ends.append(off)
    return ends


def plan_units(files: Sequence[tuple[str, int]], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Cut each data file into units (:func:`unit_ends`; a file's tail shares no unit with the next file)."""
    if unit_bytes < 4096:
        raise CheckpointError("unit_bytes must be at least 4096", unit_bytes=unit_bytes)
    bound = 0  # units of a file: its full units plus the few shrinking ones of its tail (unit_ends: < 16)
    for name, size in files:
        check_file_name(name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError("a data file's size must be an integer >= 0", file=name, size=repr(size)[:40])
        bound += size // unit_bytes + 16
        if bound > MAX_UNITS:
            raise CheckpointError(f"checkpoint would be cut into more than {MAX_UNITS} units (sizes declared too "
                                  "large, or unit_bytes too small)", file=name, size=size, unit_bytes=unit_bytes)
    units: list[Unit] = []
    for name, size in files:
        off = 0
        for end in unit_ends(size, unit_bytes):
            units.append(Unit(len(units), name, off, end - off, size))
            off = end
    return units


def read_unit(fd: int, unit: Unit) -> tuple[bytearray, int]:
    """The unit's body (read from the open data file ``fd``) and its xxh3."""
    buf = bytearray(unit.length)
    view = memoryview(buf)
    pos = 0
    while pos < unit.length:
        n = os.preadv(fd, [view[pos:]], unit.offset + pos)
        if n <= 0:
            raise CheckpointError("data file shorter than its unit", file=unit.file, offset=unit.offset + pos)
        pos += n
    digest = int(xxh3_many(buf, np.array([0]), np.array([unit.length]))[0]) if unit.length else \
        xxhash.xxh3_64_intdigest(b"")
    return buf, digest


def tensor_extents(path: str) -> list[tuple[str, str, int, int, int]]:
    """``(file, tensor, offset, nbytes, xxh3)`` of every tensor of the checkpoint at ``path`` (either format)."""
    if os.path.exists(os.path.join(path, DCP_METADATA)):
        with open(os.path.join(path, DCP_METADATA), "rb") as f:  # may have come from another host: no code runs
            md = load_dcp_metadata(f, source=os.path.join(path, DCP_METADATA))
        return [(i.relative_path, str(k.fqn), int(i.offset), int(i.length), int(i.xxh3))
                for k, i in md.storage_data.items()]
    index = store.read_index(path)
    t = index["tensors"]
    files = [f["name"] for f in index["files"]]
    return [(files[fi], n, o, nb, int(h, 16))
            for fi, n, o, nb, h in zip(t["file"], t["name"], t["offset"], t["nbytes"], t["xxh3"])]


def verify_checkpoint(path: str) -> int:
    """Check every tensor's xxh3 (one native batch per file); return the tensor count or raise naming the tensor."""
    extents = tensor_extents(path)
    by_file: dict[str, list[tuple[str, str, int, int, int]]] = {}
    for e in extents:
        by_file.setdefault(e[0], []).append(e)
    for fname, ex in by_file.items():
        fpath = os.path.join(path, check_file_name(fname))
        offs = np.array([e[2] for e in ex], np.int64)
        lens = np.array([e[3] for e in ex], np.int64)
        want = np.array([e[4] for e in ex], np.uint64)
        size = os.stat(fpath).st_size
        if len(ex) and int((offs + lens).max()) > size:
            raise CheckpointError("replica data file is truncated", path=fpath, size=size)
        if size == 0:
            continue
        with open(fpath, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            got = xxh3_many(np.frombuffer(mm, np.uint8), offs, lens)
            bad = np.flatnonzero(got != want)
            del got
        if len(bad):
            k = int(bad[0])
            raise CheckpointError("replica tensor checksum mismatch", path=fpath, tensor=ex[k][1],
                                  offset=ex[k][2], corrupt_tensors=len(bad))
    return len(extents)


class _UnitSink:
    """One unit being received: its bytes go to their place in the (hidden) replica file, hashed on the way."""

    def __init__(self, tmp: str, header: dict[str, Any], files: dict[str, ReplicaFile],
                 held: dict[int, tuple[str, int, int] | None] | None = None, direct: bool = False) -> None:
        self.header = header
        self.file = check_file_name(header["file"])
        bad = [k for k in ("id", "offset", "length", "file_size") if isinstance(header.get(k), bool) or
               not isinstance(header.get(k), int) or not 0 <= header[k] <= MAX_FILE_BYTES]
        if bad:  # checked before anything is allocated: a size of 1e300 or 2**62 is refused, naming the field
            raise CheckpointError(f"unit header field {bad[0]} must be an integer in [0, {MAX_FILE_BYTES}]",
                                  file=self.file, got=repr(header.get(bad[0]))[:40])
        self.offset, self.length, size = header["offset"], header["length"], header["file_size"]
        if self.offset + self.length > size:
            raise CheckpointError("unit lies outside its file", file=self.file, offset=self.offset, length=self.length)
        self.pos, self.h = self.offset, xxhash.xxh3_64()
        # journaled already (a sender that had not heard the status yet): its bytes are drained, not rewritten
        self.held = (held or {}).get(int(header["id"]), 0) == (self.file, self.offset, self.length)
        if self.held:
            self.out = None
            return
        out = files.get(self.file)
        if out is None:
            out = files[self.file] = ReplicaFile(os.path.join(tmp, self.file), size, direct=direct)
        self.out = out

    def write(self, chunk: Any) -> None:
        mv = memoryview(chunk).cast("B")
        if self.pos + len(mv) > self.offset + self.length:
            raise CheckpointError("unit body longer than its header", file=self.file, offset=self.pos)
        if self.held:
            self.pos += len(mv)
            return
        self.h.update(mv)
        self.out.pwrite(mv, self.pos)
        self.pos += len(mv)

    def finish(self) -> int:
        if self.pos != self.offset + self.length:
            raise CheckpointError("unit body cut short", file=self.file, offset=self.pos,
                                  expected=self.offset + self.length)
        if not self.held and self.h.intdigest() != int(self.header["xxh3"], 16):
            raise CheckpointError("unit checksum mismatch", file=self.file, offset=self.offset, unit=self.header["id"])
        return int(self.header["id"])

    def journal_line(self) -> str:
        return f"{int(self.header['id'])}\t{self.file}\t{self.offset}\t{self.length}\n"


class ReplicaBuilder:
    """Receiver side of one checkpoint: units land in ``<root>/<job>/.replica-<step>``, published by rename."""

    def __init__(self, root: str, name: str, *, create: bool = True) -> None:
        """``create=False``: the temp directory is made only when something is written (a status query or a
        commit that is refused leaves nothing behind)."""
        self.name = check_name(name)
        self.final = os.path.join(root, *name.split("/"))
        parent, leaf = os.path.split(self.final)
        self.tmp = os.path.join(parent, f".replica-{leaf}")
        if create:
            os.makedirs(self.tmp, exist_ok=True)
        self.journaled: list[tuple[int, str, int, int]] = []  # the units the last write_units journaled
        self.arrived: list[tuple[int, int, float]] = []  # and (id, length, time its last byte arrived) of each
        self.pieces: list[tuple[float, int]] = []  # and (time, bytes) of each piece of a body as it arrived
        self.written = {"direct_bytes": 0, "buffered_bytes": 0, "direct_refused": 0}  # by the last write_units

    def done_units(self) -> set[int]:
        """Units already journaled (their bytes verified and fsynced): a resumed transfer skips them."""
        return set(self.done_extents())

    def done_extents(self) -> dict[int, tuple[str, int, int] | None]:
        """Journaled units: id -> ``(file, offset, length)`` (None for a line of the id alone). A sender whose plan
        numbers units differently (files declared in another order) skips only the units whose extent matches."""
        try:
            with open(os.path.join(self.tmp, JOURNAL)) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return {}
        out: dict[int, tuple[str, int, int] | None] = {}
        for line in lines:
            parts = line.split("\t")
            if parts[0]:
                out[int(parts[0])] = (parts[1], int(parts[2]), int(parts[3])) if len(parts) == 4 else None
        return out

    def write_unit(self, header: dict[str, Any], chunks: Iterable[Any]) -> None:
        """Write a unit's body (``chunks`` in order) at its offset; journal it only if its xxh3 matches."""
        def parts() -> Iterable[tuple[dict[str, Any] | None, Any]]:
            yield header, b""
            for c in chunks:
                yield None, c

        self.write_units(parts())

    def write_units(self, parts: Iterable[tuple[dict[str, Any] | None, Any]], *,
                    direct: bool = False) -> tuple[list[int], int]:
        """Units back to back: ``(header, first chunk)`` opens a unit, ``(None, chunk)`` continues it. Each unit is
        verified against its xxh3 as it ends; then the files touched get one ``fdatasync`` each and the units one
        journal append (durability batched per window, never a unit journaled before its bytes are on disk). A unit
        journaled already for the same extent is drained and acknowledged, not written again.
        ``direct``: the bodies go to disk with O_DIRECT where aligned (units of a save in progress, see
        :mod:`~foresight.replication.replica_file`); else through the page cache.
        Returns the unit ids journaled and the syncs made; ``self.journaled`` lists them as
        ``(id, file, offset, length)``, ``self.arrived`` as ``(id, length, time.time() its last byte came)``,
        ``self.pieces`` each piece of a body as ``(time.time() it came, bytes)`` (what had crossed the link when),
        ``self.written`` the bytes written with O_DIRECT (``direct_bytes``) and buffered (``buffered_bytes``) and the
        O_DIRECT opens or writes refused (``direct_refused``)."""
        os.makedirs(self.tmp, exist_ok=True)
        files: dict[str, ReplicaFile] = {}
        done: list[int] = []
        cur: _UnitSink | None = None
        lines: list[str] = []
        held = self.done_extents()  # a unit journaled already (same id, same extent) is drained, not rewritten
        extents: list[tuple[int, str, int, int]] = []
        arrived: list[tuple[int, int, float]] = []
        pieces: list[tuple[float, int]] = []
        try:
            for header, chunk in parts:
                if header is not None:
                    if cur is not None:
                        done.append(cur.finish())
                        lines += [] if cur.held else [cur.journal_line()]
                        extents.append((done[-1], cur.file, cur.offset, cur.length))
                        arrived.append((done[-1], cur.length, time.time()))
                    cur = _UnitSink(self.tmp, header, files, held=held, direct=direct)
                elif cur is None:
                    raise CheckpointError("unit body before its header", name=self.name)
                pieces.append((time.time(), len(memoryview(chunk).cast("B"))))  # as it came off the wire
                cur.write(chunk)
            if cur is not None:
                done.append(cur.finish())
                lines += [] if cur.held else [cur.journal_line()]
                extents.append((done[-1], cur.file, cur.offset, cur.length))
                arrived.append((done[-1], cur.length, time.time()))
            for f in files.values():
                f.sync()
        finally:
            for f in files.values():
                f.close()
        if done:
            jfd = os.open(os.path.join(self.tmp, JOURNAL), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                os.write(jfd, "".join(lines).encode())
                os.fdatasync(jfd)
            finally:
                os.close(jfd)
        self.journaled, self.arrived, self.pieces = extents, arrived, pieces
        self.written = {k: sum(f.counts[k] for f in files.values()) for k in ("direct_bytes", "buffered_bytes")}
        self.written["direct_refused"] = sum(f.counts["fallbacks"] for f in files.values())
        return done, len(files) + (1 if done else 0)

    def published(self, meta: dict[str, bytes]) -> bool:
        """Whether this replica was published already with these commit files (``meta``, which name every tensor's
        xxh3) and no unit is being journaled for it: a commit sent again after its registration failed finds it
        so; an empty temp directory of its name is removed."""
        if os.path.exists(os.path.join(self.tmp, JOURNAL)) or not meta:
            return False
        for n, body in meta.items():
            try:
                with open(os.path.join(self.final, check_file_name(n)), "rb") as f:
                    if f.read() != body:
                        return False
            except FileNotFoundError:
                return False
        try:
            os.rmdir(self.tmp)
        except OSError:  # absent, or not empty: files of another transfer of this name are left to it
            pass
        return True

    def finalize(self, meta: dict[str, bytes], expected_units: int) -> str:
        """All units present + the source's commit files -> verify every tensor -> atomic rename; return the path."""
        missing = set(range(expected_units)) - self.done_units()
        if missing:
            raise CheckpointError("replica incomplete: units missing", name=self.name, missing=len(missing))
        os.makedirs(self.tmp, exist_ok=True)
        for n, body in meta.items():
            store.write_small_file(os.path.join(self.tmp, check_file_name(n)), body)
        verify_checkpoint(self.tmp)
        try:
            os.remove(os.path.join(self.tmp, JOURNAL))
        except FileNotFoundError:
            pass
        fsync_dir(self.tmp)
        return store.publish_dir(self.tmp, self.final)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
