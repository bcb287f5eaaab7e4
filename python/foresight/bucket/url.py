"""Bucket URLs: ``s3://bucket/prefix`` parsed once, joined to object keys, printed without credentials.

Example::

    url = BucketURL.parse("s3://data/wiki/v1/")
    url.bucket, url.prefix          # ("data", "wiki/v1")
    url.key("manifest.json")        # "wiki/v1/manifest.json"
    str(url.child("shard-00000.bin"))  # "s3://data/wiki/v1/shard-00000.bin"
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["BucketURL", "is_bucket_url", "SCHEMES"]

SCHEMES = ("s3://",)
# S3's bucket naming rules (3-63 chars of lower-case letters, digits, dots and hyphens), loosely: a typo fails here,
# before any request.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def is_bucket_url(path: object) -> bool:
    """Whether ``path`` names an object-store location (``s3://...``) rather than a local path."""
    return isinstance(path, str) and path.startswith(SCHEMES)


@dataclass(frozen=True)
class BucketURL:
    """A bucket and a key prefix (no leading or trailing slash; empty for the bucket's root)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str | os.PathLike) -> "BucketURL":
        """Parse ``s3://bucket[/prefix]``; :class:`ValueError` names what is wrong with the URL."""
        text = os.fspath(url)
        if not is_bucket_url(text):
            raise ValueError(f"not a bucket URL (expected s3://bucket/prefix): {text!r}")
        rest = text[len("s3://"):]
        if "?" in rest or "#" in rest or "@" in rest:
            raise ValueError(f"bucket URL must not carry a query, fragment or credentials: {text.split('@')[-1]!r}")
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"bad bucket name {bucket!r} in {text!r} (3-63 lower-case letters, digits, '.', '-')")
        if any(ord(c) < 32 or ord(c) == 127 for c in rest):  # the client refuses such keys on every request
            raise ValueError(f"bucket URL must not hold control characters (tab, newline, ...): {text!r}")
        prefix = prefix.strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ValueError(f"bad key prefix {prefix!r} in {text!r} (empty, '.' or '..' parts)")
        return cls(bucket, prefix)

    def key(self, name: str) -> str:
        """The object key of ``name`` under this prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> "BucketURL":
        return BucketURL(self.bucket, self.key(name))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
