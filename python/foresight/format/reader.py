"""Open a dataset: :func:`open_dataset` and the foresight shard reader :class:`ShardedDataset`.

Opening validates everything cheap enough to check up front: the manifest schema, every shard's ``.bin`` and
``.map`` size against the manifest, each map's xxh3 and structure (rows, extents inside the ``.bin``, increasing,
aligned, known modality codes). Payload checksums are verified per read (``read(verify=True)`` / ``verify``) or for
whole files with :meth:`ShardedDataset.verify_files`.

Example::

    ds = open_dataset("out/")                   # or a Megatron prefix: open_dataset("data/wiki_text_document")
    ext = ds.lookup(np.array([5, 0, 9]))        # vectorized: searchsorted over shard first ids + gathers
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import FormatError
from .manifest import MANIFEST_NAME, Manifest, parse_manifest, token_dtype_of
from .megatron import MegatronDataset
from .shard_map import ShardMap, read_map
from .types import Dataset, Extents, Modality
from foresight.checksum import file_xxh3
from foresight.io.durable import recover_overwrite

__all__ = ["open_dataset", "ShardedDataset"]


def open_dataset(path: str | os.PathLike, *, fingerprint: str = "index") -> Dataset:
    """Open a local foresight dataset directory (with ``manifest.json``) or a Megatron-LM ``.idx``/``.bin`` prefix.

    ``fingerprint="content"`` makes a Megatron dataset's fingerprint cover every byte of its ``.bin`` (see
    :class:`MegatronDataset`); a foresight directory's fingerprint always does (its manifest holds each shard's xxh3).
    Raises :class:`FormatError` naming the file when the dataset is missing, incomplete or malformed. Datasets in a
    bucket (``s3://``, or a bucket dataset's cache directory) open with ``foresight.open_dataset``
    (:mod:`foresight.bucket.opener`), which calls this one for local paths.
    """
    path = os.fspath(path)
    if fingerprint not in ("index", "content"):
        raise ValueError(f"fingerprint must be 'index' or 'content', got {fingerprint!r}")
    if path.startswith("s3://") or os.path.isfile(os.path.join(path, ".foresight-cache", "state.json")):
        raise FormatError("a dataset in a bucket (or its cache directory): open it with foresight.open_dataset",
                          path=path)
    recover_overwrite(path, has_manifest)  # a pack --overwrite that crashed between its renames
    if os.path.isdir(path):
        return ShardedDataset(path)
    prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
    if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
        return MegatronDataset(prefix, fingerprint=fingerprint)
    if os.path.exists(path):
        raise FormatError("not a foresight dataset directory nor a Megatron .idx/.bin prefix", path=path)
    raise FormatError("no dataset here (a pack that did not finish leaves none)", path=path)


def has_manifest(path: str) -> bool:
    """Whether ``path`` is a complete foresight dataset directory (its manifest is written last)."""
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


class ShardedDataset(Dataset):
    """A foresight dataset directory: ``manifest.json`` + ``shard-NNNNN.bin`` / ``shard-NNNNN.map`` pairs."""

    kind = "foresight"

    def __reduce__(self) -> tuple:
        # Mapped files and descriptors do not travel between processes: reopen (and revalidate) by path.
        return (open_dataset, (self.path,))

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        manifest_path = os.path.join(self.path, MANIFEST_NAME)
        try:
            with open(manifest_path, "rb") as f:
                raw = f.read((256 << 20) + 1)
        except FileNotFoundError:
            raise FormatError("incomplete dataset: manifest.json missing", path=manifest_path) from None
        except OSError as e:
            raise FormatError(f"cannot read manifest: {e.strerror}", path=manifest_path) from None
        self.manifest: Manifest = parse_manifest(raw, path=manifest_path)
        self._fingerprint = xxhash.xxh3_128_hexdigest(raw)
        m = self.manifest
        self.num_samples = m.num_samples
        self.modalities = list(m.modalities)
        self.token_dtype = token_dtype_of(m)
        self.align = m.align
        self.shard_paths = [os.path.join(self.path, s.bin) for s in m.shards]
        self._maps: list[ShardMap] = []
        self._cache: dict[str, np.ndarray] = {}
        listed = {Modality[name.upper()].value for name in m.modalities}
        for s, bin_path in zip(m.shards, self.shard_paths):
            map_path = os.path.join(self.path, s.map)
            for p, want in ((bin_path, s.bin_bytes), (map_path, s.map_bytes)):
                try:
                    size = os.stat(p).st_size
                except OSError as e:
                    raise FormatError(f"shard file missing or unreadable: {e.strerror}", path=p) from None
                if size != want:
                    raise FormatError(f"file is {size} bytes, manifest says {want}", path=p)
            try:
                digest = file_xxh3(map_path)
            except OSError as e:
                raise FormatError(f"cannot read map: {e.strerror}", path=map_path) from None
            if digest != s.map_xxh3:
                raise FormatError(f"map checksum {digest} != manifest {s.map_xxh3}", path=map_path)
            self._maps.append(
                read_map(map_path, rows=s.num_samples, bin_bytes=s.bin_bytes, align=m.align,
                         token_itemsize=None if self.token_dtype is None else self.token_dtype.itemsize,
                         first_sample=s.first_sample, modalities=listed)
            )
        self._first = np.array([s.first_sample for s in m.shards], dtype=np.int64)

    @property
    def fingerprint(self) -> str:
        """xxh3-128 of ``manifest.json``, which itself holds the xxh3 of every ``.bin`` and ``.map``."""
        return self._fingerprint

    def _concat(self, name: str, dtype: np.dtype) -> np.ndarray:
        arr = self._cache.get(name)
        if arr is None:
            parts = [getattr(m, name) for m in self._maps]
            arr = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
            if len(parts) == 1 and arr.dtype == parts[0].dtype:
                arr = parts[0]  # the mapped column itself, read-only
            self._cache[name] = arr
        return arr

    def lookup(self, ids: np.ndarray) -> Extents:
        ids = self._check_ids(ids)
        n = ids.size
        if len(self._maps) == 1:
            m = self._maps[0]
            return Extents(np.zeros(n, np.int32), m.offset[ids].view(np.int64), m.length[ids].view(np.int64))
        shard = (np.searchsorted(self._first, ids, side="right") - 1).astype(np.int32)
        local = ids - self._first[shard]
        offset = np.empty(n, np.int64)
        length = np.empty(n, np.int64)
        # Group by shard (a loop over the shards a batch touches, never over samples).
        order = np.argsort(shard, kind="stable")
        sorted_shard = shard[order]
        cuts = np.flatnonzero(np.diff(sorted_shard)) + 1
        for group in np.split(order, cuts):
            if not group.size:
                continue
            m = self._maps[int(shard[group[0]])]
            rows = local[group]
            offset[group] = m.offset[rows].view(np.int64)
            length[group] = m.length[rows].view(np.int64)
        return Extents(shard, offset, length)

    def sample_bytes(self) -> np.ndarray:
        return self._concat("length", np.dtype(np.uint64)).view(np.int64)

    def modality_codes(self) -> np.ndarray:
        return self._concat("modality", np.dtype(np.uint8))

    def checksums(self) -> np.ndarray:
        return self._concat("checksum", np.dtype(np.uint64))

    def meta(self, i: int) -> dict[str, Any]:
        i = int(self._check_ids(i)[0])
        s = int(np.searchsorted(self._first, i, side="right") - 1)
        return self._maps[s].meta_json(i - int(self._first[s]))

    def meta_many(self, ids: np.ndarray | Sequence[int]) -> list[dict[str, Any]]:
        """The meta dicts of ``ids`` in order: one batched lookup per shard they touch (see ShardMap.meta_many)."""
        ids = self._check_ids(ids)
        out: list[Any] = [None] * len(ids)
        shard = np.searchsorted(self._first, ids, side="right") - 1
        for s in np.unique(shard):  # a loop over the shards touched, never over samples
            where = np.flatnonzero(shard == s)
            for k, value in zip(where.tolist(), self._maps[int(s)].meta_many(ids[where] - int(self._first[s]))):
                out[k] = value
        return out

    def verify_files(self) -> None:
        """Stream every ``.bin`` and compare with the manifest's xxh3 (reads the whole dataset)."""
        for s, p in zip(self.manifest.shards, self.shard_paths):
            digest = file_xxh3(p)
            if digest != s.bin_xxh3:
                raise FormatError(f"shard checksum {digest} != manifest {s.bin_xxh3}", path=p)
