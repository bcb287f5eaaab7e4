"""Streaming, crash-safe shard writer.

Everything is written into a hidden sibling directory ``.<name>.partial-<pid>-<rand>``; each shard's ``.bin`` and
``.map`` are fsynced when the shard closes; ``manifest.json`` is written (temp file, fsync, rename) only after all
shards; then the directory itself is fsynced and renamed to ``out_dir`` and the parent fsynced. A run killed at any
point leaves either no ``out_dir`` or a complete one: :func:`~foresight.format.open_dataset` never accepts a partial
pack. Stale partial directories of dead writers are removed by the next writer of the same ``out_dir``.

Bad arguments are refused before anything is written (the writer stays usable). A failure once writing has begun (a
full disk in ``add``, the map, the manifest or the rename in ``close``) removes the partial directory at once, closes
the writer and raises one error naming the file that failed (an ``OSError`` keeps its class and errno); ``abort``
never raises. An ``out_dir`` being replaced (``overwrite``) stays as it was; a crash between the overwrite's two
renames leaves it as ``.<name>.old-<pid>-<rand>``, which the next ``open_dataset`` or writer renames back.

Memory is bounded: payload bytes go straight to the shard file (checksums are streamed), and only the current shard's
map columns (about 33 bytes per sample plus its meta JSON) are held until that shard closes.

Example::

    with DatasetWriter("out/", align=4096, token_dtype="uint16") as w:
        w.add(b"raw bytes", modality="bytes", meta={"source": "x"})
        w.add_many(np.array([1, 2, 3, 4, 5], np.uint16), np.array([2, 3]), modality="tokens")
    ds = open_dataset("out/")
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from .. import __version__
from foresight.checksum import file_xxh3, xxh3_many
from foresight.errors import ForesightError
from foresight.io.durable import aside_path, fsync_dir, pid_alive, recover_overwrite
from .manifest import MANIFEST_NAME, Manifest, ShardEntry
from .reader import has_manifest
from .shard_map import write_map
from .types import TOKEN_DTYPES, Modality

__all__ = ["DatasetWriter", "check_parent_dir"]

_BATCH_BYTES = 32 << 20  # padded bytes staged per write in add_many (bounds temporary memory)


def _scatter_numpy(src: np.ndarray, src_offsets: np.ndarray, lengths: np.ndarray, dst: np.ndarray,
                   dst_offsets: np.ndarray) -> None:
    # Fallback when the Cython kernel is not built: a +1/-1 difference array marks where payload bytes go
    # (src ranges are back to back, dst ranges increasing and disjoint).
    marks = np.zeros(dst.size + 1, dtype=np.int8)
    np.add.at(marks, dst_offsets, 1)
    np.add.at(marks, dst_offsets + lengths, -1)
    dst[np.cumsum(marks[:-1], dtype=np.int8).view(bool)] = src[: int(lengths.sum())]


try:
    from .._format_kernels import scatter as _scatter
except ImportError:  # native part not built (pure-Python install): same result, slower
    _scatter = _scatter_numpy


def _json_default(value: Any) -> Any:
    # Probe results may carry numpy values or Fractions (time bases): store them as plain JSON.
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _round_up(x: np.ndarray | int, align: int):
    return x if not align else (x + (align - 1)) // align * align


def check_parent_dir(path: str | os.PathLike) -> None:
    """Raise NotADirectoryError naming the file when an existing ancestor of ``path`` is not a directory.

    Lets a command fail before its work, and with a clearer message than ``os.makedirs``' "File exists".

    >>> check_parent_dir("/tmp/new/dataset")
    """
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)  # ends at "/", which exists
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)}, so {os.fspath(path)} cannot be "
                                 f"created under it", parent)


def _named(e: OSError, path: str) -> OSError:
    """``e`` naming ``path`` when it names no file (buffered writes, fsync and close raise without one)."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, path).with_traceback(e.__traceback__)  # errno picks the same subclass


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise _named(e, path) from None


class _Shard:
    """The shard being written: its open ``.bin``, streamed checksum and accumulating map columns."""

    def __init__(self, directory: str, index: int, first_sample: int, buffer_bytes: int) -> None:
        self.index = index
        self.first_sample = first_sample
        self.bin_name = f"shard-{index:05d}.bin"
        self.map_name = f"shard-{index:05d}.map"
        self.bin_path = os.path.join(directory, self.bin_name)
        self.file = open(self.bin_path, "wb", buffering=buffer_bytes)
        self.hasher = xxhash.xxh3_64()
        self.pos = 0
        self.rows = 0
        self.cols: dict[str, list[np.ndarray]] = {"offset": [], "length": [], "modality": [], "checksum": []}
        self.meta: dict[int, bytes] = {}

    def write(self, data: memoryview | np.ndarray | bytes) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            raise _named(e, self.bin_path) from None
        self.hasher.update(data)
        self.pos += memoryview(data).nbytes


class DatasetWriter:
    """Pack samples into aligned shards with per-sample xxh3 checksums and an Arrow map per shard.

    Args:
        out_dir: the dataset directory to create (must not exist unless ``overwrite``).
        align: sample start alignment in bytes (0 = packed; else a power of two, 4096 for O_DIRECT reads).
        shard_bytes: roll to a new shard before one would exceed this size (a larger sample gets its own shard).
        token_dtype: dtype of TOKENS samples (one of ``TOKEN_DTYPES``); None = taken from the first token array.
        overwrite: replace an existing ``out_dir`` (swapped out only after the new dataset is complete).
        extra: JSON-able dict stored in the manifest (source, packer options).
        fsync: fsync files and directories (turn off only for throwaway data).
    """

    def __init__(self, out_dir: str | os.PathLike, *, align: int = 4096, shard_bytes: int = 1 << 30,
                 token_dtype: str | np.dtype | None = None, overwrite: bool = False,
                 extra: dict[str, Any] | None = None, fsync: bool = True, buffer_bytes: int = 8 << 20,
                 _on_stage: Callable[[str], None] | None = None) -> None:
        if not isinstance(align, int) or align < 0 or (align and align & (align - 1)) or align > 1 << 30:
            raise ValueError(f"align must be 0 or a power of two <= 2**30 (e.g. 4096), got {align!r}")
        if not isinstance(shard_bytes, int) or shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
        self.token_dtype = None if token_dtype is None else self._check_token_dtype(token_dtype)
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.align = align
        self.shard_bytes = shard_bytes
        self.overwrite = overwrite
        self.extra = dict(extra or {})
        self._fsync = fsync
        self._buffer_bytes = buffer_bytes
        self._on_stage = _on_stage
        json.dumps(self.extra)  # fail early on non-JSON extra
        # an earlier overwrite that crashed between its renames: its data is back (and refused below) or its
        # leftovers are gone before this pack starts
        recover_overwrite(self.out_dir, has_manifest)
        if os.path.lexists(self.out_dir) and not overwrite:
            raise FileExistsError(f"{self.out_dir} exists; pass overwrite=True (--overwrite) to replace it")
        parent, name = os.path.split(self.out_dir)
        check_parent_dir(self.out_dir)
        self.tmp_dir = os.path.join(parent, f".{name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.makedirs(parent, exist_ok=True)
            self._remove_stale_partials(parent, name)
            os.mkdir(self.tmp_dir)
        except OSError as e:
            if e.errno is None:
                raise
            raise OSError(e.errno, f"{e.strerror} (creating the dataset {self.out_dir})", e.filename) from None
        self._zeros = bytes(align) if align else b""
        self._shards: list[ShardEntry] = []
        self._shard: _Shard | None = None
        self._num_samples = 0
        self._codes_seen: set[int] = set()
        self._closed = False

    # -- public ------------------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return self._num_samples

    def add(self, payload: bytes | bytearray | memoryview | np.ndarray | str, *, modality: Modality | int | str,
            meta: dict[str, Any] | None = None) -> int:
        """Append one sample and return its global id. Token payloads are numpy arrays of ``token_dtype``."""
        self._check_open()
        mod = Modality.parse(modality)
        data = self._payload_bytes(payload, mod)
        n = data.nbytes
        with self._all_or_nothing():
            shard = self._shard_for(n)
            self._pad(shard)
            start = shard.pos
            shard.write(data)
            self._record(shard, np.array([start], np.uint64), np.array([n], np.uint64), mod,
                         np.array([xxhash.xxh3_64_intdigest(data)], np.uint64), [meta])
        return self._num_samples - 1

    def add_many(self, data: np.ndarray, lengths: np.ndarray | Sequence[int], *, modality: Modality | int | str,
                 meta: Sequence[dict[str, Any] | None] | None = None) -> np.ndarray:
        """Append ``len(lengths)`` samples stored back to back in ``data`` (lengths in elements, not bytes).

        TOKENS data must have ``token_dtype``; other modalities take any array (bytes are stored as they are).
        Writes and checksums run per batch, not per sample. Returns the new samples' global ids.
        """
        self._check_open()
        mod = Modality.parse(modality)
        data = np.ascontiguousarray(data).reshape(-1)
        if mod == Modality.TOKENS:
            self._token_array(data)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if lengths.size and int(lengths.min()) < 0:
            raise ValueError("add_many: negative length")
        if int(lengths.sum()) != data.size:
            raise ValueError(f"add_many: lengths sum to {int(lengths.sum())} but data has {data.size} elements")
        if meta is not None and len(meta) != lengths.size:
            raise ValueError(f"add_many: {lengths.size} samples but {len(meta)} meta entries")
        first_id = self._num_samples
        raw = data.view(np.uint8)
        nbytes = lengths * data.itemsize
        src = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(nbytes, out=src[1:])
        sums = xxh3_many(raw, src[:-1], nbytes)
        k = 0
        with self._all_or_nothing():
            while k < lengths.size:
                k = self._write_run(raw, src, nbytes, sums, k, mod, meta)
        return np.arange(first_id, self._num_samples, dtype=np.int64)

    def close(self) -> str:
        """Finish the last shard, write the manifest, publish ``out_dir`` atomically; returns its path.

        On any failure nothing is left behind (see the module docstring) and the error names the file.
        """
        if self._closed:
            return self.out_dir
        with self._all_or_nothing():
            self._close_shard()
            self._write_manifest()
            aside = self._publish()
        self._closed = True
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
        if self._fsync:  # published: a failure from here on is reported, but the dataset stays
            parent = os.path.dirname(self.out_dir)
            with _naming(parent):
                fsync_dir(parent)
        self._stage("renamed")
        return self.out_dir

    def abort(self) -> None:
        """Drop everything written so far (``out_dir`` is left untouched). Never raises: the bytes are dropped."""
        if not self._closed:
            self._discard()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """A step that writes: when it fails, the writer is unusable (a shard may hold half a write), so remove
        everything and raise the one error, saying so when it is an OSError."""
        try:
            yield
        except BaseException as e:
            self._discard()
            if not isinstance(e, OSError) or isinstance(e, ForesightError) or e.errno is None:
                raise
            raise OSError(e.errno, f"{e.strerror}; the pack into {self.out_dir} stopped and its partial files were "
                          f"removed", e.filename, None, e.filename2).with_traceback(e.__traceback__) from None

    def _discard(self) -> None:
        self._closed = True
        shard, self._shard = self._shard, None
        if shard is not None:
            try:
                shard.file.close()
            except OSError:
                pass  # flushing onto a full disk fails again; the bytes are being dropped anyway
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _write_manifest(self) -> None:
        modalities = [Modality(c).label for c in sorted(self._codes_seen)]
        manifest = Manifest(
            align=self.align,
            token_dtype=None if self.token_dtype is None else self.token_dtype.name,
            num_samples=self._num_samples,
            total_bytes=sum(s.bin_bytes for s in self._shards),
            modalities=modalities,
            shards=self._shards,
            writer=f"foresight {__version__}",
            extra=self.extra,
        )
        self._stage("before_manifest")
        tmp = os.path.join(self.tmp_dir, MANIFEST_NAME + ".tmp")
        with _naming(tmp):
            with open(tmp, "wb") as f:
                f.write(manifest.dumps())
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.tmp_dir, MANIFEST_NAME))
        if self._fsync:
            with _naming(self.tmp_dir):
                fsync_dir(self.tmp_dir)
        self._stage("manifest_written")

    def _publish(self) -> str | None:
        """Rename the finished directory to ``out_dir``; an old one is moved aside first (and back on failure):
        returns where, for the caller to remove."""
        aside = None
        if os.path.lexists(self.out_dir):
            if not self.overwrite:
                raise FileExistsError(f"{self.out_dir} appeared while packing; not replacing it")
            aside = aside_path(self.out_dir)  # a crash before the next rename: open_dataset renames it back
            os.rename(self.out_dir, aside)
        try:
            os.rename(self.tmp_dir, self.out_dir)
        except BaseException:
            if aside:
                os.rename(aside, self.out_dir)
            raise
        return aside

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"DatasetWriter for {self.out_dir} is already closed")

    def _stage(self, name: str) -> None:
        if self._on_stage is not None:
            self._on_stage(name)

    @staticmethod
    def _check_token_dtype(dtype: str | np.dtype) -> np.dtype:
        dt = np.dtype(dtype)
        if dt.name not in TOKEN_DTYPES:
            raise ValueError(f"token dtype {dt.name} not allowed; allowed: {', '.join(TOKEN_DTYPES)}")
        return dt.newbyteorder("=")

    def _token_array(self, arr: np.ndarray) -> None:
        dt = self._check_token_dtype(arr.dtype)
        if not arr.dtype.isnative:
            raise ValueError("token arrays must be in native byte order")
        if self.token_dtype is None:
            self.token_dtype = dt
        elif dt != self.token_dtype:
            raise ValueError(f"token array has dtype {dt.name}, dataset token_dtype is {self.token_dtype.name}")

    def _payload_bytes(self, payload: Any, mod: Modality) -> memoryview:
        if isinstance(payload, str):
            if mod == Modality.TOKENS:
                raise TypeError("TOKENS payloads must be numpy arrays, not str")
            return memoryview(payload.encode("utf-8"))
        if isinstance(payload, np.ndarray):
            arr = np.ascontiguousarray(payload).reshape(-1)
            if mod == Modality.TOKENS:
                self._token_array(arr)
            return memoryview(arr.view(np.uint8))
        data = memoryview(payload).cast("B")
        if mod == Modality.TOKENS:
            if self.token_dtype is None:
                raise TypeError("TOKENS bytes need token_dtype set on the writer (or pass a numpy array)")
            if data.nbytes % self.token_dtype.itemsize:
                raise ValueError(f"{data.nbytes} bytes is not a whole number of {self.token_dtype.name} tokens")
        return data

    def _shard_for(self, nbytes: int) -> _Shard:
        shard = self._shard
        if shard is not None and shard.rows and _round_up(shard.pos, self.align) + nbytes > self.shard_bytes:
            self._close_shard()
            shard = None
        if shard is None:
            shard = self._shard = _Shard(self.tmp_dir, len(self._shards), self._num_samples, self._buffer_bytes)
        return shard

    def _pad(self, shard: _Shard) -> None:
        if self.align and shard.pos % self.align:
            shard.write(self._zeros[: self.align - shard.pos % self.align])

    def _record(self, shard: _Shard, offsets: np.ndarray, lengths: np.ndarray, mod: Modality, sums: np.ndarray,
                meta: Sequence[dict[str, Any] | None] | None) -> None:
        n = offsets.size
        shard.cols["offset"].append(offsets)
        shard.cols["length"].append(lengths)
        shard.cols["modality"].append(np.full(n, int(mod), np.uint8))
        shard.cols["checksum"].append(sums)
        if meta is not None:
            for j, m in enumerate(meta):
                if m:
                    text = json.dumps(m, sort_keys=True, separators=(",", ":"), default=_json_default)
                    shard.meta[shard.rows + j] = text.encode("utf-8")
        shard.rows += n
        self._num_samples += n
        self._codes_seen.add(int(mod))

    def _write_run(self, raw: np.ndarray, src: np.ndarray, nbytes: np.ndarray, sums: np.ndarray, k: int,
                   mod: Modality, meta: Sequence[dict[str, Any] | None] | None) -> int:
        """Write samples k.. that fit in the current shard (and in one staging batch); return the next k."""
        shard = self._shard_for(int(nbytes[k]))
        base = int(_round_up(shard.pos, self.align))
        span = _round_up(nbytes[k:], self.align)  # each sample plus the padding before the next one
        starts = base + np.concatenate(([0], np.cumsum(span[:-1])))
        ends = starts + nbytes[k:]
        limit = min(self.shard_bytes, base + _BATCH_BYTES)
        fit = int(np.searchsorted(ends, limit, side="right"))
        if fit == 0:
            if shard.rows and base + int(nbytes[k]) > self.shard_bytes:
                self._close_shard()
                return k  # retry in a fresh shard
            fit = 1  # a sample bigger than a staging batch (or shard) goes alone
        stop = k + fit
        self._pad(shard)
        payload = raw[src[k] : src[stop]]
        if not self.align:
            shard.write(payload)
        else:
            staged = np.zeros(int(ends[fit - 1]) - base, dtype=np.uint8)
            _scatter(payload, src[k:stop] - src[k], nbytes[k:stop], staged, starts[:fit] - base)
            shard.write(staged)
        self._record(shard, starts[:fit].astype(np.uint64), nbytes[k:stop].astype(np.uint64), mod, sums[k:stop],
                     None if meta is None else meta[k:stop])
        return stop

    def _close_shard(self) -> None:
        shard = self._shard
        if shard is None:
            return
        with _naming(shard.bin_path):  # the shard stays current until its file is closed: a failure closes it
            if not shard.rows:
                shard.file.close()
                self._shard = None
                os.unlink(shard.bin_path)
                return
            self._pad(shard)  # whole aligned blocks to the end of file: O_DIRECT reads of the last sample stay in-file
            shard.file.flush()
            if self._fsync:
                os.fsync(shard.file.fileno())
            shard.file.close()
        self._shard = None
        cat = {k: np.concatenate(v) for k, v in shard.cols.items()}
        meta_len = np.zeros(shard.rows + 1, dtype=np.int64)
        for row, text in shard.meta.items():
            meta_len[row + 1] = len(text)
        meta_offsets = np.cumsum(meta_len)
        meta_data = b"".join(shard.meta[r] for r in sorted(shard.meta))
        map_path = os.path.join(self.tmp_dir, shard.map_name)
        with _naming(map_path):
            map_bytes = write_map(map_path, offset=cat["offset"], length=cat["length"], modality=cat["modality"],
                                  checksum=cat["checksum"], meta_offsets=meta_offsets, meta_data=meta_data,
                                  fsync=self._fsync)
            map_xxh3 = file_xxh3(map_path)
        self._shards.append(
            ShardEntry(
                bin=shard.bin_name, map=shard.map_name, bin_bytes=shard.pos, map_bytes=map_bytes,
                bin_xxh3=shard.hasher.hexdigest(), map_xxh3=map_xxh3, num_samples=shard.rows,
                first_sample=shard.first_sample,
            )
        )
        self._stage("shard_closed")

    @staticmethod
    def _remove_stale_partials(parent: str, name: str) -> None:
        pattern = re.compile(r"^\." + re.escape(name) + r"\.partial-(\d+)-[0-9a-f]+$")
        for entry in os.listdir(parent):
            m = pattern.match(entry)
            if not m:
                continue
            if pid_alive(int(m.group(1))):
                continue  # its writer still runs
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
