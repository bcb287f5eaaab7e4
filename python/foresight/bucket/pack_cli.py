"""``foresight pack ... s3://bucket/prefix``: pack into a local staging directory, then upload, manifest last.

The command is :mod:`foresight.format.cli`'s (its arguments, its packers); this module only adds a bucket as OUT.
The dataset is packed whole into a staging directory (under ``FORESIGHT_BUCKET_CACHE`` when set: a node-local disk
with room for it; else the system's temporary directory), then uploaded by
:func:`~foresight.bucket.upload.upload_dataset`: every shard and map first, ``manifest.json`` last, so a reader
never opens a half-uploaded dataset as complete. An existing dataset at OUT is refused before packing unless
``--overwrite`` (then its manifest is deleted before any object is replaced). The staging directory is removed
whatever happens.

Example::

    foresight pack data.jsonl s3://data/wiki --tokenizer tokenizer.json
    foresight pack megatron corpus/wiki_text_document s3://data/wiki-mg --overwrite
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from foresight.format import cli as format_cli
from foresight.format.manifest import MANIFEST_NAME

from .mirror import refuse_existing_at
from .opener import CACHE_ENV
from .upload import upload_dataset
from .url import BucketURL, is_bucket_url

__all__ = ["add_arguments", "run"]

add_arguments = format_cli.add_arguments


def run(args: argparse.Namespace) -> int:
    if not is_bucket_url(args.out):
        return format_cli.run(args)
    url = BucketURL.parse(args.out)
    if not args.overwrite:  # before packing, which can take hours
        refuse_existing_at(url, MANIFEST_NAME, "dataset")
    parent = os.environ.get(CACHE_ENV) or None
    if parent:  # the cache directory need not exist yet: the dataset opener creates it too
        os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix="foresight-pack-", dir=parent)
    try:
        args.out = os.path.join(staging, "dataset")
        rc = format_cli.run(args, shown_as=str(url))
        keys = upload_dataset(args.out, url, overwrite=args.overwrite)
        print(f"uploaded {len(keys)} objects to {url} (manifest.json last)")
        return rc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
