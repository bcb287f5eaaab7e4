"""Types every dataset kind shares: :class:`Modality`, :class:`Extents` and the :class:`Dataset` base.

A *sample* is one contiguous byte range in one shard file. :meth:`Dataset.lookup` turns sample ids into those
ranges in one vectorized call; the I/O layer reads them, and :meth:`Dataset.verify` checks what it read.

Example::

    ds = open_dataset("out/")
    ext = ds.lookup(np.arange(8, dtype=np.int64))   # Extents(shard, offset, length), numpy arrays
    payload = ds.read(3)                            # bytes, checksum verified
"""
from __future__ import annotations

import enum
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .._closing import Closing
from ..errors import ChecksumError, FormatError
from foresight.checksum import xxh3_many

__all__ = ["Modality", "Extents", "Dataset", "TOKEN_DTYPES", "modality_names"]


class Modality(enum.IntEnum):
    """What a sample's bytes are. The code is stored per sample (uint8) in the shard map."""

    TOKENS = 0
    TEXT = 1
    IMAGE = 2
    VIDEO = 3
    AUDIO = 4
    BYTES = 5

    @property
    def label(self) -> str:
        """Lower-case name used in manifests and ``Dataset.modalities`` ("tokens", "image", ...)."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: Modality | int | str) -> Modality:
        """Accept a Modality, its code or its (case-insensitive) name; list allowed values otherwise."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            try:
                return cls(int(value))
            except ValueError:
                pass
        allowed = ", ".join(f"{m.label}={m.value}" for m in cls)
        raise ValueError(f"unknown modality {value!r}; allowed: {allowed}")


def modality_names(codes: np.ndarray) -> list[str]:
    """Sorted labels of the modality codes present in ``codes``."""
    return [Modality(int(c)).label for c in np.unique(codes)]


# Token dtypes a foresight writer accepts (Megatron datasets may carry any of its eight codes).
TOKEN_DTYPES = ("uint8", "int8", "int16", "uint16", "int32", "uint32", "int64")


class Extents(NamedTuple):
    """Where samples live: parallel numpy arrays, one entry per requested sample id."""

    shard: np.ndarray  # int32, index into Dataset.shard_paths
    offset: np.ndarray  # int64, byte offset in the shard
    length: np.ndarray  # int64, byte length


class Dataset(Closing):
    """The read-side contract every dataset kind implements (see ``notes/common.md``).

    Subclasses set ``path``, ``kind``, ``num_samples``, ``modalities``, ``token_dtype``, ``shard_paths``,
    ``align`` and implement ``lookup``, ``sample_bytes``, ``modality_codes``, ``checksums``, ``meta`` and the
    ``fingerprint`` property. Reading and verification are shared here.
    """

    path: str
    kind: str
    num_samples: int
    modalities: list[str]
    token_dtype: np.dtype | None
    shard_paths: list[str]
    align: int

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()

    # -- to implement ------------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def lookup(self, ids: np.ndarray) -> Extents:  # pragma: no cover - abstract
        raise NotImplementedError

    def sample_bytes(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def modality_codes(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def checksums(self) -> np.ndarray | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def meta(self, i: int) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def meta_many(self, ids: np.ndarray | Sequence[int]) -> list[dict[str, Any]]:
        """The meta dicts of ``ids``, in order. Formats with a columnar meta store override this with a batch
        lookup; the default asks :meth:`meta` per sample."""
        return [self.meta(int(i)) for i in self._check_ids(ids)]

    # -- shared ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, samples={self.num_samples}, shards={len(self.shard_paths)}, "
            f"modalities={self.modalities}, token_dtype={self.token_dtype})"
        )

    def token_counts(self) -> np.ndarray:
        """Tokens per sample (int64): byte length / token itemsize for TOKENS samples, 0 for every other sample."""
        counts = np.zeros(self.num_samples, dtype=np.int64)
        if self.token_dtype is None:
            return counts
        is_tokens = self.modality_codes() == Modality.TOKENS
        counts[is_tokens] = self.sample_bytes()[is_tokens] // self.token_dtype.itemsize
        return counts

    def _check_ids(self, ids: np.ndarray | Sequence[int] | int) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            bad = ids[(ids < 0) | (ids >= self.num_samples)][0]
            raise IndexError(f"sample id {int(bad)} out of range [0, {self.num_samples}) in {self.path}")
        return ids

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(shard)
                if fd is None:
                    fd = os.open(self.shard_paths[shard], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    self._fds[shard] = fd
        return fd

    def read(self, i: int, *, verify: bool = True) -> bytes:
        """The bytes of sample ``i`` (plain ``pread``; the fast path is ``foresight.io``).

        Raises :class:`~foresight.errors.ChecksumError` if ``verify`` and the bytes do not match the stored checksum,
        :class:`~foresight.errors.FormatError` if the shard is shorter than its map says.
        """
        ids = self._check_ids(i)
        if ids.size != 1:
            raise TypeError("read() takes one sample id; use lookup() + foresight.io for batches")
        ext = self.lookup(ids)
        shard, offset, length = int(ext.shard[0]), int(ext.offset[0]), int(ext.length[0])
        data = os.pread(self._fd(shard), length, offset)
        if len(data) != length:
            raise FormatError(
                f"short read: got {len(data)} of {length} bytes", path=self.shard_paths[shard], offset=offset,
                sample=int(ids[0]),
            )
        if verify:
            self.verify(ids, [data])
        return data

    def verify(self, ids: np.ndarray | Sequence[int], views: Sequence[Any]) -> None:
        """Check each buffer in ``views`` against the checksum of the matching sample id.

        ``views[k]`` is any buffer (bytes, memoryview, numpy array) holding sample ``ids[k]``. Datasets without
        checksums (Megatron) accept everything. Raises :class:`ChecksumError` naming shard, offset and sample id.
        """
        ids = self._check_ids(ids)
        if len(views) != ids.size:
            raise ValueError(f"verify: {ids.size} ids but {len(views)} views")
        if self.checksums() is None or ids.size == 0:
            return
        got = np.fromiter((xxhash.xxh3_64_intdigest(memoryview(v).cast("B")) for v in views), np.uint64, ids.size)
        self._compare(ids, got)

    def verify_packed(self, ids: np.ndarray | Sequence[int], buffer: np.ndarray, positions: np.ndarray) -> None:
        """Batch form of :meth:`verify`: sample ``ids[k]`` sits at ``buffer[positions[k]:]`` (its byte length
        comes from the map). Hashes in one native call when ``foresight._core`` provides ``xxh3_batch``."""
        ids = self._check_ids(ids)
        if self.checksums() is None or ids.size == 0:
            return
        lengths = self.sample_bytes()[ids]
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        buf = np.asarray(buffer).reshape(-1).view(np.uint8)
        if positions.size != ids.size or (positions < 0).any() or (positions + lengths > buf.size).any():
            raise ValueError("verify_packed: positions do not fit the buffer")
        self._compare(ids, xxh3_many(buf, positions, lengths))

    def _compare(self, ids: np.ndarray, got: np.ndarray) -> None:
        want = self.checksums()[ids]
        bad = np.flatnonzero(got != want)
        if bad.size:
            k = int(bad[0])
            ext = self.lookup(ids[k : k + 1])
            shard = int(ext.shard[0])
            raise ChecksumError(
                f"checksum mismatch ({bad.size} of {ids.size} samples bad): xxh3 {int(got[k]):016x} != "
                f"{int(want[k]):016x}",
                path=self.shard_paths[shard], shard=shard, offset=int(ext.offset[0]), sample=int(ids[k]),
            )

    def close(self) -> None:
        """Close the file descriptors ``read`` opened (mapped metadata stays valid until garbage-collected)."""
        with self._fd_lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
