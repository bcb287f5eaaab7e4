"""Open any dataset by its location: ``foresight.open_dataset``.

``s3://bucket/prefix`` opens a foresight dataset in a bucket through a local cache; a bucket dataset's cache
directory (a plan's recorded location) reopens through its bucket; anything else is a local directory or Megatron
prefix, opened by :func:`foresight.format.open_dataset` (the local opener, which knows nothing of buckets).

Example::

    ds = open_dataset("s3://data/wiki", cache_dir="/nvme/cache")   # or FORESIGHT_BUCKET_CACHE=/nvme/cache
    ds = open_dataset("out/")                                      # a local dataset, as format's opener
"""
from __future__ import annotations

import os
from typing import Any

from foresight.bucket.dataset import cache_layout_of, open_bucket_dataset, reopen_cache_dir
from foresight.format import reader
from foresight.format.types import Dataset

__all__ = ["open_dataset", "resolve_cache_dir", "CACHE_ENV"]

CACHE_ENV = "FORESIGHT_BUCKET_CACHE"


def resolve_cache_dir(url: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The local cache directory for ``url`` (an ``s3://`` dataset or plan): ``cache_dir``, else
    ``$FORESIGHT_BUCKET_CACHE``; neither is a :class:`ValueError` saying so (never a guessed directory: it could
    fill the wrong disk)."""
    cache_dir = cache_dir or os.environ.get(CACHE_ENV)
    if not cache_dir:
        raise ValueError(f"{url}: a bucket dataset or plan is read through a local cache: pass cache_dir= "
                         f"or set {CACHE_ENV} (a node-local directory)")
    return os.fspath(cache_dir)


def open_dataset(path: str | os.PathLike, *, fingerprint: str = "index", cache_dir: str | os.PathLike | None = None,
                 **bucket_options: Any) -> Dataset:
    """Open a foresight dataset directory (with ``manifest.json``), a Megatron-LM ``.idx``/``.bin`` prefix, or
    either of them in a bucket.

    ``s3://bucket/prefix`` opens a foresight dataset (or the Megatron pair ``prefix.idx``/``prefix.bin``) in a
    bucket through a local cache under ``cache_dir``
    (or ``$FORESIGHT_BUCKET_CACHE``): see :func:`foresight.bucket.open_bucket_dataset`, which takes
    ``bucket_options`` (``options``, ``concurrency``, ``max_gap``, ``max_transfer``, ``retry``).

    ``fingerprint="content"`` makes a Megatron dataset's fingerprint cover every byte of its ``.bin`` (see
    :class:`~foresight.format.megatron.MegatronDataset`); a foresight directory's fingerprint always does (its
    manifest holds each shard's xxh3). Raises :class:`FormatError` naming the file when the dataset is missing,
    incomplete or malformed.
    """
    path = os.fspath(path)
    if fingerprint not in ("index", "content"):
        raise ValueError(f"fingerprint must be 'index' or 'content', got {fingerprint!r}")
    if path.startswith("s3://"):
        return open_bucket_dataset(path, resolve_cache_dir(path, cache_dir), fingerprint=fingerprint,
                                   **bucket_options)
    if cache_dir is not None:
        raise TypeError(f"cache_dir applies to s3:// datasets only, not {path!r}")
    layout = cache_layout_of(path)
    if layout is not None:
        # a bucket dataset's cache (a plan's recorded location): through its bucket, never its sparse files alone
        return reopen_cache_dir(layout, **bucket_options)
    if bucket_options:
        raise TypeError(f"{', '.join(sorted(bucket_options))}: options of s3:// datasets only, not {path!r}")
    return reader.open_dataset(path, fingerprint=fingerprint)
