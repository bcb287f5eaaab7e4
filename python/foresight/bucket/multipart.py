"""S3 multipart uploads part by part, where the caller picks each part's bytes and when it leaves.

:meth:`RangedFetcher.put <foresight.bucket.fetch.RangedFetcher.put>` sends a whole file or buffer; obstore (the
bucket tier's client) cuts it into parts itself and offers no call to send one part, list the parts already stored,
or find and abort uploads left open. A replica sent while its checkpoint is being written needs all three: each
part leaves when its bytes are on disk, a part cut by a fault is sent again alone, and an aborted save must leave
no upload open. :class:`MultipartClient` makes those calls through botocore's S3 client (signing and HTTP are
botocore's), with the endpoint and keys :func:`~foresight.bucket.config.resolve_options` resolves for obstore (the
same standard places) and every call retried and classified by :meth:`RangedFetcher.call
<foresight.bucket.fetch.RangedFetcher.call>`: one retry budget, one-line errors naming the object, no secret.

Integrity: every part is sent with its ``Content-MD5`` (the server refuses a body that does not match it) and its
returned ETag recorded; :meth:`MultipartClient.verify_parts` lists the stored parts and checks each one's size and
ETag before :meth:`~MultipartClient.complete`, which then checks the object's size and ETag with a HEAD.

Example::

    with BucketPrefix("s3://eval/replicas") as objects:
        mp = MultipartClient(objects.fetcher)
        up = mp.create("job/step-1/data.bin")
        parts = [mp.upload_part(up, 1, first_8_mib), mp.upload_part(up, 2, rest)]
        mp.verify_parts(up, parts)
        ref = mp.complete(up, parts)                 # ObjectRef: size and ETag as a HEAD shows them
"""
from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from foresight.errors import BucketError

from .config import resolve_options
from .fetch import ObjectRef, RangedFetcher

log = logging.getLogger("foresight.bucket")

__all__ = ["MIN_PART_BYTES", "MAX_PARTS", "MultipartClient", "Upload", "Part", "abort_left_open", "part_ends"]

MIN_PART_BYTES = 5 << 20  # S3: every part but the last holds at least 5 MiB
MAX_PARTS = 10_000


def part_ends(cuts: list[int], min_part: int = MIN_PART_BYTES) -> list[int]:
    """Part boundaries from the boundaries ``cuts`` (ascending ends, the last one the object's size): a part ends at
    the first cut at least ``min_part`` bytes after the previous part's end; the object's tail is the last part,
    whatever its size (S3 allows that). Consecutive cuts closer than ``min_part`` are so coalesced into one part.

    >>> part_ends([4 << 20, 8 << 20, 12 << 20, 13 << 20])   # MiB: 4+4 (coalesced), 4+1 (the tail)
    [8388608, 13631488]
    """
    ends, start = [], 0
    for cut in cuts:
        if cut - start >= min_part:
            ends.append(cut)
            start = cut
    if cuts and (not ends or ends[-1] != cuts[-1]):
        ends.append(cuts[-1])
    if len(ends) > MAX_PARTS:
        raise ValueError(f"{len(ends)} parts: S3 takes at most {MAX_PARTS} (larger units)")
    return ends


@dataclass(frozen=True)
class Upload:
    """One open multipart upload: its object's key (relative to the client's prefix) and upload id."""

    name: str
    upload_id: str


@dataclass(frozen=True)
class Part:
    number: int
    size: int
    etag: str


def _code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


class MultipartClient:
    """Multipart calls on the objects under ``fetcher``'s URL, retried and classified by ``fetcher``."""

    def __init__(self, fetcher: RangedFetcher, options: dict[str, Any] | None = None, *,
                 max_connections: int = 32) -> None:
        import boto3  # lazy: botocore only where parts are sent one by one (replication to a bucket)
        from botocore.config import Config  # lazy: as above

        self.fetcher = fetcher
        self.url = fetcher.url
        opts = resolve_options(options)
        retry = fetcher.retry
        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},  # the fetcher alone retries, with its budget
            connect_timeout=retry.connect_timeout_s, read_timeout=retry.request_timeout_s,
            max_pool_connections=max_connections, s3={"addressing_style": "path"},
            request_checksum_calculation="when_required", response_checksum_validation="when_required")
        # keys not in ``opts`` come from the environment and profile files as botocore reads them: the same places
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=opts.get("endpoint"), region_name=opts.get("region"),  # resolved as for obstore
            aws_access_key_id=opts.get("access_key_id"), aws_secret_access_key=opts.get("secret_access_key"),
            aws_session_token=opts.get("session_token"), config=config)

    def _call(self, name: str, method: str, **kwargs: Any) -> Any:
        """``client.<method>(Bucket=..., **kwargs)`` for object ``name``, through the fetcher's retries. A vanished
        upload (``NoSuchUpload``: aborted, or expired by the server) fails at once, as a missing object."""
        url = self.url.child(name) if name else self.url

        def one(_store: Any) -> Any:
            try:
                return getattr(self.client, method)(Bucket=self.url.bucket, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised; NoSuchUpload made permanent for the classifier
                if _code(e) == "NoSuchUpload":
                    raise FileNotFoundError(f"multipart upload no longer exists ({method})") from None
                raise

        result = self.fetcher.call(url, one)
        self.fetcher.stats.add(requests=1)
        return result

    def create(self, name: str) -> Upload:
        got = self._call(name, "create_multipart_upload", Key=self.url.key(name))
        return Upload(name, got["UploadId"])

    def upload_part(self, up: Upload, number: int, data: bytes | bytearray | memoryview) -> Part:
        """Send part ``number`` (1-based) with its Content-MD5: a body changed on the way is refused."""
        digest = hashlib.md5(data)
        got = self._call(up.name, "upload_part", Key=self.url.key(up.name), UploadId=up.upload_id,
                         PartNumber=number, Body=bytes(data) if isinstance(data, memoryview) else data,
                         ContentMD5=base64.b64encode(digest.digest()).decode())
        etag = got["ETag"]
        if etag.strip('"') != digest.hexdigest() and len(etag.strip('"')) == 32:
            raise BucketError(f"part {number} stored with ETag {etag}, sent with MD5 {digest.hexdigest()}",
                              "checksum", object=str(self.url.child(up.name)))
        self.fetcher.stats.add(bytes=len(data))
        return Part(number, len(data), etag)

    def list_parts(self, up: Upload) -> list[Part]:
        parts: list[Part] = []
        marker = 0
        while True:
            got = self._call(up.name, "list_parts", Key=self.url.key(up.name), UploadId=up.upload_id,
                             PartNumberMarker=marker)
            parts += [Part(int(p["PartNumber"]), int(p["Size"]), p["ETag"]) for p in got.get("Parts", [])]
            if not got.get("IsTruncated"):
                return sorted(parts, key=lambda p: p.number)
            marker = int(got["NextPartNumberMarker"])

    def verify_parts(self, up: Upload, parts: list[Part]) -> None:
        """Check that the server holds exactly ``parts`` (numbers, sizes, ETags) of upload ``up``."""
        stored = {p.number: p for p in self.list_parts(up)}
        for p in parts:
            there = stored.get(p.number)
            if there is None or there.size != p.size or there.etag.strip('"') != p.etag.strip('"'):
                what = "missing" if there is None else f"{there.size} bytes, ETag {there.etag}"
                raise BucketError(f"part {p.number} is {what} at the server, sent {p.size} bytes, ETag {p.etag}",
                                  "checksum", object=str(self.url.child(up.name)))

    def complete(self, up: Upload, parts: list[Part]) -> ObjectRef:
        """Complete upload ``up`` from ``parts`` (in number order), then HEAD the object: its size must be the
        parts' sum and its ETag the one the completion returned."""
        got = self._call(up.name, "complete_multipart_upload", Key=self.url.key(up.name), UploadId=up.upload_id,
                         MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": p.etag}
                                                    for p in sorted(parts, key=lambda p: p.number)]})
        ref = self.fetcher.head(up.name)
        size = sum(p.size for p in parts)
        sent = got.get("ETag")
        if ref.size != size or (sent and ref.etag and ref.etag.strip('"') != sent.strip('"')):
            raise BucketError(f"object not stored as completed: {ref.size} of {size} bytes, ETag {ref.etag} after "
                              f"a completion that returned {sent}", "changed", object=str(ref.url))
        return ref

    def abort(self, up: Upload) -> None:
        """Abort upload ``up`` (its parts are deleted; one already gone is no error)."""
        try:
            self._call(up.name, "abort_multipart_upload", Key=self.url.key(up.name), UploadId=up.upload_id)
        except BucketError as e:
            if e.reason != "not_found":
                raise

    def open_uploads(self, under: str = "") -> list[Upload]:
        """The multipart uploads open under ``under`` (relative to the prefix; "" for the whole prefix)."""
        prefix = self.url.key(under) if under else (f"{self.url.prefix}/" if self.url.prefix else "")
        cut = len(self.url.prefix) + 1 if self.url.prefix else 0
        out: list[Upload] = []
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            got = self._call(under, "list_multipart_uploads", **kwargs)
            out += [Upload(u["Key"][cut:], u["UploadId"]) for u in got.get("Uploads", [])]
            if not got.get("IsTruncated"):
                return out
            kwargs.update(KeyMarker=got["NextKeyMarker"], UploadIdMarker=got["NextUploadIdMarker"])

    def abort_all(self, under: str = "") -> int:
        """Abort every multipart upload open under ``under``; returns how many."""
        ups = self.open_uploads(under)
        for up in ups:
            self.abort(up)
        return len(ups)

    def close(self) -> None:
        self.client.close()


def abort_left_open(fetcher: RangedFetcher, names: Collection[str], *, under: str = "",
                    options: dict[str, Any] | None = None) -> list[Upload]:
    """Abort the multipart uploads still open for objects ``names`` (relative to ``fetcher``'s prefix, all of them
    under ``under``), to be called once those objects are complete: a CreateMultipartUpload whose reply was lost
    took effect, and the retry made a second upload, which the parts went to; the first, empty, is known to nobody
    else and would stay open (billed, never expiring without a lifecycle rule). Only those names: another writer's
    uploads elsewhere under the prefix are left alone. Returns the uploads aborted. A failure is logged, never
    raised: the objects are complete, and an upload left open is invisible to readers."""
    want = set(names)
    try:
        mp = MultipartClient(fetcher, options, max_connections=2)
    except ImportError as e:  # boto3 missing (the bucket extra installs it): obstore lists no uploads
        log.warning("cannot look for uploads left open under %s: %s", fetcher.url, e)
        return []
    try:
        ups = [up for up in mp.open_uploads(under) if up.name in want]
        for up in ups:
            mp.abort(up)
    except BucketError as e:
        log.warning("cannot abort the uploads left open under %s: %s", fetcher.url.child(under.rstrip("/")) if under else
                    fetcher.url, e)
        return []
    finally:
        mp.close()
    if ups:
        log.info("aborted %d upload(s) left open (retried creates) under %s", len(ups),
                 fetcher.url.child(under.rstrip("/")) if under else fetcher.url)
    return ups
