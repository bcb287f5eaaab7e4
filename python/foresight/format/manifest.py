"""The dataset manifest: ``manifest.json``, written last, its presence marks a complete dataset.

Layout (format ``foresight-shards``, version 1)::

    {"format": "foresight-shards", "format_version": 1, "writer": "foresight 0.1.0",
     "align": 4096, "token_dtype": "uint16" | null, "num_samples": 10, "total_bytes": 81920,
     "modalities": ["tokens"],
     "shards": [{"bin": "shard-00000.bin", "map": "shard-00000.map", "bin_bytes": 81920, "map_bytes": 1234,
                 "bin_xxh3": "<16 hex>", "map_xxh3": "<16 hex>", "num_samples": 10, "first_sample": 0}],
     "extra": {...}}

There is deliberately no timestamp: packing the same input twice gives the same manifest, hence the same
fingerprint. :func:`parse_manifest` checks every field and raises :class:`FormatError` naming the file and field.

Example::

    m = parse_manifest(open("out/manifest.json", "rb").read(), path="out/manifest.json")
    m.shards[0].bin_bytes
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np

from ..errors import FormatError
from .types import TOKEN_DTYPES, Modality

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "ShardEntry", "Manifest", "parse_manifest"]

FORMAT_NAME = "foresight-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    bin: str
    map: str
    bin_bytes: int
    map_bytes: int
    bin_xxh3: str
    map_xxh3: str
    num_samples: int
    first_sample: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Manifest:
    align: int
    token_dtype: str | None
    num_samples: int
    total_bytes: int
    modalities: list[str]
    shards: list[ShardEntry]
    writer: str
    extra: dict[str, Any]
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "writer": self.writer,
            "align": self.align,
            "token_dtype": self.token_dtype,
            "num_samples": self.num_samples,
            "total_bytes": self.total_bytes,
            "modalities": list(self.modalities),
            "shards": [s.to_json() for s in self.shards],
            "extra": self.extra,
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()


def _int(obj: dict, key: str, path: str, where: str, *, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    v = obj.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise FormatError(f"manifest field {where}{key} must be an integer in [{lo}, {hi}], got {v!r:.80}", path=path)
    return v


def _str(obj: dict, key: str, path: str, where: str, pattern: re.Pattern) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not pattern.match(v):
        raise FormatError(f"manifest field {where}{key} is malformed: {v!r:.80}", path=path)
    return v


def parse_manifest(data: bytes, *, path: str) -> Manifest:
    """Parse and validate manifest bytes; every problem is a :class:`FormatError` naming ``path``."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes", path=path)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int-digit limits
        raise FormatError(f"manifest is not valid JSON: {str(e)[:200]}", path=path) from None
    if not isinstance(doc, dict):
        raise FormatError("manifest must be a JSON object", path=path)
    if doc.get("format") != FORMAT_NAME:
        raise FormatError(f"not a {FORMAT_NAME} manifest (format={doc.get('format')!r:.80})", path=path)
    version = doc.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise FormatError(
            f"unsupported format_version {version!r:.40}; this reader knows {FORMAT_VERSION}", path=path
        )
    writer = doc.get("writer")
    if not isinstance(writer, str):
        raise FormatError("manifest field writer must be a string", path=path)
    align = _int(doc, "align", path, "", hi=1 << 30)
    if align and align & (align - 1):
        raise FormatError(f"manifest align {align} is not 0 or a power of two", path=path)
    token_dtype = doc.get("token_dtype")
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise FormatError(f"manifest token_dtype {token_dtype!r:.40} not one of {TOKEN_DTYPES}", path=path)
    num_samples = _int(doc, "num_samples", path, "")
    total_bytes = _int(doc, "total_bytes", path, "")
    modalities = doc.get("modalities")
    labels = [m.label for m in Modality]
    if not isinstance(modalities, list) or not all(isinstance(m, str) and m in labels for m in modalities):
        raise FormatError(f"manifest modalities must be a list drawn from {labels}", path=path)
    if len(set(modalities)) != len(modalities):
        raise FormatError("manifest modalities repeat", path=path)
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise FormatError("manifest field extra must be an object", path=path)
    raw_shards = doc.get("shards")
    if not isinstance(raw_shards, list):
        raise FormatError("manifest field shards must be a list", path=path)
    shards: list[ShardEntry] = []
    next_first, names, total = 0, set(), 0
    for k, s in enumerate(raw_shards):
        where = f"shards[{k}]."
        if not isinstance(s, dict):
            raise FormatError(f"manifest {where[:-1]} must be an object", path=path)
        entry = ShardEntry(
            bin=_str(s, "bin", path, where, _FILE_NAME),
            map=_str(s, "map", path, where, _FILE_NAME),
            bin_bytes=_int(s, "bin_bytes", path, where),
            map_bytes=_int(s, "map_bytes", path, where),
            bin_xxh3=_str(s, "bin_xxh3", path, where, _HEX16),
            map_xxh3=_str(s, "map_xxh3", path, where, _HEX16),
            num_samples=_int(s, "num_samples", path, where),
            first_sample=_int(s, "first_sample", path, where),
        )
        if entry.first_sample != next_first:
            raise FormatError(
                f"manifest {where}first_sample is {entry.first_sample}, expected {next_first}", path=path
            )
        for name in (entry.bin, entry.map):
            if name in names or name == MANIFEST_NAME:
                raise FormatError(f"manifest {where} reuses file name {name!r}", path=path)
            names.add(name)
        next_first += entry.num_samples
        total += entry.bin_bytes
        shards.append(entry)
    if next_first != num_samples:
        raise FormatError(f"manifest num_samples {num_samples} != sum over shards {next_first}", path=path)
    if total != total_bytes:
        raise FormatError(f"manifest total_bytes {total_bytes} != sum of shard sizes {total}", path=path)
    return Manifest(
        align=align,
        token_dtype=token_dtype,
        num_samples=num_samples,
        total_bytes=total_bytes,
        modalities=list(modalities),
        shards=shards,
        writer=writer,
        extra=extra,
        format_version=version,
    )


def token_dtype_of(manifest: Manifest) -> np.dtype | None:
    return None if manifest.token_dtype is None else np.dtype(manifest.token_dtype)
