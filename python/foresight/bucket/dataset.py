"""A foresight dataset in a bucket, read through its local cache: :func:`open_bucket_dataset`, :class:`BucketDataset`.

Opening fetches the manifest and every shard map whole (kept in the cache directory, checked by the manifest's
xxh3 as for any local dataset), heads every shard object (size and ETag recorded: later GETs must match them),
and lays out one sparse file per shard at its full size. The dataset is then a :class:`ShardedDataset` over that
directory, so the loader's one read path (coalesced io_uring reads of the shard files) is the read path here too;
:meth:`BucketDataset.lookup` first makes the samples it is asked for present in the cache (one coalesced fetch of
the missing ones), so a reader never sees a byte that was not fetched and checked.

The cache directory is kept across restarts: the recorded manifest ETag is compared with the bucket's on open;
when it changed (the dataset was re-packed and uploaded again) the cached copy is dropped and laid out anew.

Example::

    ds = open_bucket_dataset("s3://data/wiki", cache_dir="/nvme/foresight-cache")
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=64, seq_len=2048, num_steps=100)
    with Loader(ds, plan) as loader:   # each step's samples fetched on first use, read from the cache
        ...
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from typing import Any

import numpy as np

from foresight.errors import BucketError
from foresight.format.manifest import MANIFEST_NAME, parse_manifest
from foresight.format.reader import ShardedDataset
from foresight.format.types import Extents
from foresight.io.durable import fsync_dir

from .cache import INDEX_DIR, SampleCache
from .config import open_store
from .fetch import ObjectRef, RangedFetcher, RetryPolicy
from .url import BucketURL

__all__ = ["open_bucket_dataset", "BucketDataset", "local_dir_of", "is_cache_dir", "reopen_cache_dir"]

STATE_NAME = "state.json"  # written last: its presence marks a complete layout
BOOT_NAME = "boot_id"  # the boot during which the index's marks were made (their bytes may be in its page cache)
log = logging.getLogger("foresight.bucket")


def local_dir_of(url: BucketURL, cache_dir: str | os.PathLike) -> str:
    """Where ``url``'s dataset is mirrored under ``cache_dir``: ``cache_dir/bucket/prefix``."""
    return os.path.join(os.path.abspath(os.fspath(cache_dir)), url.bucket, *url.prefix.split("/"))


def is_cache_dir(path: str) -> bool:
    """Whether ``path`` is a bucket dataset's cache directory (its sparse files must never be read as a plain
    local dataset: bytes not fetched read as zeros)."""
    return os.path.isfile(os.path.join(path, INDEX_DIR, STATE_NAME))


def reopen_cache_dir(path: str, **kwargs: Any) -> "BucketDataset":
    """Open the bucket dataset whose cache directory is ``path`` (what ``open_dataset(path)`` does for one: a plan's
    recorded location, a search hit), through its bucket URL and the same cache."""
    state_path = os.path.join(path, INDEX_DIR, STATE_NAME)
    try:
        with open(state_path, "rb") as f:
            url = BucketURL.parse(json.loads(f.read())["url"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BucketError(f"cache state unreadable: {type(e).__name__}", "checksum", path=state_path) from None
    root = os.path.abspath(path)
    for _ in range(1 + (len(url.prefix.split("/")) if url.prefix else 0)):
        root = os.path.dirname(root)
    if local_dir_of(url, root) != os.path.abspath(path):
        raise BucketError(f"cache directory is not where {url} is cached under any root", "checksum", path=path)
    return open_bucket_dataset(url, root, **kwargs)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _ref_json(ref: ObjectRef) -> dict[str, Any]:
    return {"key": ref.key, "size": ref.size, "etag": ref.etag}


def _lay_out(local: str, fetcher: RangedFetcher, manifest_ref: ObjectRef, raw: bytes) -> dict[str, Any]:
    """Fetch the maps whole, head the shards, create the sparse files and the index (``raw``: the manifest's
    bytes, fetched by the caller); returns the state (written last)."""
    index_dir = os.path.join(local, INDEX_DIR)
    for name in os.listdir(local):  # an older copy (or a layout cut short): nothing of it is kept
        if name != INDEX_DIR:
            path = os.path.join(local, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    manifest = parse_manifest(raw, path=str(manifest_ref.url))

    def one(task: tuple[str, Any]) -> ObjectRef | None:  # a map fetched whole, or a shard headed and laid out sparse
        kind, s = task
        if kind == "map":
            map_ref, data = fetcher.get_object(s.map)
            if map_ref.size != s.map_bytes:
                raise BucketError(f"map object is {map_ref.size} bytes, the manifest says {s.map_bytes}", "changed",
                                  object=str(map_ref.url))
            _write_atomic(os.path.join(local, s.map), data)
            return None
        bin_ref = fetcher.head(s.bin)
        if bin_ref.size != s.bin_bytes:
            raise BucketError(f"shard object is {bin_ref.size} bytes, the manifest says {s.bin_bytes}", "changed",
                              object=str(bin_ref.url))
        with open(os.path.join(local, s.bin), "wb") as f:
            f.truncate(s.bin_bytes)  # sparse: no block allocated until fetched bytes land
        return bin_ref

    # every map and shard at once: one round trip for the whole layout, not three per shard
    got = fetcher.map(one, [("map", s) for s in manifest.shards] + [("bin", s) for s in manifest.shards])
    shard_refs = got[len(manifest.shards):]
    present = os.path.join(index_dir, "present")
    with open(present, "wb") as f:
        f.truncate(manifest.num_samples)
    _write_atomic(os.path.join(local, MANIFEST_NAME), raw)
    fsync_dir(local)
    state = {"url": str(fetcher.url), "manifest": _ref_json(manifest_ref), "shards": [_ref_json(r) for r in shard_refs]}
    _write_atomic(os.path.join(index_dir, STATE_NAME), json.dumps(state).encode())
    return state


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # no boot id to compare: every open re-hashes the marked samples (never a lost write served)
        return ""


def _scrub_after_reboot(ds: "BucketDataset") -> None:
    """Marks are made once bytes are written, not synced: a machine crash may have lost bytes whose marks reached
    the disk. On the first open in a boot other than the recorded one, re-hash the marked samples (unmarking those
    that differ), then record this boot (before any mark of it is made: the caller holds the layout lock)."""
    path = os.path.join(ds.path, INDEX_DIR, BOOT_NAME)
    now = _boot_id()
    try:
        with open(path) as f:
            recorded = f.read().strip()
    except OSError:
        recorded = None
    if now and recorded == now:
        return
    if ds.cache.present.any():
        bad = ds.cache.scrub()
        log.warning("bucket cache %s: first open since a reboot: the marked samples re-hashed, %d unmarked (refetched "
                    "on next use)", ds.path, bad.size)
    _write_atomic(path, now.encode())


def open_bucket_dataset(url: str | BucketURL, cache_dir: str | os.PathLike, *, options: dict[str, Any] | None = None,
                        concurrency: int = 16, max_gap: int | None = None, max_transfer: int | None = None,
                        retry: RetryPolicy = RetryPolicy()) -> "BucketDataset":
    """Open the foresight dataset at ``url`` (``s3://bucket/prefix``) through a cache under ``cache_dir``.

    ``options`` are obstore S3 config keys (``endpoint``, ``access_key_id``, ...) over the standard places
    (:mod:`foresight.bucket.config`); ``concurrency`` the GETs in flight; ``max_gap``/``max_transfer`` the
    coalescer's caps for object storage (1 MiB / 16 MiB by default); ``retry`` the budget of transient failures.
    """
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    store = open_store(url, options)
    caps = {k: v for k, v in (("max_gap", max_gap), ("max_transfer", max_transfer)) if v is not None}
    fetcher = RangedFetcher(store, url, concurrency=concurrency, retry=retry, **caps)
    try:
        local = local_dir_of(url, cache_dir)
        os.makedirs(os.path.join(local, INDEX_DIR), exist_ok=True)
        with open(os.path.join(local, INDEX_DIR, "lock"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one process lays out; the others wait, then reuse it
            manifest_ref, raw = fetcher.get_object(MANIFEST_NAME)  # small: fetched whole, not headed first
            state_path = os.path.join(local, INDEX_DIR, STATE_NAME)
            try:
                with open(state_path, "rb") as f:
                    state = json.loads(f.read())
            except (OSError, ValueError):
                state = None
            if state is None or state.get("manifest") != _ref_json(manifest_ref):
                if state is not None:
                    log.warning("bucket: %s changed since it was cached (manifest ETag): cache dropped", url)
                    os.unlink(state_path)
                state = _lay_out(local, fetcher, manifest_ref, raw)
            refs = [ObjectRef(BucketURL(url.bucket, r["key"]), int(r["size"]), r["etag"]) for r in state["shards"]]
            ds = BucketDataset(local, url, fetcher, refs)
            try:
                _scrub_after_reboot(ds)
            except BaseException:
                ds.close()
                raise
        ds._reopen = (str(url), os.fspath(cache_dir), {"options": options, "concurrency": concurrency,
                                                       "max_gap": max_gap, "max_transfer": max_transfer,
                                                       "retry": retry})
        return ds
    except BaseException:
        fetcher.close()
        raise


class BucketDataset(ShardedDataset):
    """A :class:`ShardedDataset` over a bucket dataset's cache directory whose :meth:`lookup` fetches what is
    missing first. ``url`` is the bucket location, ``cache`` the :class:`SampleCache`."""

    kind = "foresight"

    def __init__(self, local_dir: str, url: BucketURL, fetcher: RangedFetcher, refs: list[ObjectRef]) -> None:
        super().__init__(local_dir)
        self.url = url
        self.fetcher = fetcher
        self.cache = SampleCache(local_dir, fetcher, refs, self.shard_paths, super().lookup, self.checksums())

    def lookup(self, ids: np.ndarray) -> Extents:
        ext = super().lookup(ids)
        if len(ext.offset):
            self.cache.ensure(np.asarray(ids, dtype=np.int64).reshape(-1))
        return ext

    def lookup_would_wait(self, ids: np.ndarray) -> bool:
        """Whether :meth:`lookup` of ``ids`` would fetch (some sample is not in the cache yet): the loader asks
        before it looks up a later step, and hands out a step it has read instead of waiting behind that fetch."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return bool(ids.size) and not bool(self.cache.present[ids].all())

    def close(self) -> None:  # idempotent (Closing): a half-built object has no cache yet
        cache = self.__dict__.pop("cache", None)
        if cache is not None:
            cache.close()
            self.fetcher.close()
        super().close()

    def __reduce__(self) -> tuple:
        # Another process (a DataLoader worker) reopens through the bucket and shares this host's cache: a plain
        # ShardedDataset over the sparse files would read bytes nobody fetched.
        url, cache_dir, kwargs = self._reopen
        return (_reopen, (url, cache_dir, kwargs))

    def __repr__(self) -> str:
        return f"BucketDataset(url={str(self.url)!r}, cache={self.path!r}, samples={self.num_samples})"


def _reopen(url: str, cache_dir: str, kwargs: dict[str, Any]) -> BucketDataset:
    return open_bucket_dataset(url, cache_dir, **kwargs)
