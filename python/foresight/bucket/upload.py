"""Put a local foresight dataset into a bucket: every shard and map, then ``manifest.json`` last.

The manifest marks a complete dataset in a bucket as on disk: a reader that finds it finds every file it lists.
Objects are sent with obstore's ``put`` (multipart above its chunk size).

Example::

    upload_dataset("out/", "s3://data/wiki")     # endpoint and keys from the standard places
"""
from __future__ import annotations

import os
from typing import Any

from foresight.format.manifest import MANIFEST_NAME, parse_manifest

from .config import open_store
from .url import BucketURL

__all__ = ["upload_dataset"]


def upload_dataset(local_dir: str | os.PathLike, url: str | BucketURL, *,
                   options: dict[str, Any] | None = None) -> list[str]:
    """Upload the dataset at ``local_dir`` under ``url``; returns the object keys written (manifest last)."""
    import obstore

    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    local_dir = os.fspath(local_dir)
    manifest_path = os.path.join(local_dir, MANIFEST_NAME)
    with open(manifest_path, "rb") as f:
        manifest = parse_manifest(f.read(), path=manifest_path)
    store = open_store(url, options)
    names = [n for s in manifest.shards for n in (s.bin, s.map)] + [MANIFEST_NAME]
    for name in names:
        obstore.put(store, url.key(name), os.path.join(local_dir, name))
    return [url.key(n) for n in names]
