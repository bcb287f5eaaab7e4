"""The per-shard map: sample -> (offset, length, modality, checksum, meta), as an Arrow IPC file.

Why Arrow IPC (the "file"/Feather v2 format, uncompressed):

* it memory-maps: ``pa.memory_map`` + ``pa.ipc.open_file`` touch only the footer, and every fixed-width column is
  a zero-copy numpy view (``to_numpy(zero_copy_only=True)``), so opening a 10M-sample shard costs page faults, not
  parsing; lookups are numpy gathers straight from the page cache;
* 64-bit offsets and lengths are native column types; the per-sample JSON ``meta`` column (video keyframes, time
  base, fps, duration, captions) sits beside them as a ``large_string`` column, read only when asked;
* it is self-describing, versioned (schema metadata) and readable by any Arrow tool (pandas, DuckDB, polars) for
  inspection; pyarrow validates the flatbuffer footer and, with ``validate(full=True)``, every offset, so a
  corrupt map is an exception rather than a wild read. Parquet would need decoding (no mmap views); a raw
  ``.npy`` per column would multiply files and lose the metadata column.

Example::

    m = read_map("out/shard-00000.map", rows=10, bin_bytes=40960, align=4096, token_itemsize=2)
    m.offset[:3], m.meta_json(0)
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import FormatError
from .types import Modality

__all__ = ["MAP_SCHEMA", "ShardMap", "write_map", "read_map"]

MAP_VERSION = "1"
MAP_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.uint64(), nullable=False),
        pa.field("length", pa.uint64(), nullable=False),
        pa.field("modality", pa.uint8(), nullable=False),
        pa.field("checksum", pa.uint64(), nullable=False),
        pa.field("meta", pa.large_string(), nullable=False),
    ],
    metadata={"foresight.map_version": MAP_VERSION},
)
_MAX_MODALITY = max(Modality)


class ShardMap:
    """Validated, memory-mapped columns of one shard map (numpy views; ``meta`` stays an Arrow array)."""

    def __init__(self, path: str, offset: np.ndarray, length: np.ndarray, modality: np.ndarray,
                 checksum: np.ndarray, meta: pa.Array, first_sample: int) -> None:
        self.path = path
        self.offset = offset
        self.length = length
        self.modality = modality
        self.checksum = checksum
        self._meta = meta
        self.first_sample = first_sample

    def __len__(self) -> int:
        return int(self.offset.shape[0])

    def meta_many(self, rows: np.ndarray) -> list[dict[str, Any]]:
        """Meta dicts of ``rows``: one Arrow take, one join and one JSON parse for all of them (no Python call per
        row unless a row is malformed, which is then parsed alone so the error names its sample)."""
        import pyarrow.compute as pc

        texts = self._meta.take(pa.array(np.asarray(rows, dtype=np.int64), type=pa.int64()))
        texts = pc.if_else(pc.equal(texts, ""), pa.scalar("{}", texts.type), texts)  # empty meta is {}
        one_list = pa.LargeListArray.from_arrays(pa.array([0, len(texts)], pa.int64()), texts)
        joined = pc.binary_join(one_list, pa.scalar(",", texts.type))
        try:
            values = json.loads("[" + joined[0].as_py() + "]")
        except (ValueError, RecursionError):
            values = None
        # The writer stores one json.dumps'd object per row, so a well-formed join has one object per row; anything
        # else is parsed row by row to name the bad sample.
        if values is None or len(values) != len(rows) or not all(type(v) is dict for v in values):
            return [self.meta_json(int(r)) for r in rows]
        return values

    def meta_json(self, row: int) -> dict[str, Any]:
        text = self._meta[row].as_py()
        if not text:
            return {}
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"meta is not valid JSON: {str(e)[:120]}", path=self.path,
                              sample=self.first_sample + row) from None
        if not isinstance(value, dict):
            raise FormatError("meta is not a JSON object", path=self.path, sample=self.first_sample + row)
        return value


def write_map(path: str, *, offset: np.ndarray, length: np.ndarray, modality: np.ndarray, checksum: np.ndarray,
              meta_offsets: np.ndarray, meta_data: bytes, fsync: bool = True) -> int:
    """Write one map file (single record batch) and return its size. ``meta_offsets`` has n+1 int64 entries."""
    n = int(offset.shape[0])
    meta = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(np.ascontiguousarray(meta_offsets, dtype=np.int64)), pa.py_buffer(meta_data)
    )
    batch = pa.record_batch(
        [
            pa.array(np.ascontiguousarray(offset, dtype=np.uint64)),
            pa.array(np.ascontiguousarray(length, dtype=np.uint64)),
            pa.array(np.ascontiguousarray(modality, dtype=np.uint8)),
            pa.array(np.ascontiguousarray(checksum, dtype=np.uint64)),
            meta,
        ],
        schema=MAP_SCHEMA,
    )
    with open(path, "wb") as f:
        with pa.ipc.new_file(f, MAP_SCHEMA) as writer:
            writer.write_batch(batch)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        return f.tell()


def _load_columns(path: str) -> list[pa.Array]:
    """Open the IPC file and return its five columns, validated; pyarrow failures become FormatError."""
    try:
        source = pa.memory_map(path, "r")
        reader = pa.ipc.open_file(source)
        schema = reader.schema
        if not schema.equals(MAP_SCHEMA, check_metadata=False):
            raise FormatError(f"map schema is {schema.to_string(show_schema_metadata=False)!r:.300}, expected "
                              f"{MAP_SCHEMA.to_string(show_schema_metadata=False)!r}", path=path)
        version = (schema.metadata or {}).get(b"foresight.map_version")
        if version != MAP_VERSION.encode():
            raise FormatError(f"unsupported map version {version!r:.40}", path=path)
        batches = []
        for i in range(reader.num_record_batches):
            b = reader.get_batch(i)
            b.validate(full=True)
            batches.append(b)
        if len(batches) == 1:
            columns = list(batches[0].columns)
        elif not batches:
            columns = [pa.array([], type=f.type) for f in MAP_SCHEMA]
        else:  # not what our writer produces, but valid Arrow: concatenate (a copy)
            columns = [pa.concat_arrays([b.column(k) for b in batches]) for k in range(len(MAP_SCHEMA))]
        for name, col in zip(MAP_SCHEMA.names, columns):
            if col.null_count:
                raise FormatError(f"map column {name} has {col.null_count} nulls", path=path)
        return columns
    except FormatError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
        raise FormatError(f"unreadable map: {type(e).__name__}: {str(e)[:200]}", path=path) from None


def read_map(path: str, *, rows: int, bin_bytes: int, align: int, token_itemsize: int | None,
             first_sample: int = 0, modalities: set[int] | None = None) -> ShardMap:
    """Map ``path`` and check it against its shard: row count, ranges inside ``bin_bytes``, increasing
    non-overlapping extents, alignment, known modality codes (and, if given, only ``modalities``), whole tokens. Errors name file, offset and sample."""
    cols = _load_columns(path)
    n = len(cols[0])
    if n != rows:
        raise FormatError(f"map has {n} rows, manifest says {rows}", path=path)
    offset, length, modality, checksum = (c.to_numpy(zero_copy_only=True) for c in cols[:4])

    def fail(msg: str, bad: np.ndarray) -> None:
        i = int(np.flatnonzero(bad)[0])
        raise FormatError(f"{msg}: {int(offset[i])}+{int(length[i])}", path=path, offset=int(offset[i]),
                          sample=first_sample + i)

    size = np.uint64(bin_bytes)
    if n:
        bad = offset > size
        if bad.any():
            fail(f"sample starts past the end of the {bin_bytes}-byte shard", bad)
        bad = length > size - offset
        if bad.any():
            fail(f"sample ends past the end of the {bin_bytes}-byte shard", bad)
        if align:
            bad = offset % np.uint64(align) != 0
            if bad.any():
                fail(f"sample start not aligned to {align}", bad)
        bad = np.zeros(n, dtype=bool)
        bad[1:] = offset[1:] < offset[:-1] + length[:-1]
        if bad.any():
            fail("sample overlaps or precedes the previous one", bad)
        bad = modality > _MAX_MODALITY
        if bad.any():
            fail(f"unknown modality code {int(modality[np.flatnonzero(bad)[0]])}", bad)
        if modalities is not None:
            bad = ~np.isin(modality, np.array(sorted(modalities), dtype=np.uint8))
            if bad.any():
                fail(f"modality code {int(modality[np.flatnonzero(bad)[0]])} not listed in the manifest", bad)
        if token_itemsize:
            bad = (modality == Modality.TOKENS) & (length % np.uint64(token_itemsize) != 0)
            if bad.any():
                fail(f"token sample length not a multiple of {token_itemsize}", bad)
        elif (modality == Modality.TOKENS).any():
            fail("token sample in a dataset without token_dtype", modality == Modality.TOKENS)
    return ShardMap(path, offset, length, modality, checksum, cols[4], first_sample)
