"""A foresight dataset in a bucket, read through its local cache: :func:`open_bucket_dataset`, :class:`BucketDataset`.

Opening fetches the manifest and every shard map whole (kept in the cache directory, checked by the manifest's
xxh3 as for any local dataset), heads every shard object (size and ETag recorded: later GETs must match them),
and lays out one sparse file per shard at its full size. The dataset is then a :class:`ShardedDataset` over that
directory, so the loader's one read path (coalesced io_uring reads of the shard files) is the read path here too;
:meth:`BucketDataset.lookup` first makes the samples it is asked for present in the cache (one coalesced fetch of
the missing ones), so a reader never sees a byte that was not fetched and checked.

A prefix that holds no ``manifest.json`` but names a Megatron-LM pair (``s3://bucket/path/name`` for
``name.idx``/``name.bin``) opens as a :class:`BucketMegatronDataset`: the ``.idx`` fetched whole into the cache
directory (and validated against the ``.bin``'s size as for a local pair), the ``.bin`` laid out sparse and read by
the same ranged, coalesced, cached fetches (held to its ETag: Megatron has no per-sample checksums).

The cache directory is kept across restarts: the recorded manifest ETag is compared with the bucket's on open;
when it changed (the dataset was re-packed and uploaded again) the cached copy is dropped and laid out anew.

Example::

    ds = open_bucket_dataset("s3://data/wiki", cache_dir="/nvme/foresight-cache")
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=64, seq_len=2048, num_steps=100)
    with Loader(plan, datasets=ds) as loader:   # each step's samples fetched on first use, read from the cache
        ...
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np

from foresight.errors import BucketError, FormatError
from foresight.format.manifest import MANIFEST_NAME, parse_manifest
from foresight.format.megatron import MegatronDataset
from foresight.format.reader import ShardedDataset
from foresight.format.types import Extents
from foresight.io.durable import fsync_dir

from .cache import INDEX_DIR, SampleCache, allocate_index
from .config import endpoint_place, open_store, resolve_options
from .fetch import DEFAULT_CONCURRENCY, ObjectRef, RangedFetcher, RetryPolicy
from .lockwait import LOCK_WAIT_S, check_wait_s, touch, wait_for_lock
from .url import BucketURL

log = logging.getLogger("foresight.bucket")

__all__ = ["open_bucket_dataset", "BucketDataset", "BucketMegatronDataset", "local_dir_of", "is_cache_dir",
           "cache_layout_of", "reopen_cache_dir"]

STATE_NAME = "state.json"  # written last: its presence marks a complete layout
BOOT_NAME = "boot_id"  # the boot during which the index's marks were made (their bytes may be in its page cache)


def local_dir_of(url: BucketURL, cache_dir: str | os.PathLike, options: dict[str, Any] | None = None) -> str:
    """Where ``url``'s dataset is mirrored under ``cache_dir``: ``cache_dir/bucket/prefix`` (``cache_dir/bucket``
    for a bucket's root) for the provider's default endpoint, ``cache_dir/_endpoint-<host>-<port>-<hash>/bucket/
    prefix`` for the endpoint ``options`` (or the environment, the profile) name
    (:func:`~foresight.bucket.config.endpoint_place`): two endpoints' objects under one bucket and key are different
    data. Another URL's copy may lie inside it (``s3://b`` holds ``s3://b/plans/p1``'s): what writes here touches
    only its own plain files, never a directory or a dotfile (:func:`_clear`)."""
    parts = url.prefix.split("/") if url.prefix else []
    root = os.path.abspath(os.fspath(cache_dir))
    place = endpoint_place(options)
    return os.path.join(root, *([place] if place else []), url.bucket, *parts)


def is_cache_dir(path: str) -> bool:
    """Whether ``path`` is a bucket dataset's cache directory (its sparse files must never be read as a plain
    local dataset: bytes not fetched read as zeros)."""
    return os.path.isfile(os.path.join(path, INDEX_DIR, STATE_NAME))


def cache_layout_of(path: str) -> str | None:
    """The bucket dataset cache directory that ``path`` names, or None: the directory itself, or a Megatron prefix
    (``.idx``/``.bin``) inside one (what a plan records for a bucket Megatron dataset)."""
    if os.path.isdir(path) and is_cache_dir(path):
        return path
    prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
    parent = os.path.dirname(os.path.abspath(prefix))
    if is_cache_dir(parent) and os.path.isfile(prefix + ".idx"):
        return parent
    return None


def reopen_cache_dir(path: str, **kwargs: Any) -> "BucketDataset | BucketMegatronDataset":
    """Open the bucket dataset whose cache directory is ``path`` (what ``open_dataset(path)`` does for one: a plan's
    recorded location, a search hit), through its bucket URL and the same cache."""
    state_path = os.path.join(path, INDEX_DIR, STATE_NAME)
    try:
        with open(state_path, "rb") as f:
            state = json.loads(f.read())
        url, endpoint = BucketURL.parse(state["url"]), state.get("endpoint")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BucketError(f"cache state unreadable: {type(e).__name__}", "checksum", path=state_path) from None
    root = os.path.abspath(path)
    for _ in range(1 + (len(url.prefix.split("/")) if url.prefix else 0)):
        root = os.path.dirname(root)
    if endpoint:  # laid out from another endpoint than the provider's: read through that one again
        root = os.path.dirname(root)
        kwargs["options"] = {"endpoint": endpoint, **(kwargs.get("options") or {})}
    here = os.path.abspath(path)
    parts = url.prefix.split("/") if url.prefix else []
    legacy = not endpoint and here == os.path.join(root, url.bucket, *parts)  # no endpoint recorded: the provider's
    # default, or a copy laid out before endpoints had places (any endpoint): read through the caller's endpoint now,
    # at its own place (a copy there, or a new one), never the old copy's bytes as another endpoint's
    if not legacy and local_dir_of(url, root, kwargs.get("options")) != here:
        raise BucketError(f"cache directory is not where {url} is cached under any root", "checksum", path=path)
    return open_bucket_dataset(url, root, **kwargs)


@contextlib.contextmanager
def _layout_lock(local: str, wait_s: float) -> Iterator[Callable[[], None]]:
    """The copy's layout lock (``flock`` on ``.foresight-cache/lock``), held through the ``with``; yields the
    holder's ``beat()``: it touches the lock file, the progress its waiters look for. A wait in which the lock
    file does not move for ``wait_s`` (a holder stopped, or stuck on its disk) is a ``lock_timeout``."""
    path = os.path.join(local, INDEX_DIR, "lock")
    with open(path, "a+b") as lock:
        fd = lock.fileno()

        def try_lock() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        wait_for_lock(try_lock, fd=fd, path=path, wait_s=wait_s, progress=lambda: os.fstat(fd).st_mtime_ns,
                      what="the layout of this cache copy (another process is laying it out or opening it)")
        touch(fd)  # taken and (below) let go: the lock passing from one open to the next is progress too (the
        try:  # ranks and DataLoader workers of a host open one after another, each waiting for all before it)
            yield partial(touch, fd)
        finally:
            touch(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _cache_writes(local: str) -> Iterator[None]:
    """A full cache disk (or quota) while laying out: a one-line ``cache_full`` :class:`BucketError` naming the
    cache directory (a bare ``[Errno 28]`` from ``write`` names no file); no state is written, so the next open
    lays out again."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise BucketError(f"cannot write the cache: {os.strerror(e.errno)} (free the disk or use another cache "
                          "directory)", "cache_full", path=local) from None


def _ref_json(ref: ObjectRef) -> dict[str, Any]:
    return {"key": ref.key, "size": ref.size, "etag": ref.etag}


def _lay_out(local: str, fetcher: RangedFetcher, manifest_ref: ObjectRef, raw: bytes,
             endpoint: str | None = None, beat: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Fetch the maps whole, head the shards, create the sparse files and the index (``raw``: the manifest's
    bytes, fetched by the caller); returns the state (written last). ``beat()`` after each map or shard: the
    layout lock's waiters see the layout move (:func:`_layout_lock`)."""
    index_dir = os.path.join(local, INDEX_DIR)
    _clear(local)
    manifest = parse_manifest(raw, path=str(manifest_ref.url))

    def one(task: tuple[str, Any]) -> ObjectRef | None:  # a map fetched whole, or a shard headed and laid out sparse
        kind, s = task
        if kind == "map":
            map_ref, data = fetcher.get_object(s.map)
            if map_ref.size != s.map_bytes:
                raise BucketError(f"map object is {map_ref.size} bytes, the manifest says {s.map_bytes}", "changed",
                                  object=str(map_ref.url))
            _write_atomic(os.path.join(local, s.map), data)
            beat()
            return None
        bin_ref = fetcher.head(s.bin)
        if bin_ref.size != s.bin_bytes:
            raise BucketError(f"shard object is {bin_ref.size} bytes, the manifest says {s.bin_bytes}", "changed",
                              object=str(bin_ref.url))
        with open(os.path.join(local, s.bin), "wb") as f:
            f.truncate(s.bin_bytes)  # sparse: no block allocated until fetched bytes land
        beat()
        return bin_ref

    # every map and shard at once: one round trip for the whole layout, not three per shard
    got = fetcher.map(one, [("map", s) for s in manifest.shards] + [("bin", s) for s in manifest.shards])
    shard_refs = got[len(manifest.shards):]
    _make_index(os.path.join(index_dir, "present"), manifest.num_samples)
    _write_atomic(os.path.join(local, MANIFEST_NAME), raw)
    fsync_dir(local)
    state = {"url": str(fetcher.url), "manifest": _ref_json(manifest_ref), "shards": [_ref_json(r) for r in shard_refs],
             **({"endpoint": endpoint} if endpoint else {})}
    _write_atomic(os.path.join(index_dir, STATE_NAME), json.dumps(state).encode())
    return state


def _make_index(path: str, entries: int) -> None:
    """The index of present samples: one zero byte per sample, its blocks allocated (:func:`allocate_index`).

    A new file renamed over the old one, never the old one truncated in place: a process that still has the
    previous copy open maps that index and keeps fetching into that copy's (unlinked) shard files; marking the
    new copy's index instead would say present samples whose bytes the new sparse files never got."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.truncate(entries)
            allocate_index(f.fileno(), entries, path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _refuse_foreign(local: str) -> None:
    """:class:`BucketError` (reason ``cache``) when ``local`` already holds plain files but no cache index: files
    this cache did not lay out (a local dataset copied under the cache directory's ``bucket/prefix`` place), which
    a layout would remove. The index directory is made before anything else, so a layout cut short is ours."""
    if not os.path.isdir(local) or os.path.isdir(os.path.join(local, INDEX_DIR)):
        return
    with os.scandir(local) as entries:
        theirs = [e.name for e in entries if not e.name.startswith(".") and not e.is_dir()]
    if theirs:
        raise BucketError(f"the cache place of this dataset holds {len(theirs)} files the bucket cache did not lay "
                          f"out (e.g. {sorted(theirs)[0]!r}): left as they are; pass another cache directory",
                          "cache", path=local)


def _clear(local: str) -> None:
    """Remove an older copy (or a layout cut short): its plain files (shards, maps, manifest, a pair's ``.idx``/
    ``.bin``, temporary files, the index directory's temporary files too). Directories and dotfiles are left: they
    are the index directory and the copies of other URLs nested under this prefix (a plan at ``s3://b/plans/p1``
    under a dataset at ``s3://b``, and its mirror's records ``.p1.foresight-mirror.*``)."""
    for name in os.listdir(local):
        path = os.path.join(local, name)
        if not name.startswith(".") and (os.path.islink(path) or not os.path.isdir(path)):
            os.unlink(path)
    index_dir = os.path.join(local, INDEX_DIR)
    for name in os.listdir(index_dir) if os.path.isdir(index_dir) else ():
        if ".tmp-" in name:  # a temporary file (index, state) of a layout killed midway; the caller holds the lock
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(index_dir, name))


def _lay_out_megatron(local: str, fetcher: RangedFetcher, idx_ref: ObjectRef,
                      endpoint: str | None = None, beat: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Fetch the ``.idx`` whole, head the ``.bin``, lay it out sparse, check the pair and create the index;
    returns the state (written last)."""
    _clear(local)
    name = idx_ref.key.rsplit("/", 1)[-1][:-len(".idx")]
    bin_ref = fetcher.head(name + ".bin")
    beat()
    fetcher.download(idx_ref, os.path.join(local, name + ".idx"))
    beat()
    with open(os.path.join(local, name + ".bin"), "wb") as f:
        f.truncate(bin_ref.size)  # sparse
    try:  # the .idx checked against the .bin's size, as a local pair is
        pair = MegatronDataset(os.path.join(local, name))
    except FormatError as e:  # named by its objects; no state written, so the next open lays out anew
        raise FormatError(f"Megatron pair {fetcher.url.child(name)}.idx/.bin does not check: {e}") from None
    _make_index(os.path.join(local, INDEX_DIR, "present"), pair.num_samples)
    pair.close()
    fsync_dir(local)
    state = {"url": str(fetcher.url.child(name)), "kind": "megatron", "idx": _ref_json(idx_ref),
             "shards": [_ref_json(bin_ref)], **({"endpoint": endpoint} if endpoint else {})}
    _write_atomic(os.path.join(local, INDEX_DIR, STATE_NAME), json.dumps(state).encode())
    return state


def _read_state(local: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(local, INDEX_DIR, STATE_NAME), "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _get_or_none(fetcher: RangedFetcher, name: str) -> tuple[ObjectRef, bytes] | None:
    """The object, whole, and its ref; None when it is missing (a missing bucket still raises, naming the bucket)."""
    try:
        return fetcher.get_object(name)
    except BucketError as e:
        if e.reason != "not_found" or "bucket" in e.context:
            raise
        return None


def _head_or_none(fetcher: RangedFetcher, name: str) -> ObjectRef | None:
    """The object's ref, or None when it is missing (a missing bucket still raises, naming the bucket)."""
    try:
        return fetcher.head(name)
    except BucketError as e:
        if e.reason != "not_found" or "bucket" in e.context:
            raise
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # no boot id to compare: every open re-hashes the marked samples (never a lost write served)
        return ""


def _scrub_after_reboot(ds: "BucketDataset | BucketMegatronDataset", local: str,
                        beat: Callable[[], None] = lambda: None) -> None:
    """Marks are made once bytes are written, not synced: a machine crash may have lost bytes whose marks reached
    the disk. On the first open in a boot other than the recorded one, re-hash the marked samples (unmarking those
    that differ), then record this boot (before any mark of it is made: the caller holds the layout lock)."""
    path = os.path.join(local, INDEX_DIR, BOOT_NAME)
    now = _boot_id()
    try:
        with open(path) as f:
            recorded = f.read().strip()
    except OSError:
        recorded = None
    if now and recorded == now:
        return
    if ds.cache.checksums is None and ds.cache.present.any():  # a Megatron pair: nothing to check against
        log.warning("bucket cache %s: first open since a reboot: %d marked samples forgotten (refetched on next use; "
                    "no per-sample checksums to check them against)", ds.path, ds.cache.unmark_all())
    elif ds.cache.present.any():
        bad = ds.cache.scrub(on_progress=beat)  # a large cache takes minutes: the lock's waiters see it move
        log.warning("bucket cache %s: first open since a reboot: the marked samples re-hashed, %d unmarked (refetched "
                    "on next use)", ds.path, bad.size)
    _write_atomic(path, now.encode())


def open_bucket_dataset(url: str | BucketURL, cache_dir: str | os.PathLike, *, fingerprint: str = "index",
                        options: dict[str, Any] | None = None, concurrency: int = DEFAULT_CONCURRENCY,
                        max_gap: int | None = None,
                        max_transfer: int | None = None,
                        retry: RetryPolicy = RetryPolicy(),
                        lock_wait_s: float = LOCK_WAIT_S) -> "BucketDataset | BucketMegatronDataset":
    """Open the foresight dataset at ``url`` (``s3://bucket/prefix``) through a cache under ``cache_dir``.

    The prefix holds a foresight dataset (``manifest.json``) or names a Megatron-LM pair (``url + ".idx"``,
    ``url + ".bin"``). ``options`` are obstore S3 config keys (``endpoint``, ``access_key_id``, ...) over the
    standard places (:mod:`foresight.bucket.config`); ``concurrency`` the GETs in flight (64); ``max_gap``/
    ``max_transfer`` the coalescer's caps for object storage (1 MiB / 16 MiB by default); ``retry`` the requests'
    timeouts and the budget of retries of transient failures (:class:`RetryPolicy`). ``fingerprint="content"``
    (hash every byte of a Megatron ``.bin``) is refused for a Megatron pair here: it would fetch the whole object.
    ``lock_wait_s`` (300): how long a wait on another process of the host (its layout of this copy, its fetch or
    eviction of a sample) goes on while that process makes no progress, before a ``lock_timeout``
    :class:`BucketError` naming the lock file (:mod:`foresight.bucket.lockwait`).
    """
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    lock_wait_s = check_wait_s(lock_wait_s)
    if fingerprint not in ("index", "content"):
        raise ValueError(f"fingerprint must be 'index' or 'content', got {fingerprint!r}")
    store = open_store(url, options, timeout_s=retry.request_timeout_s, connect_timeout_s=retry.connect_timeout_s)
    caps = {k: v for k, v in (("max_gap", max_gap), ("max_transfer", max_transfer)) if v is not None}
    fetcher = RangedFetcher(store, url, concurrency=concurrency, retry=retry, **caps)
    try:
        local = local_dir_of(url, cache_dir, options)
        endpoint = resolve_options(options).get("endpoint") or None  # recorded: a reopen by path reads from it
        _refuse_foreign(local)
        os.makedirs(os.path.join(local, INDEX_DIR), exist_ok=True)
        with _layout_lock(local, lock_wait_s) as beat:  # one process lays out; the others wait, then reuse it
            state = _read_state(local)
            got = _get_or_none(fetcher, MANIFEST_NAME)  # small: fetched whole, not headed first
            if got is not None:
                manifest_ref, raw = got
                lay_out = partial(_lay_out, local, fetcher, manifest_ref, raw, endpoint, beat)
                if state is None or state.get("manifest") != _ref_json(manifest_ref):
                    _drop(local, url, state)
                    with _cache_writes(local):
                        state = lay_out()
                    lay_out = None
            else:
                fetcher = _megatron_fetcher(url, fetcher, concurrency, retry, caps)
                name = url.prefix.rsplit("/", 1)[-1]
                idx_ref = _head_or_none(fetcher, name + ".idx") if url.prefix else None
                if idx_ref is None:
                    raise BucketError(f"dataset not found: no manifest.json under it (a foresight dataset) and no "
                                      f"{name or '<name>'}.idx beside it (a Megatron pair)", "not_found",
                                      object=str(url))
                if fingerprint == "content":
                    raise ValueError(f"{url}: fingerprint='content' hashes every byte of the .bin, which would "
                                     "fetch it whole; a bucket Megatron pair takes fingerprint='index'")
                lay_out = partial(_lay_out_megatron, local, fetcher, idx_ref, endpoint, beat)
                if state is None or state.get("idx") != _ref_json(idx_ref):
                    _drop(local, url, state)
                    with _cache_writes(local):
                        state = lay_out()
                    lay_out = None
            try:
                ds = _open_layout(local, url, fetcher, state, lock_wait_s)
            except _DAMAGED as e:  # a kept copy whose files were cut, removed or written by another version
                if lay_out is None or getattr(e, "reason", None) == "cache_full":  # just laid out: what fails is
                    raise  # the dataset itself; a full disk: the copy is sound, kept for when there is room
                log.warning("bucket cache %s: the kept copy of %s is damaged (%s): laid out anew, its samples "
                            "fetched again", local, url, " ".join(f"{type(e).__name__}: {e}".split())[:300])
                _drop(local, url, state, quiet=True)
                with _cache_writes(local):
                    state = lay_out()
                ds = _open_layout(local, url, fetcher, state, lock_wait_s)
            beat()
            try:  # under the layout lock: no mark of this boot is made before the check
                _scrub_after_reboot(ds, local, beat)
            except BaseException:
                ds.close()
                raise
        ds._reopen = (str(url), os.fspath(cache_dir), {"options": options, "concurrency": concurrency,
                                                       "max_gap": max_gap, "max_transfer": max_transfer,
                                                       "retry": retry, "lock_wait_s": lock_wait_s})
        return ds
    except BaseException:
        fetcher.close()
        raise


# What opening a kept copy raises when its files were damaged: cut short or removed (FormatError from the local
# reader, the index's size check, a file not found), or a state.json of another version (a key missing, a value of
# another type). Not a PermissionError: another user's copy is named, never laid out again over theirs.
_DAMAGED = (FormatError, BucketError, FileNotFoundError, KeyError, TypeError, ValueError)


def _open_layout(local: str, url: BucketURL, fetcher: RangedFetcher, state: dict[str, Any],
                 lock_wait_s: float = LOCK_WAIT_S) -> "BucketDataset | BucketMegatronDataset":
    """The dataset over the laid-out copy ``state`` describes (local files only: no request)."""
    refs = [ObjectRef(BucketURL(url.bucket, r["key"]), int(r["size"]), r["etag"]) for r in state["shards"]]
    kind = BucketMegatronDataset if state.get("kind") == "megatron" else BucketDataset
    ds = kind(local, url, fetcher, refs, lock_wait_s=lock_wait_s)
    laid = [os.path.getsize(p) for p in ds.shard_paths]
    if laid != [r.size for r in refs]:  # a sparse file cut short or grown: reads past a cut would come back short
        ds.close()
        raise FormatError(f"cached shard files are {laid} bytes, their objects {[r.size for r in refs]}")
    return ds


def _drop(local: str, url: BucketURL, state: dict[str, Any] | None, *, quiet: bool = False) -> None:
    """Forget a cached copy whose marker (manifest or ``.idx``) changed in the bucket (or that is damaged):
    laid out anew."""
    if state is not None:
        if not quiet:
            log.warning("bucket: %s changed since it was cached (manifest or .idx ETag): cache dropped", url)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(local, INDEX_DIR, STATE_NAME))


def _megatron_fetcher(url: BucketURL, fetcher: RangedFetcher, concurrency: int, retry: RetryPolicy,
                      caps: dict[str, int]) -> RangedFetcher:
    """A fetcher over the pair's folder (``name.idx`` and ``name.bin`` are its children), on the same store."""
    parent = BucketURL(url.bucket, url.prefix.rsplit("/", 1)[0] if "/" in url.prefix else "")
    fetcher.close()
    return RangedFetcher(fetcher.store, parent, concurrency=concurrency, retry=retry, **caps)


class _FetchesOnLookup:
    """What both bucket dataset kinds add to their local reader: :meth:`lookup` makes the samples present first
    (one coalesced fetch of the missing ones), ``close`` closes the cache and fetcher, and pickling reopens through
    the bucket (a DataLoader worker shares this host's cache; a plain reader over the sparse files would read
    bytes nobody fetched)."""

    url: BucketURL
    fetcher: RangedFetcher
    cache: SampleCache
    _reopen: tuple

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

    @property
    def object_etags(self) -> dict[str, str | None]:
        """The ETag of each shard object as this copy holds it (``s3://`` URL -> ETag): what a plan built over
        the dataset records, so that a host opening it later refuses objects replaced since (a Megatron ``.bin``
        has no per-sample checksums to catch that)."""
        return {str(ref.url): ref.etag for ref in self.cache.refs}

    def close(self) -> None:  # idempotent (Closing): a half-built object has no cache yet
        cache = self.__dict__.pop("cache", None)
        if cache is not None:
            cache.close()
            self.fetcher.close()
        super().close()

    def __reduce__(self) -> tuple:
        url, cache_dir, kwargs = self._reopen
        return (_reopen, (url, cache_dir, kwargs))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={str(self.url)!r}, cache={self.path!r}, samples={self.num_samples})"


class BucketDataset(_FetchesOnLookup, ShardedDataset):
    """A :class:`ShardedDataset` over a bucket dataset's cache directory whose :meth:`lookup` fetches what is
    missing first. ``url`` is the bucket location, ``cache`` the :class:`SampleCache`."""

    kind = "foresight"

    def __init__(self, local_dir: str, url: BucketURL, fetcher: RangedFetcher, refs: list[ObjectRef], *,
                 lock_wait_s: float = LOCK_WAIT_S) -> None:
        super().__init__(local_dir)
        self.url = url
        self.fetcher = fetcher
        # the local reader's lookup (the cache's own calls must not fetch again)
        self.cache = SampleCache(local_dir, fetcher, refs, self.shard_paths, partial(ShardedDataset.lookup, self),
                                 self.checksums(), lock_wait_s=lock_wait_s)


class BucketMegatronDataset(_FetchesOnLookup, MegatronDataset):
    """A Megatron-LM pair in a bucket: a :class:`MegatronDataset` over the cached ``.idx`` and the sparse ``.bin``
    whose :meth:`lookup` fetches what is missing first (ranged, coalesced GETs held to the ``.bin``'s ETag)."""

    def __init__(self, local_dir: str, url: BucketURL, fetcher: RangedFetcher, refs: list[ObjectRef], *,
                 lock_wait_s: float = LOCK_WAIT_S) -> None:
        super().__init__(os.path.join(local_dir, url.prefix.rsplit("/", 1)[-1]))
        self.url = url
        self.fetcher = fetcher
        self.cache = SampleCache(local_dir, fetcher, refs, self.shard_paths, partial(MegatronDataset.lookup, self), None,
                                 num_samples=self.num_samples, lock_wait_s=lock_wait_s)


def _reopen(url: str, cache_dir: str, kwargs: dict[str, Any]) -> "BucketDataset | BucketMegatronDataset":
    return open_bucket_dataset(url, cache_dir, **kwargs)
