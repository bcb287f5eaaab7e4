"""Replication hints: which checkpoint files a restart will read, and by how many ranks at once.

Before a synchronized restart the training framework knows every rank's reads. ``derive_dcp_hints`` works them out
from a DCP checkpoint's ``.metadata`` (foresight's writer or PyTorch's) and the world size that will load it:

* ``.metadata``: every rank reads it;
* a tensor saved whole (replicated over data-parallel ranks, DCP keeps one copy): every rank of a data-parallel
  group reads it (``replicated_readers``, the world size by default);
* a sharded tensor: each chunk is read by the ranks whose even dim-0 slice of the tensor overlaps it (resharding
  to another world size included);
* bytes items (Python objects, extra state): every rank.

A file's expected concurrent readers is the largest reader count of the items in it; the file's *hot bytes* are the
bytes of those items. A file whose hot bytes are a small part of it (a small replicated tensor packed with large
sharded ones) would copy mostly cold bytes when replicated: :attr:`FileHint.granularity_waste` says how many.

Example::

    hints = derive_dcp_hints("ckpt/step-100", world_size=2048)
    for h in hints: print(h.path, h.readers, h.size, h.hot_bytes)
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from foresight.checkpoint.safe_pickle import load_dcp_metadata
from foresight.errors import CheckpointError

METADATA = ".metadata"
MAX_READERS = 1 << 20  # a hint above a million concurrent readers is a bug, not a plan
MAX_TTL_S = 7 * 24 * 3600


class HintError(CheckpointError, ValueError):
    """A replication hint is malformed, names an unknown file, or asks for more than its quota allows."""


@dataclass(frozen=True)
class FileHint:
    """One file a restart will read: its size, expected concurrent readers, and the bytes all of them read."""

    path: str  # relative to the checkpoint directory
    size: int
    readers: int
    hot_bytes: int

    @property
    def granularity_waste(self) -> int:
        """Bytes per extra replica that no hot reader needs (copied only because replication is per file)."""
        return self.size - self.hot_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def validate_hints(hints: Iterable[FileHint], *, known: dict[str, int] | None = None, ttl_s: float | None = None,
                   max_readers: int = MAX_READERS) -> list[FileHint]:
    """Refuse hints that cannot be right: unknown files, sizes that differ from the file, absurd reader counts."""
    out = []
    seen = set()
    for h in hints:
        if not isinstance(h.path, str) or not h.path or os.path.isabs(h.path) or ".." in h.path.split("/"):
            raise HintError("hint names a path outside the checkpoint", path=h.path)
        if h.path in seen:
            raise HintError("file hinted twice", path=h.path)
        seen.add(h.path)
        if not isinstance(h.readers, int) or not 1 <= h.readers <= max_readers:
            raise HintError(f"reader count {h.readers!r} is not in 1..{max_readers}", path=h.path)
        if known is not None:
            if h.path not in known:
                raise HintError("hint names a file the checkpoint does not have", path=h.path)
            if known[h.path] != h.size:
                raise HintError(f"hint says {h.size} bytes, the file has {known[h.path]}", path=h.path)
        if not 0 <= h.hot_bytes <= h.size:
            raise HintError(f"hot bytes {h.hot_bytes} outside 0..{h.size}", path=h.path)
        out.append(h)
    if ttl_s is not None and not 0 < ttl_s <= MAX_TTL_S:
        raise HintError(f"hint TTL {ttl_s!r} s is not in (0, {MAX_TTL_S}]")
    return out


def _read_metadata(ckpt_dir: str):
    path = os.path.join(ckpt_dir, METADATA)
    try:
        with open(path, "rb") as f:
            return load_dcp_metadata(f, source=path)
    except FileNotFoundError as e:
        raise CheckpointError("no DCP .metadata: not a committed DCP checkpoint", path=path) from e


def _chunk_readers(offset0: int, length0: int, dim0: int, world_size: int) -> int:
    """Ranks whose even dim-0 slice [j*dim0/W, (j+1)*dim0/W) overlaps rows [offset0, offset0 + length0)."""
    if dim0 <= 0 or length0 <= 0:
        return world_size  # 0-d or empty: read by everyone who loads the key
    per = dim0 / world_size
    first = int(math.floor(offset0 / per))
    last = int(math.ceil((offset0 + length0) / per)) - 1
    return max(1, min(world_size - 1, last) - max(0, first) + 1)


def derive_dcp_hints(ckpt_dir: str, world_size: int, *, replicated_readers: int | None = None) -> list[FileHint]:
    """Hints for every file of a DCP checkpoint when ``world_size`` ranks load it (see the module docstring)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if world_size < 1:
        raise HintError(f"world size {world_size} < 1")
    replicated = replicated_readers or world_size
    meta = _read_metadata(ckpt_dir)
    storage = getattr(meta, "storage_data", None) or {}
    hot: dict[str, list[tuple[int, int]]] = {}  # file -> [(readers, bytes)] per item
    for index, info in storage.items():
        md = meta.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata) and len(md.chunks) > 1 and index.offset is not None:
            chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset)), None)
            n = (_chunk_readers(int(chunk.offsets[0]), int(chunk.sizes[0]), int(md.size[0]), world_size)
                 if chunk is not None and len(md.size) else world_size)
        elif isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            n = replicated if isinstance(md, TensorStorageMetadata) else world_size
        else:
            n = world_size
        rel = info.relative_path
        hot.setdefault(rel, []).append((n, int(info.length)))
    out = []
    for rel, items in sorted(hot.items()):
        path = os.path.join(ckpt_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise CheckpointError(f"DCP data file listed in .metadata is missing: {e.strerror}", path=path) from e
        top = max(n for n, _ in items)
        out.append(FileHint(rel, size, top, min(size, sum(b for n, b in items if n == top))))
    meta_size = os.path.getsize(os.path.join(ckpt_dir, METADATA))
    out.insert(0, FileHint(METADATA, meta_size, world_size, meta_size))
    return out
