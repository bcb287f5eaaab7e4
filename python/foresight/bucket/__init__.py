"""The object-store tier: foresight datasets in an S3-compatible bucket, read through a plan-driven local cache.

Modules, one job each: ``url`` (``s3://bucket/prefix``), ``config`` (endpoint and credentials from the standard
places; the obstore client), ``fetch`` (coalesced, concurrent, retried ranged GETs pinned to ETags), ``cache``
(sparse local files and the present-sample index, safe across processes), ``dataset`` (a bucket dataset as a
:class:`~foresight.format.reader.ShardedDataset` over its cache), ``upload`` (put a local dataset into a bucket),
``policy`` (plan-order next use; Belady, LRU and the offline optimum replayed), ``prefetch`` (the plan-driven
prefetcher with eviction under a byte budget). See docs/buckets.md.

Example::

    from foresight.bucket import open_bucket_dataset
    ds = open_bucket_dataset("s3://data/wiki", cache_dir="/nvme/cache")   # or open_dataset("s3://...", cache_dir=)
"""
from __future__ import annotations

from .dataset import BucketDataset, open_bucket_dataset
from .fetch import ObjectRef, RangedFetcher, RetryPolicy
from .url import BucketURL, is_bucket_url

__all__ = ["BucketDataset", "open_bucket_dataset", "ObjectRef", "RangedFetcher", "RetryPolicy", "BucketURL",
           "is_bucket_url"]
