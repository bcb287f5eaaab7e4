"""xxh3_64 checksums: of many byte ranges in one native call, and of whole files.

The shard writer and reader, the loader's ``verify`` and the checkpoint writer and reader all hash through
here, so a sample or tensor checksum means the same everywhere: ``xxhash.xxh3_64_intdigest`` of its bytes.

Example::

    sums = xxh3_many(np.frombuffer(b"abcdef", np.uint8), np.array([0, 3]), np.array([3, 3]))
"""
from __future__ import annotations

import os

import numpy as np
import xxhash

from foresight._native import load

xxh3_batch = load("_core").xxh3_batch

__all__ = ["xxh3_many", "file_xxh3"]


def xxh3_many(buffer, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """xxh3_64 of ``buffer[offsets[k] : offsets[k] + lengths[k]]`` for every k, as uint64 (GIL released)."""
    buf = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.asarray(
        xxh3_batch(buf, np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)), dtype=np.uint64
    )


def file_xxh3(path: str | os.PathLike, *, chunk: int = 8 << 20) -> str:
    """Hex xxh3_64 of a whole file, streamed in ``chunk``-byte pieces (bounded memory)."""
    h = xxhash.xxh3_64()
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
    return h.hexdigest()
