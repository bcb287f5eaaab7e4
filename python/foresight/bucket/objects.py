"""The objects under one bucket prefix, written whole and read whole or by extents: what checkpoints keep in a bucket.

:class:`BucketPrefix` puts local files and in-memory buffers as multipart uploads (parts of ``part_bytes`` sent
``part_concurrency`` at a time) and counts an object as written only once a HEAD shows the size sent and the ETag
the upload returned; it lists, deletes, and reads through the :class:`~.fetch.RangedFetcher` (coalesced ranged GETs
pinned to the ETag, so a replaced object is refused, never mixed). Every request is retried as the fetcher's are and
fails with a one-line :class:`~foresight.errors.BucketError` naming the object, never quoting a credential.

Example::

    with BucketPrefix("s3://ckpt/run1") as b:
        ref = b.put("step-1/data-00000.bin", "/nvme/ckpt/step-00000001/data-00000.bin")  # ObjectRef: size, ETag
        b.put("step-1/COMMIT", b"{...}")                       # a marker, after every data object is in
        b.list("step-1")                                       # {"step-1/COMMIT": ObjectRef, ...}
        got = b.fetch(ref, np.array([0, 8192]), np.array([4096, 9000]))   # two extents, coalesced GETs
"""
from __future__ import annotations

import os
from typing import Any, BinaryIO

import numpy as np

from .config import open_store
from .fetch import DEFAULT_PART_BYTES, Fetched, ObjectRef, RangedFetcher, RetryPolicy
from .url import BucketURL

__all__ = ["BucketPrefix", "DEFAULT_PART_BYTES"]


class BucketPrefix:
    """Objects under ``url`` (``s3://bucket/prefix``); names passed in are relative to the prefix."""

    def __init__(self, url: str | BucketURL, *, options: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy(), concurrency: int = 16, part_bytes: int = DEFAULT_PART_BYTES,
                 part_concurrency: int = 8) -> None:
        if part_bytes < 5 << 20:
            raise ValueError(f"part_bytes must be at least 5 MiB (S3's smallest part), got {part_bytes}")
        self.url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
        self.part_bytes = int(part_bytes)
        self.part_concurrency = int(part_concurrency)
        self.store = open_store(self.url, options)
        self.fetcher = RangedFetcher(self.store, self.url, concurrency=concurrency, retry=retry)

    def close(self) -> None:
        self.fetcher.close()

    def __enter__(self) -> "BucketPrefix":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(self, name: str, data: str | os.PathLike | bytes | memoryview | BinaryIO) -> ObjectRef:
        """Upload a local file (by path), a buffer or a seekable binary file object as object ``name``, checked
        by a HEAD (:meth:`.RangedFetcher.put`, with this prefix's part size and concurrency)."""
        return self.fetcher.put(name, data, part_bytes=self.part_bytes, part_concurrency=self.part_concurrency)

    def head(self, name: str) -> ObjectRef:
        """Size and ETag of object ``name``."""
        return self.fetcher.head(name)

    def get(self, ref: ObjectRef) -> bytes:
        """The whole object, pinned to ``ref``'s size and ETag."""
        return self.fetcher.get_whole(ref)

    def fetch(self, ref: ObjectRef, starts: np.ndarray, ends: np.ndarray) -> Fetched:
        """The extents ``[starts[i], ends[i])`` of one object in coalesced, concurrent ranged GETs pinned to its
        ETag; extent ``i`` lands at ``result.transfers.x_dest[i]`` of ``result.region``."""
        starts = np.asarray(starts, dtype=np.int64)
        return self.fetcher.fetch([ref], np.zeros(len(starts), np.int32), starts,
                                  np.asarray(ends, dtype=np.int64) - starts)

    def list(self, under: str = "") -> dict[str, ObjectRef]:
        """Every object under ``under`` (recursively; "" for the whole prefix), by name relative to the prefix."""
        cut = len(self.url.prefix) + 1 if self.url.prefix else 0
        return {ref.key[cut:]: ref for ref in self.fetcher.list(under)}

    def delete(self, names: list[str]) -> None:
        """Delete objects ``names`` in one request (a missing one is no error)."""
        self.fetcher.delete(*names)
