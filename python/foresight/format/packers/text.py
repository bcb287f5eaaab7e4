"""Pack JSONL and Parquet files with a text or token-id column into one foresight dataset, batch by batch.

The inputs are any mix of files, globs and folders (a Hugging Face dataset folder of Parquet shards, ``.jsonl.gz``
parts): :func:`~foresight.format.packers.inputs.resolve_inputs` orders them, and they become one dataset whose
samples follow that order. Every file is read as Arrow record batches (``ParquetFile.iter_batches``, a streaming
``pyarrow.json`` reader over a decompressing stream) and each batch is written with one
:meth:`DatasetWriter.add_many` call: no per-row Python.

* token-id column (``list<int>``): TOKENS samples; ``token_dtype="auto"`` picks uint16 when every id < 65536, else
  uint32, from the Parquet column statistics when every row group has them, else from one scan of the column;
* text column: TEXT samples holding the UTF-8 bytes, unless ``tokenizer`` is given (a ``tokenizer.json`` path, a
  ``module:function`` or a callable ``list[str] -> list[list[int]]``, see :mod:`.tokenizer`), which makes TOKENS.

All files must agree on the column and on its kind (text or token ids). One progress bar counts the input bytes
(plus the scan's, when there is one), so it has a total and an ETA from the start. Null rows are skipped and counted
in the manifest's ``extra``.

Example::

    pack_records(["hf/data/"], "out/", split="train", tokenizer="tokenizer.json")
    pack_jsonl("parts/*.jsonl.gz", "out2/", column="text")
    pack_parquet("tok.parquet", "out3/", column="input_ids", token_dtype="auto")
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from ...errors import FormatError
from ..types import Modality
from ..writer import DatasetWriter
from .inputs import InputFile, compression_of, resolve_inputs
from .progress import PackProgress
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["pack_records", "pack_jsonl", "pack_parquet", "AUTO_COLUMNS"]

log = logging.getLogger(__name__)

AUTO_COLUMNS = ("input_ids", "token_ids", "tokens", "ids", "text", "content")
Inputs = str | os.PathLike | Sequence[str | os.PathLike]


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
    """One input file as a stream of single-column Arrow batches, each with the file bytes read so far."""

    def __init__(self, file: InputFile, column: str | None, batch_rows: int) -> None:
        self.path, self.format, self.size, self.batch_rows = file.path, file.format, file.size, batch_rows
        self.metadata: pq.FileMetaData | None = None  # Parquet: the footer, kept; the file is not (many shards)
        try:
            if self.format == "parquet":
                with self._open_parquet() as pf:
                    schema, self.metadata = pf.schema_arrow, pf.metadata
            else:
                with self._open_json(pj.ParseOptions(), 1 << 20) as (reader, _):
                    schema = reader.schema
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"cannot read {self.format} input: {str(e)[:300]}", path=self.path) from None
        self.column = _choose_column(schema.names, column, self.path)
        self.type = schema.field(self.column).type
        self.kind = _kind_of(self.type, self.column, self.path)

    @contextlib.contextmanager
    def _open_parquet(self) -> Iterator[pq.ParquetFile]:
        pf = pq.ParquetFile(self.path, metadata=self.metadata)
        try:
            yield pf
        finally:
            pf.close()

    @contextlib.contextmanager
    def _open_json(self, parse: pj.ParseOptions, block_size: int) -> Iterator[tuple[Any, pa.NativeFile]]:
        """The JSON reader and the raw file under it (whose position is the progress through the file)."""
        with pa.OSFile(self.path) as raw:
            codec = compression_of(self.path)
            with (pa.CompressedInputStream(raw, codec) if codec else contextlib.nullcontext(raw)) as stream, \
                    pj.open_json(stream, read_options=pj.ReadOptions(block_size=block_size),
                                 parse_options=parse) as reader:
                yield reader, raw

    def _json_blocks(self, block_size: int) -> Iterator[tuple[pa.Array, int]]:
        """Whole lines, about ``block_size`` bytes at a time, each parsed by one ``read_json`` call.

        Not ``open_json``: its reader reads ahead (a file of a few blocks is read whole before the first batch),
        so its position says nothing of the work done. Here a block is read only when the previous one has been
        packed, so the position counts what is tokenized and written.
        """
        read = pj.ReadOptions(block_size=block_size + 1)  # one parse per block (whole lines, < 2 blocks)
        parse = pj.ParseOptions(explicit_schema=pa.schema([(self.column, self.type)]),
                                unexpected_field_behavior="ignore")
        with pa.OSFile(self.path) as raw:
            codec = compression_of(self.path)
            with (pa.CompressedInputStream(raw, codec) if codec else contextlib.nullcontext(raw)) as stream:
                tail = b""
                while True:
                    buf = stream.read(block_size)
                    data = tail + buf if tail else buf
                    cut = len(data) if not buf else data.rfind(b"\n") + 1
                    tail, lines = data[cut:], data[:cut]
                    if lines.strip():
                        read.block_size = max(read.block_size, len(lines) + 1)
                        table = pj.read_json(pa.BufferReader(lines), read_options=read, parse_options=parse)
                        yield table.column(0).combine_chunks(), min(raw.tell(), self.size)
                    if not buf:
                        return

    def batches(self) -> Iterator[tuple[pa.Array, int]]:
        """``(column values, bytes of the file consumed so far)`` per batch; the last reports the whole file."""
        try:
            if self.format == "parquet":
                rows, total = 0, max(self.metadata.num_rows, 1)
                with self._open_parquet() as pf:
                    for b in pf.iter_batches(batch_size=self.batch_rows, columns=[self.column]):
                        rows += b.num_rows
                        yield b.column(0), self.size * rows // total
            else:
                yield from self._json_blocks(8 << 20)
        except (pa.ArrowException, OSError) as e:
            raise FormatError(f"cannot parse column {self.column!r}: {str(e)[:300]}", path=self.path) from None
        yield pa.nulls(0, self.type), self.size

    def max_id_from_statistics(self) -> int | None:
        """The largest token id by the Parquet footer's statistics, or None when a row group lacks them."""
        md = self.metadata
        if md is None:
            return None
        leaf = next((j for j in range(md.num_columns)
                     if md.schema.column(j).path.startswith(self.column + ".")), None)
        if leaf is None:
            return None
        hi = 0
        for i in range(md.num_row_groups):
            col = md.row_group(i).column(leaf)
            st = col.statistics
            if col.num_values and (st is None or not st.has_min_max):
                return None
            if st is not None and st.has_min_max:
                if st.min < 0:
                    raise FormatError(f"negative token id {st.min} in column {self.column!r}", path=self.path)
                hi = max(hi, int(st.max))
        return hi


def _token_batch(arr: pa.Array, dtype: np.dtype, path: str, what: str = "token ids") -> tuple[np.ndarray, np.ndarray]:
    values = arr.flatten()
    if values.null_count:
        raise FormatError("null token id inside a list", path=path)
    flat = values.to_numpy(zero_copy_only=False)
    if flat.size:
        lo, hi = int(flat.min()), int(flat.max())
        info = np.iinfo(dtype)
        if lo < info.min or hi > info.max:
            raise FormatError(f"{what} span [{lo}, {hi}], outside {dtype.name}", path=path)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    return flat.astype(dtype, copy=False), lengths


def _text_batch(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    arr = arr.cast(pa.large_string())
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return data[offsets[0] : offsets[-1]], np.diff(offsets)


def _scan_max_id(src: _Source, bar: PackProgress) -> int:
    hi, counted = 0, 0
    for arr, done in src.batches():
        lo_hi = pc.min_max(arr.flatten()).as_py()  # one pass; {"min": None, ...} when empty
        if lo_hi["min"] is not None:
            if lo_hi["min"] < 0:
                raise FormatError(f"negative token id {lo_hi['min']} in column {src.column!r}", path=src.path)
            hi = max(hi, lo_hi["max"])
        bar.advance(done - counted)
        counted = done
    return hi


def _check_agree(sources: list[_Source]) -> None:
    first = sources[0]
    for s in sources[1:]:
        if s.column != first.column or s.kind != first.kind:
            raise FormatError(f"this file's column is {s.column!r} ({s.kind}) but {first.path} has {first.column!r} "
                              f"({first.kind}); all inputs of one dataset need the same one (pass column=/--column)",
                              path=s.path)


def _vocab_dtype(tokenizer: Tokenizer) -> np.dtype:
    # Ids run 0..vocab_size-1: uint16 holds them all up to 65536 entries. Unknown vocabulary: uint32, always safe.
    vocab = getattr(tokenizer, "vocab_size", None)
    return np.dtype(np.uint16 if isinstance(vocab, int) and vocab <= 1 << 16 else np.uint32)


def pack_records(inputs: Inputs, out: str | os.PathLike, *, kind: str = "auto", split: str | None = None,
                 column: str | None = None, token_dtype: str | None = "auto",
                 tokenizer: Tokenizer | str | os.PathLike | None = None, align: int = 0, shard_bytes: int = 1 << 30,
                 overwrite: bool = False, progress: bool = True, batch_rows: int = 65536) -> str:
    """Pack JSONL/Parquet files, globs and folders into one dataset at ``out``; returns its path.

    ``kind`` ("auto", "jsonl", "parquet") and ``split`` choose the files (see :func:`resolve_inputs`); the other
    options are those of the module doc. Everything is opened and checked before anything is written.
    """
    files = resolve_inputs(inputs, kind, split)
    sources = [_Source(f, column, batch_rows) for f in files]
    _check_agree(sources)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    mode = "tokens" if sources[0].kind == "tokens" or tok is not None else "text"
    find_max = mode == "tokens" and tok is None and token_dtype in (None, "auto")
    max_by_stats = [s.max_id_from_statistics() for s in sources] if find_max else []
    to_scan = [s for s, hi in zip(sources, max_by_stats) if hi is None]
    total = sum(f.size for f in files) + sum(s.size for s in to_scan)
    desc = f"pack {os.path.basename(files[0].path)}" if len(files) == 1 else f"pack {len(files)} files"
    paths = [os.path.abspath(f.path) for f in files]
    extra: dict[str, Any] = {
        "source": paths[0] if len(paths) == 1 else os.path.commonpath(paths), "sources": paths,
        "source_format": "+".join(sorted({f.format for f in files})), "column": sources[0].column,
        "content": mode if tok is None else "tokenized text"}
    if isinstance(tokenizer, (str, os.PathLike)):
        extra["tokenizer"] = os.path.abspath(tokenizer) if os.path.exists(tokenizer) else os.fspath(tokenizer)
    with PackProgress(total, desc, progress) as bar:
        dtype = None
        if find_max:  # the scans count in the bar: it stays one bar with one total
            hi = max([h for h in max_by_stats if h is not None] + [_scan_max_id(s, bar) for s in to_scan])
            dtype = np.dtype(np.uint16 if hi < 1 << 16 else np.uint32)
        elif mode == "tokens":
            dtype = _vocab_dtype(tok) if token_dtype in (None, "auto") else np.dtype(token_dtype)
        skipped = 0
        with DatasetWriter(out, align=align, shard_bytes=shard_bytes, token_dtype=dtype, overwrite=overwrite,
                           extra=extra) as w:
            for src in sources:
                counted = 0
                for arr, done in src.batches():
                    if arr.null_count:
                        skipped += arr.null_count
                        arr = arr.filter(arr.is_valid())
                    if len(arr):
                        _write_batch(w, arr, src, mode, dtype, tok)
                    bar.advance(done - counted)
                    counted = done
            w.extra["skipped_null_rows"] = skipped
    if mode == "text":  # after the pack, so the line is not lost above the bar (and a failed pack has one line)
        log.warning("column %r is stored as raw text, not token ids: token plans (seq_len) need them; pack with "
                    "--tokenizer tokenizer.json (tokenizer= in Python) to tokenize", sources[0].column)
    return os.path.abspath(os.fspath(out))


def _write_batch(w: DatasetWriter, arr: pa.Array, src: _Source, mode: str, dtype: np.dtype | None,
                 tok: Tokenizer | None) -> None:
    if mode == "text":
        data, lengths = _text_batch(arr)
        w.add_many(data, lengths, modality=Modality.TEXT)
        return
    if tok is not None:  # one tokenizer call per batch; Arrow flattens the id lists in C++
        ids = tok(arr.to_pylist())
        if len(ids) != len(arr):
            raise FormatError(f"the tokenizer returned {len(ids)} id lists for {len(arr)} texts", path=src.path)
        arr = ids if isinstance(ids, (pa.ListArray, pa.LargeListArray)) else pa.array(ids, pa.list_(pa.int64()))
        data, lengths = _token_batch(arr, dtype, src.path, what="tokenizer ids")
    else:
        data, lengths = _token_batch(arr, dtype, src.path)
    w.add_many(data, lengths, modality=Modality.TOKENS)


def pack_jsonl(path: Inputs, out: str | os.PathLike, *, column: str | None = None,
               token_dtype: str | None = "auto", tokenizer: Tokenizer | str | os.PathLike | None = None,
               align: int = 0, shard_bytes: int = 1 << 30, overwrite: bool = False, progress: bool = True,
               batch_rows: int = 65536, split: str | None = None) -> str:
    """Pack JSONL files (one object per line; ``.jsonl.gz`` too), globs or folders into ``out``; returns its path."""
    return pack_records(path, out, kind="jsonl", split=split, column=column, token_dtype=token_dtype,
                        tokenizer=tokenizer, align=align, shard_bytes=shard_bytes, overwrite=overwrite,
                        progress=progress, batch_rows=batch_rows)


def pack_parquet(path: Inputs, out: str | os.PathLike, *, column: str | None = None,
                 token_dtype: str | None = "auto", tokenizer: Tokenizer | str | os.PathLike | None = None,
                 align: int = 0, shard_bytes: int = 1 << 30, overwrite: bool = False, progress: bool = True,
                 batch_rows: int = 65536, split: str | None = None) -> str:
    """Pack Parquet files, globs or folders (a Hugging Face dataset) into ``out``; returns its path."""
    return pack_records(path, out, kind="parquet", split=split, column=column, token_dtype=token_dtype,
                        tokenizer=tokenizer, align=align, shard_bytes=shard_bytes, overwrite=overwrite,
                        progress=progress, batch_rows=batch_rows)
