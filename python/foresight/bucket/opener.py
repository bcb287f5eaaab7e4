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

from foresight.bucket.cache import INDEX_DIR
from foresight.bucket.dataset import STATE_NAME, open_bucket_dataset, reopen_cache_dir
from foresight.format import reader
from foresight.format.types import Dataset

__all__ = ["open_dataset"]


def open_dataset(path: str | os.PathLike, *, fingerprint: str = "index", cache_dir: str | os.PathLike | None = None,
                 **bucket_options: Any) -> Dataset:
    """Open a foresight dataset directory (with ``manifest.json``), a Megatron-LM ``.idx``/``.bin`` prefix, or a
    dataset in a bucket.

    ``s3://bucket/prefix`` opens a foresight dataset in a bucket through a local cache under ``cache_dir``
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
        cache_dir = cache_dir or os.environ.get("FORESIGHT_BUCKET_CACHE")
        if not cache_dir:
            raise ValueError(f"{path}: a bucket dataset is read through a local cache: pass cache_dir= "
                             "or set FORESIGHT_BUCKET_CACHE (a node-local directory)")
        return open_bucket_dataset(path, cache_dir, **bucket_options)
    if cache_dir is not None:
        raise TypeError(f"cache_dir applies to s3:// datasets only, not {path!r}")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX_DIR, STATE_NAME)):
        # a bucket dataset's cache (a plan's recorded location): through its bucket, never its sparse files alone
        return reopen_cache_dir(path, **bucket_options)
    if bucket_options:
        raise TypeError(f"{', '.join(sorted(bucket_options))}: options of s3:// datasets only, not {path!r}")
    return reader.open_dataset(path, fingerprint=fingerprint)
