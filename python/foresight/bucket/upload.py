"""Put a local directory into a bucket with its marker object last: a dataset (``manifest.json``), a plan
(``plan.json``).

The marker marks a complete directory in a bucket as on disk: a reader that finds it finds every object it lists.
So the other objects go first (concurrently, each with obstore's ``put``: atomic, multipart above its chunk size),
the marker last, and an existing marker is deleted before anything else is replaced: a dataset half overwritten is
never opened as complete, neither as the old one nor as the new one.

Example::

    upload_dataset("out/", "s3://data/wiki")                          # endpoint and keys from the standard places
    upload_dir("plan/", "s3://data/plans/p1", marker="plan.json", what="plan", overwrite=False)
"""
from __future__ import annotations

import errno
import os
from typing import Any

from foresight.errors import BucketError
from foresight.format.manifest import MANIFEST_NAME, parse_manifest

from .config import open_store
from .fetch import DEFAULT_CONCURRENCY, ObjectRef, RangedFetcher
from .url import BucketURL

__all__ = ["upload_dataset", "upload_dir", "refuse_existing"]


def refuse_existing(fetcher: RangedFetcher, marker: str, what: str) -> None:
    """:class:`BucketError` (reason ``exists``) when ``marker`` is already under the fetcher's URL."""
    if fetcher.exists(marker):
        raise BucketError(f"already holds a {what} ({marker}); pass --overwrite (overwrite=True) to replace it",
                          "exists", object=str(fetcher.url))


def upload_dir(local_dir: str | os.PathLike, url: str | BucketURL, *, marker: str, names: list[str] | None = None,
               overwrite: bool = True, what: str = "dataset", options: dict[str, Any] | None = None,
               concurrency: int = DEFAULT_CONCURRENCY) -> list[ObjectRef]:
    """Upload ``names`` (default: every plain file directly in ``local_dir`` but dotfiles) under ``url``,
    ``marker`` last, ``concurrency`` objects at a time; returns the objects written (marker last).

    An existing ``marker`` under ``url`` is refused with ``overwrite=False`` (:class:`BucketError`, reason
    ``exists``), else deleted first. Objects of an older upload that ``names`` does not hold are left in place
    (nothing lists them once the new marker is there).
    """
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    local_dir = os.fspath(local_dir)
    if names is None:
        names = sorted(n for n in os.listdir(local_dir)
                       if not n.startswith(".") and os.path.isfile(os.path.join(local_dir, n)))
    if marker not in names:
        raise ValueError(f"{local_dir}: no {marker} to upload last (not a {what} directory)")
    missing = [n for n in names if not os.path.isfile(os.path.join(local_dir, n))]
    if missing:  # before any request: a local file missing is not an object missing in the bucket
        raise FileNotFoundError(errno.ENOENT, f"{len(missing)} file(s) of the {what} to upload are missing",
                                os.path.join(local_dir, missing[0]))
    with RangedFetcher(open_store(url, options), url, concurrency=concurrency) as fetcher:
        if not overwrite:
            refuse_existing(fetcher, marker, what)
        elif fetcher.exists(marker):
            fetcher.delete(marker)  # first: the old marker must never list objects already replaced
        refs = fetcher.map(lambda n: fetcher.put(n, os.path.join(local_dir, n)),
                           [n for n in names if n != marker])
        refs.append(fetcher.put(marker, os.path.join(local_dir, marker)))
    return refs


def upload_dataset(local_dir: str | os.PathLike, url: str | BucketURL, *, overwrite: bool = True,
                   options: dict[str, Any] | None = None, concurrency: int = DEFAULT_CONCURRENCY) -> list[str]:
    """Upload the dataset at ``local_dir`` under ``url`` (every shard and map, ``manifest.json`` last,
    ``concurrency`` objects at a time); returns the object keys written (manifest last)."""
    local_dir = os.fspath(local_dir)
    manifest_path = os.path.join(local_dir, MANIFEST_NAME)
    with open(manifest_path, "rb") as f:
        manifest = parse_manifest(f.read(), path=manifest_path)
    names = [n for s in manifest.shards for n in (s.bin, s.map)] + [MANIFEST_NAME]
    refs = upload_dir(local_dir, url, marker=MANIFEST_NAME, names=names, overwrite=overwrite, options=options,
                      concurrency=concurrency)
    return [r.key for r in refs]
