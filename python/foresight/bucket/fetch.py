"""Ranged GETs from a bucket: extents coalesced into few large requests, issued concurrently, retried on a budget.

The extents of many samples (``file`` index, ``offset``, ``length``) go through the project's coalescer
(:func:`foresight.io.coalesce.coalesce`) with object-storage caps: holes up to ``max_gap`` (1 MiB) are cheaper
fetched than a second request (one round trip of 10-30 ms is 1-4 MB at S3's per-connection rates), transfers up to
``max_transfer`` (16 MiB). Every request is pinned to the object's ETag as it was when the dataset was opened
(``If-Match``), so an object replaced since then is refused by name instead of mixing old and new bytes; the ETag
each answer carries is compared too, for a store that ignores ``If-Match`` on GET and answers with the current object.

Failures: a missing object or bucket, denied access and a changed object raise :class:`BucketError` at once;
anything else (connection refused or reset, timeouts, 5xx) is retried with exponential backoff and jitter until
``attempts`` or ``budget_s`` run out, then raises naming the object, the attempts and the last error (credentials
redacted). Each retry is logged once at WARNING and counted in :attr:`RangedFetcher.stats`.

Whole objects go through the same retried calls: :meth:`RangedFetcher.download` (a plan's arrays, a Megatron
``.idx``: ranged GETs of at most ``max_transfer`` bytes each, pinned to the ETag), :meth:`~RangedFetcher.put`,
:meth:`~RangedFetcher.delete` and :meth:`~RangedFetcher.list` (the objects under the prefix, or directly under it).

Example::

    fetcher = RangedFetcher(store, url)
    ref = fetcher.head("shard-00000.bin")
    got = fetcher.fetch([ref], np.zeros(2, np.int32), np.array([0, 8192]), np.array([100, 50]))
    got.view(1)        # the 50 bytes at offset 8192, a view into one region (one GET for both here)
"""
from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import numpy as np

from foresight.errors import BucketError
from foresight.io.coalesce import Transfers, coalesce

from .config import redact
from .url import BucketURL

log = logging.getLogger("foresight.bucket")

__all__ = ["ObjectRef", "RetryPolicy", "RangedFetcher", "Fetched", "FetchStats",
           "DEFAULT_MAX_GAP", "DEFAULT_MAX_TRANSFER", "DEFAULT_PART_BYTES", "DEFAULT_CONCURRENCY"]

DEFAULT_MAX_GAP = 1 << 20
DEFAULT_MAX_TRANSFER = 16 << 20
DEFAULT_PART_BYTES = 16 << 20  # S3 takes parts of 5 MiB - 5 GiB; 16 MiB is a few round trips' worth of transfer
# GETs in flight per fetcher. A step's GETs are latency-bound, not CPU-bound (each costs ~0.2 ms of client CPU
# whatever the width, blocking in obstore with the GIL released): 64 one-sample GETs at 16 in flight wait four round
# trips, at 64 one. On the bench's bed (30 ms, 800 Mbit/s, token, a loaded 2-core VM, 6 interleaved runs): the first
# step's fetch 0.34 -> 0.25 s, the epoch 2.13 -> 1.62 s (medians), CPU-s/GB within the noise.
DEFAULT_CONCURRENCY = 64


@dataclass(frozen=True)
class ObjectRef:
    """One object as it was when first seen: its key, size and ETag (every later GET must match them)."""

    url: BucketURL
    size: int
    etag: str | None
    modified: float | None = field(default=None, compare=False)  # server time (epoch s) a listing reported

    @property
    def key(self) -> str:
        return self.url.prefix


@dataclass(frozen=True)
class RetryPolicy:
    """The one budget of a bucket's requests: each request may take ``request_timeout_s`` (connecting at most
    ``connect_timeout_s``); a transient failure (refused or reset connection, timeout, 5xx such as S3's ``503
    SlowDown``) is retried up to ``attempts`` tries in all within ``budget_s`` seconds, waiting ``base_s * 2**k``
    before retry ``k + 1`` (at most ``max_backoff_s``, times a random factor in [0.5, 1]: jitter, so clients
    that failed together do not retry together). The client's own retries are off (:func:`open_store`): this
    layer alone counts attempts and names the object when it gives up.

    Example::

        open_dataset("s3://data/wiki", cache_dir=..., retry=RetryPolicy(attempts=20, budget_s=300))
    """

    attempts: int = 8
    budget_s: float = 60.0
    base_s: float = 0.05
    max_backoff_s: float = 2.0
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0

    def backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.base_s * (2 ** attempt)) * random.uniform(0.5, 1.0)


@dataclass
class FetchStats:
    """Counters since the fetcher was made (read them any time; updated under a lock)."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes, "retries": self.retries}


@dataclass(frozen=True)
class Fetched:
    """The bytes of one :meth:`RangedFetcher.fetch`: ``region`` holds the transfers back to back."""

    transfers: Transfers
    region: np.ndarray

    def view(self, i: int) -> np.ndarray:
        """Extent ``i``'s bytes (zero copy)."""
        return self.transfers.view(self.region, i)


def _classify(exc: BaseException) -> str | None:
    """``not_found``, ``denied``, ``changed`` for failures no retry can fix; None for transient ones."""
    from obstore import exceptions as ox

    if isinstance(exc, (ox.NotFoundError, FileNotFoundError)):
        return "not_found"
    if isinstance(exc, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)):
        return "denied"
    if isinstance(exc, (ox.PreconditionError, ox.NotModifiedError)):
        return "changed"
    text = str(exc)
    if "NoSuchBucket" in text or "NoSuchKey" in text:
        return "not_found"
    if any(code in text for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403 Forbidden")):
        return "denied"
    return None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return redact(text[:300] + ("..." if len(text) > 300 else ""))


_STATUS = re.compile(r"status code: (\d{3})")
_S3_ERROR = re.compile(r"<Code>([^<]{1,64})</Code>\s*(?:<Message>([^<]{0,200})</Message>)?")


def _what_failed(exc: BaseException) -> str:
    """The server's answer when it gave one (``HTTP 503 SlowDown: Please reduce your request rate.``, from S3's
    XML error body), else the exception's first 300 characters; credentials redacted either way."""
    text = str(exc)
    status, error = _STATUS.search(text), _S3_ERROR.search(text)
    if status and error:
        message = f": {' '.join(error.group(2).split())}" if error.group(2) else ""
        return redact(f"HTTP {status.group(1)} {error.group(1)}{message}")
    return f"{type(exc).__name__}: {_first_line(exc)}"


_WHAT = {
    "not_found": "object not found",
    "no_bucket": "bucket not found",
    "denied": "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile)",
    "changed": "object changed since the dataset was opened (ETag no longer matches)",
}


class RangedFetcher:
    """Coalesced, concurrent, retried ranged GETs of the objects under one bucket URL (see the module doc)."""

    def __init__(self, store: Any, url: BucketURL, *, concurrency: int = DEFAULT_CONCURRENCY,
                 max_gap: int = DEFAULT_MAX_GAP,
                 max_transfer: int = DEFAULT_MAX_TRANSFER, retry: RetryPolicy = RetryPolicy()) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.store = store
        self.url = url
        self.max_gap = int(max_gap)
        self.max_transfer = int(max_transfer)
        self.retry = retry
        self.stats = FetchStats()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="foresight-bucket")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "RangedFetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request, retried ------------------------------------------------------------------------------------
    def call(self, what: BucketURL, fn, *args, **kwargs):
        """``fn(store, *args, **kwargs)`` (one obstore request: a GET, HEAD, PUT, LIST, DELETE) with retries of
        transient failures; BucketError naming ``what`` otherwise."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn(self.store, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - classified below; every path raises or retries with a log line
                reason = _classify(e)
                if reason == "not_found" and not self._bucket_exists():
                    raise BucketError(_WHAT["no_bucket"], reason, bucket=self.url.bucket) from None
                if reason is not None:
                    raise BucketError(_WHAT[reason], reason, object=str(what)) from None
                attempt += 1
                wait = self.retry.backoff(attempt - 1)
                if attempt >= self.retry.attempts or time.monotonic() - start + wait > self.retry.budget_s:
                    raise BucketError(
                        f"still failing after {attempt} attempts in {time.monotonic() - start:.1f} s: "
                        f"{_what_failed(e)}", "unavailable", object=str(what)) from None
                self.stats.add(retries=1)
                log.warning("bucket: %s failed (%s), retry %d in %.2f s", what, type(e).__name__, attempt, wait)
                time.sleep(wait)

    def _bucket_exists(self) -> bool:
        """Whether the bucket answers a one-key listing (a 404 on HEAD does not say which of the two is missing)."""
        import obstore

        try:
            obstore.list_with_delimiter(self.store, self.url.prefix or None)
            return True
        except Exception as e:  # noqa: BLE001 - only a definite "no such bucket" counts as missing
            return _classify(e) != "not_found"

    def head(self, name: str) -> ObjectRef:
        """Size and ETag of object ``name`` under the URL's prefix."""
        import obstore

        url = self.url.child(name)
        meta = self.call(url, obstore.head, url.prefix)
        self.stats.add(requests=1)
        return ObjectRef(url, int(meta["size"]), meta.get("e_tag"))

    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists under the URL's prefix (False too when the bucket itself is missing)."""
        try:
            self.head(name)
        except BucketError as e:
            if e.reason != "not_found":
                raise
            return False
        return True

    def get_whole(self, ref: ObjectRef) -> bytes:
        """The whole object (manifests, maps), checked against its recorded size and ETag."""
        if ref.size == 0:
            return b""
        data = self._get_range(ref, 0, ref.size)
        return bytes(data)

    def get_object(self, name: str) -> tuple[ObjectRef, bytes]:
        """Object ``name`` under the URL's prefix, whole, and its size and ETag as served (one request: a HEAD
        before it would cost a round trip)."""
        import obstore

        url = self.url.child(name)

        def get(store, key):
            got = obstore.get(store, key)
            return got.meta, got.bytes()

        meta, data = self.call(url, get, url.prefix)
        self.stats.add(requests=1, bytes=len(data))
        ref = ObjectRef(url, int(meta["size"]), meta.get("e_tag"))
        if len(data) != ref.size:
            raise BucketError(f"short GET: {len(data)} of {ref.size} bytes", "changed", object=str(url))
        return ref, bytes(data)

    def _get_range(self, ref: ObjectRef, start: int, end: int):
        import obstore

        def get(store, key):
            options: dict[str, Any] = {"range": (start, end)}
            if ref.etag:
                options["if_match"] = ref.etag
            got = obstore.get(store, key, options=options)
            return got.meta.get("e_tag"), got.bytes()

        if end > ref.size:
            raise BucketError(f"range [{start}, {end}) past the object's end ({ref.size} bytes)", "changed",
                              object=str(ref.url))
        etag, data = self.call(ref.url, get, ref.key)
        if ref.etag and etag and _etag(etag) != _etag(ref.etag):  # a store that ignores If-Match on GET answers
            raise BucketError(f"{_WHAT['changed']}: GET answered ETag {etag}, the copy holds {ref.etag}",  # the
                              "changed", object=str(ref.url))  # current object: its ETag is the one guard left
        if len(data) != end - start:
            raise BucketError(f"short ranged GET: {len(data)} of {end - start} bytes at offset {start}", "changed",
                              object=str(ref.url))
        self.stats.add(requests=1, bytes=len(data))
        return data

    def download(self, ref: ObjectRef, path: str) -> None:
        """Write the whole object ``ref`` to the local file ``path`` (ranged GETs of ``max_transfer`` bytes each,
        in order, so memory stays bounded; flushed with ``fsync``)."""
        with open(path, "wb") as f:
            for start in range(0, ref.size, self.max_transfer):
                f.write(self._get_range(ref, start, min(ref.size, start + self.max_transfer)))
            f.flush()
            os.fsync(f.fileno())

    def put(self, name: str, data: str | os.PathLike | bytes | memoryview | BinaryIO, *,
            part_bytes: int = DEFAULT_PART_BYTES, part_concurrency: int = 8) -> ObjectRef:
        """Upload a local file (by path), a buffer or a seekable binary file object as object ``name`` under the
        URL's prefix (multipart above ``part_bytes``, parts sent ``part_concurrency`` at a time; atomic: no reader
        sees a partial object; the whole object is sent again on a retried failure), then check it with a HEAD: the
        size sent and the ETag the upload returned. Returns that size and ETag."""
        import obstore

        url = self.url.child(name)
        if isinstance(data, (str, os.PathLike)):
            size, source = os.path.getsize(data), Path(data)
        elif hasattr(data, "read"):
            size, source = data.seek(0, os.SEEK_END), data
        else:
            source = memoryview(data).cast("B")
            size = source.nbytes

        def put(store: Any, key: str) -> Any:
            if hasattr(source, "seek"):
                source.seek(0)  # a retry sends the object again from its start
            return obstore.put(store, key, source, chunk_size=part_bytes, max_concurrency=part_concurrency)

        result = self.call(url, put, url.prefix)
        self.stats.add(requests=1, bytes=size)
        ref = self.head(name)
        sent_etag = result.get("e_tag") if isinstance(result, dict) else None
        if ref.size != size or (sent_etag and ref.etag != sent_etag):
            raise BucketError(f"object not stored as sent: {ref.size} of {size} bytes, ETag {ref.etag} after an "
                              f"upload that returned {sent_etag}", "changed", object=str(url))
        return ref

    def delete(self, *names: str) -> None:
        """Delete objects ``names`` under the URL's prefix in one request (a missing one is no error, as in S3)."""
        import obstore

        if names:
            self.call(self.url.child(names[0]), obstore.delete, [self.url.key(n) for n in names])
            self.stats.add(requests=1)

    def list(self, under: str = "", *, deep: bool = True) -> list[ObjectRef]:
        """The objects under the URL's prefix (or ``under`` it), sorted by key: all of them (``deep``: one paged
        listing, retried as one request) or only those directly under it, not those of deeper "folders". A missing
        bucket or denied access is a :class:`BucketError` naming the bucket or the URL."""
        import obstore

        url = self.url.child(under) if under else self.url
        prefix = f"{url.prefix}/" if url.prefix else None
        if deep:
            metas = self.call(url, lambda store, p: [m for page in obstore.list(store, p, chunk_size=1000)
                                                     for m in page], prefix)
        else:
            metas = self.call(url, obstore.list_with_delimiter, prefix)["objects"]
        self.stats.add(requests=1 + len(metas) // 1000)
        return sorted((ObjectRef(BucketURL(url.bucket, m["path"]), int(m["size"]), m.get("e_tag"),
                                 _epoch(m.get("last_modified"))) for m in metas), key=lambda r: r.key)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]`` run on the fetcher's threads (each call its own requests, concurrently);
        waits for every call, then raises the first error in ``items``' order."""
        futures = [self._pool.submit(fn, x) for x in items]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    # -- many extents ----------------------------------------------------------------------------------------------
    def fetch(self, refs: Sequence[ObjectRef], file: np.ndarray, offset: np.ndarray, length: np.ndarray, *,
              ref_of_file: np.ndarray | None = None, max_gap: int | None = None,
              on_transfer: Callable[[Transfers, np.ndarray, int], None] | None = None,
              priority: np.ndarray | None = None, max_inflight: int | None = None,
              max_transfer: int | None = None) -> Fetched:
        """The bytes of every extent, in coalesced ranged GETs run concurrently. ``file[i]`` indexes ``refs``, or
        with ``ref_of_file`` a group of extents (``ref_of_file[file[i]]`` indexes ``refs``) that is coalesced on
        its own: extents of different groups are never merged, even in one object. ``max_gap`` overrides the
        fetcher's for this call. ``on_transfer(transfers, data, k)`` runs on the fetcher's thread as soon as
        transfer ``k``'s bytes have come (``data``: those bytes alone, read-only), to check and store them while the
        other GETs are in flight; they are then not copied into the returned region (which is empty). What it
        raises fails the call as a failed GET does. ``priority`` (a rank per extent, lowest first): GETs are sent
        in the order of the lowest rank they hold; ``max_inflight``: at most this many bytes of GETs in flight (one
        at least), the next one sent as one lands. The two together make GETs land in rank order, each at the
        link's full rate, instead of all of them sharing the link and landing together at the end (a prefetcher's
        fill, whose blocks the loader needs one step after another). ``max_transfer`` overrides the fetcher's cap
        on one GET for this call (a block fill's: a block and the sample that runs past its end, one GET)."""
        sizes = np.array([r.size for r in refs], dtype=np.int64)
        ref_of_file = np.arange(len(refs)) if ref_of_file is None else np.asarray(ref_of_file, dtype=np.int64)
        gap = self.max_gap if max_gap is None else int(max_gap)
        cap = self.max_transfer if max_transfer is None else int(max_transfer)
        tr = coalesce(file, offset, length, max_gap=gap, max_transfer=cap, align=1,
                      file_sizes=sizes[ref_of_file])
        region = np.empty(0 if on_transfer is not None else tr.total_bytes, dtype=np.uint8)

        def one(k: int, arrived: Callable[[], None] | None = None) -> None:
            start, n = int(tr.t_offset[k]), int(tr.t_length[k])
            data = self._get_range(refs[int(ref_of_file[tr.t_file[k]])], start, start + n)
            if arrived is not None:
                arrived()  # off the link: the next GET may go out while these bytes are checked and written
            dest = int(tr.t_dest[k])
            if on_transfer is not None:  # handed over as it came: no copy into a region held until the end
                on_transfer(tr, np.frombuffer(data, dtype=np.uint8), k)
            else:
                region[dest:dest + n] = np.frombuffer(data, dtype=np.uint8)

        sequence = range(tr.io_count)
        if priority is not None and tr.io_count:
            rank = np.full(tr.io_count, np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(rank, np.searchsorted(tr.t_dest, tr.x_dest, side="right") - 1,
                          np.asarray(priority, dtype=np.int64))
            sequence = np.argsort(rank, kind="stable").tolist()
        if max_inflight is None:
            futures = [self._pool.submit(one, k) for k in sequence]
        else:
            futures = self._windowed(one, sequence, tr.t_length, int(max_inflight))
        errors = [f.exception() for f in futures]  # waits for all: no request outlives the call
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return Fetched(tr, region)

    def _windowed(self, one: Callable[..., None], sequence, lengths: np.ndarray, max_inflight: int) -> list:
        """Submit ``one(k, arrived)`` for ``k`` in ``sequence`` with at most ``max_inflight`` bytes
        (``lengths[k]``) on the link at once (one GET at least): a GET's bytes leave the window when they have
        arrived (``arrived()``), not when the callback that checks and writes them returns, so the link never
        waits on the disk. Stops submitting at the first failure. Returns the futures submitted."""
        cv = threading.Condition()
        state = {"inflight": 0, "failed": False}

        def tracked(k: int, n: int) -> None:
            done = []

            def arrived() -> None:
                with cv:
                    if not done:
                        done.append(True)
                        state["inflight"] -= n
                        cv.notify_all()

            try:
                one(k, arrived)
            except BaseException:
                with cv:
                    state["failed"] = True
                raise
            finally:
                arrived()

        futures = []
        for k in sequence:
            n = int(lengths[k])
            with cv:
                while state["inflight"] and state["inflight"] + n > max_inflight and not state["failed"]:
                    cv.wait()
                if state["failed"]:
                    break
                state["inflight"] += n
            futures.append(self._pool.submit(tracked, k, n))
        return futures


def _etag(etag: str) -> str:
    """An ETag without its quotes or weak prefix (``W/"abc"`` and ``abc`` name the same version)."""
    return etag.removeprefix("W/").strip('"')


def _epoch(when: Any) -> float | None:
    """A listing's ``last_modified`` (a datetime) as epoch seconds."""
    return when.timestamp() if when is not None else None
