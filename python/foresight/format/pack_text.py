"""Pack JSONL or Parquet with a text or token-id column into foresight shards, batch by batch.

Both inputs are read as Arrow record batches (``pyarrow.json.open_json`` streams JSONL, ``ParquetFile.iter_batches``
streams Parquet), and each batch is written with one :meth:`DatasetWriter.add_many` call: no per-row Python.

* token-id column (``list<int>``): TOKENS samples; ``token_dtype="auto"`` scans the column first and picks uint16
  when every id < 65536, else uint32;
* text column: TEXT samples holding the UTF-8 bytes, unless ``tokenizer`` (``list[str] -> list[list[int]]``) is
  given, which makes TOKENS.

Null rows are skipped and counted in the manifest's ``extra``.

Example::

    pack_jsonl("data.jsonl", "out/", column="text")
    pack_parquet("tok.parquet", "out2/", column="input_ids", token_dtype="auto")
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from ..errors import FormatError
from .types import Modality
from .writer import DatasetWriter

__all__ = ["pack_jsonl", "pack_parquet", "AUTO_COLUMNS"]

AUTO_COLUMNS = ("input_ids", "token_ids", "tokens", "ids", "text", "content")
Tokenizer = Callable[[Sequence[str]], Sequence[Sequence[int]]]


def _progress(total: int | None, desc: str, enabled: bool, unit: str = "rows"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, dynamic_ncols=True)


def _choose_column(names: Sequence[str], column: str | None, path: str) -> str:
    if column is not None:
        if column not in names:
            raise FormatError(f"no column {column!r}; columns are {list(names)}", path=path)
        return column
    for name in AUTO_COLUMNS:
        if name in names:
            return name
    raise FormatError(f"no text or token column found (tried {list(AUTO_COLUMNS)}); pass column=; columns are "
                      f"{list(names)}", path=path)


def _kind_of(t: pa.DataType, column: str, path: str) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
        return "tokens"
    raise FormatError(f"column {column!r} has type {t}; expected a string or a list of integers", path=path)


class _Source:
    """One input file as a stream of single-column Arrow batches."""

    def __init__(self, path: str, kind: str, column: str | None, batch_rows: int) -> None:
        self.path = path
        self.batch_rows = batch_rows
        try:
            if kind == "parquet":
                self._pf = pq.ParquetFile(path)
                schema = self._pf.schema_arrow
                self.total: int | None = self._pf.metadata.num_rows
            else:
                with pj.open_json(path, read_options=pj.ReadOptions(block_size=1 << 20)) as r:
                    schema = r.schema
                self.total = None
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"cannot read {kind} input: {str(e)[:300]}", path=path) from None
        self.format = kind
        self.column = _choose_column(schema.names, column, path)
        self.type = schema.field(self.column).type
        self.kind = _kind_of(self.type, self.column, path)

    def batches(self) -> Iterator[pa.Array]:
        try:
            if self.format == "parquet":
                for b in self._pf.iter_batches(batch_size=self.batch_rows, columns=[self.column]):
                    yield b.column(0)
            else:
                opts = pj.ParseOptions(explicit_schema=pa.schema([(self.column, self.type)]),
                                       unexpected_field_behavior="ignore")
                with pj.open_json(self.path, read_options=pj.ReadOptions(block_size=8 << 20),
                                  parse_options=opts) as r:
                    for b in r:
                        yield b.column(0)
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"cannot parse column {self.column!r}: {str(e)[:300]}", path=self.path) from None


def _token_batch(arr: pa.Array, dtype: np.dtype, path: str) -> tuple[np.ndarray, np.ndarray]:
    values = arr.flatten()
    if values.null_count:
        raise FormatError("null token id inside a list", path=path)
    flat = values.to_numpy(zero_copy_only=False)
    if flat.size:
        lo, hi = int(flat.min()), int(flat.max())
        info = np.iinfo(dtype)
        if lo < info.min or hi > info.max:
            raise FormatError(f"token ids span [{lo}, {hi}], outside {dtype.name}", path=path)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    return flat.astype(dtype, copy=False), lengths


def _text_batch(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    arr = arr.cast(pa.large_string())
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return data[offsets[0] : offsets[-1]], np.diff(offsets)


def _auto_token_dtype(src: _Source) -> np.dtype:
    hi = 0
    for arr in src.batches():
        values = arr.flatten()
        if len(values):
            lo = pc.min(values).as_py()
            if lo is not None and lo < 0:
                raise FormatError(f"negative token id {lo} in column {src.column!r}", path=src.path)
            hi = max(hi, pc.max(values).as_py() or 0)
    return np.dtype(np.uint16) if hi < 1 << 16 else np.dtype(np.uint32)


def _pack(path: str, fmt: str, out: str | os.PathLike, *, column: str | None, token_dtype: str | None,
          tokenizer: Tokenizer | None, align: int, shard_bytes: int, overwrite: bool, progress: bool,
          batch_rows: int) -> str:
    path = os.fspath(path)
    src = _Source(path, fmt, column, batch_rows)
    mode = "tokens" if src.kind == "tokens" or tokenizer is not None else "text"
    dtype = None
    if mode == "tokens":
        if token_dtype in (None, "auto"):
            if src.kind == "tokens":
                dtype = _auto_token_dtype(src)
            else:
                vocab = getattr(tokenizer, "vocab_size", None)
                dtype = np.dtype(np.uint16 if isinstance(vocab, int) and vocab <= 1 << 16 else np.uint32)
        else:
            dtype = np.dtype(token_dtype)
    extra: dict[str, Any] = {"source": os.path.abspath(path), "source_format": fmt, "column": src.column,
                             "content": mode if tokenizer is None else "tokenized text"}
    skipped = 0
    with DatasetWriter(out, align=align, shard_bytes=shard_bytes, token_dtype=dtype, overwrite=overwrite,
                       extra=extra) as w, _progress(src.total, f"pack {os.path.basename(path)}", progress) as bar:
        for arr in src.batches():
            rows = len(arr)
            if arr.null_count:
                skipped += arr.null_count
                arr = arr.filter(arr.is_valid())
            if mode == "text":
                data, lengths = _text_batch(arr)
                w.add_many(data, lengths, modality=Modality.TEXT)
            elif src.kind == "tokens":
                data, lengths = _token_batch(arr, dtype, path)
                w.add_many(data, lengths, modality=Modality.TOKENS)
            else:
                ids = tokenizer(arr.to_pylist())
                lengths = np.array([len(x) for x in ids], dtype=np.int64)
                data = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]) if ids else np.zeros(0)
                if data.size and (data.min() < 0 or data.max() > np.iinfo(dtype).max):
                    raise FormatError(f"tokenizer produced ids outside {dtype.name}", path=path)
                w.add_many(data.astype(dtype), lengths, modality=Modality.TOKENS)
            bar.update(rows)
        w.extra["skipped_null_rows"] = skipped
    return os.path.abspath(os.fspath(out))


def pack_jsonl(path: str | os.PathLike, out: str | os.PathLike, *, column: str | None = None,
               token_dtype: str | None = "auto", tokenizer: Tokenizer | None = None, align: int = 0,
               shard_bytes: int = 1 << 30, overwrite: bool = False, progress: bool = True,
               batch_rows: int = 65536) -> str:
    """Pack a JSONL file (one object per line) into a dataset at ``out``; returns its path."""
    return _pack(path, "jsonl", out, column=column, token_dtype=token_dtype, tokenizer=tokenizer, align=align,
                 shard_bytes=shard_bytes, overwrite=overwrite, progress=progress, batch_rows=batch_rows)


def pack_parquet(path: str | os.PathLike, out: str | os.PathLike, *, column: str | None = None,
                 token_dtype: str | None = "auto", tokenizer: Tokenizer | None = None, align: int = 0,
                 shard_bytes: int = 1 << 30, overwrite: bool = False, progress: bool = True,
                 batch_rows: int = 65536) -> str:
    """Pack a Parquet file into a dataset at ``out``; returns its path."""
    return _pack(path, "parquet", out, column=column, token_dtype=token_dtype, tokenizer=tokenizer, align=align,
                 shard_bytes=shard_bytes, overwrite=overwrite, progress=progress, batch_rows=batch_rows)
