"""``foresight pack [KIND] INPUT... OUT [options]``: pack data into foresight shards.

KIND is one of auto (the default: JSONL/Parquet files by suffix), jsonl, parquet, media, webdataset, megatron.
jsonl/parquet/auto take several files, globs and folders as one dataset (auto: by suffix, so .jsonl, .jsonl.gz and
.parquet mix), in sorted order within each argument. A text column packed without --tokenizer is stored as raw text
(a warning says so); token plans (``foresight plan --seq-len``) need token ids.

Example::

    foresight pack data.jsonl out/ --tokenizer tokenizer.json
    foresight pack jsonl data.jsonl out/ --column text
    foresight pack parquet hf_dataset/ out/ --split train --tokenizer tokenizer.json
    foresight pack auto 'parts/*.jsonl.gz' extra.parquet out/ --tokenizer my_tok:encode
    foresight pack parquet tok.parquet out/ --column input_ids --token-dtype auto
    foresight pack media photos/ out/ --captions captions.csv
    foresight pack webdataset 'shards-{000000..000009}.tar' media/
    foresight pack megatron data/wiki_text_document out/ --align 4096
    foresight pack data.jsonl s3://data/wiki --tokenizer tokenizer.json    # foresight.bucket.pack_cli: uploaded
"""
from __future__ import annotations

import argparse
import os
import re

from . import pack_media, pack_megatron, pack_records, pack_webdataset
from .reader import open_dataset

__all__ = ["add_arguments", "run", "parse_size", "split_kind", "KINDS"]

KINDS = ("auto", "jsonl", "parquet", "media", "webdataset", "megatron")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4096', '64K', '512M', '1G', '1GiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4096, 64K, 512M, 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("pack data into foresight shards: JSONL/Parquet files (auto, the default kind), a media "
                          "folder, WebDataset tar shards or a Megatron-LM prefix")
    parser.usage = "foresight pack [KIND] INPUT [INPUT ...] OUT [options]"
    parser.add_argument("inputs", nargs="+", metavar="[KIND] INPUT",
                        help=f"KIND: one of {', '.join(KINDS)} (default: auto, JSONL/Parquet files by suffix); "
                             "INPUT for jsonl/parquet/auto: files, globs (quoted) and folders, packed as one dataset; "
                             "media: one folder; webdataset: tar shards, globs and brace patterns "
                             "('shards-{000000..000009}.tar'); megatron: one prefix (path without .idx/.bin)")
    parser.add_argument("out", help="dataset directory to create, or s3://bucket/prefix (packed in a staging "
                                    "directory, then uploaded, manifest.json last)")
    parser.add_argument("--column", default=None, help="jsonl/parquet: text or token-id column (default: auto)")
    parser.add_argument("--split", default=None,
                        help="jsonl/parquet: take this split's files from folders and globs (train-00000-of-..., "
                             "train/); needed when a folder holds several")
    parser.add_argument("--tokenizer", default=None, metavar="TOKENIZER",
                        help="jsonl/parquet text: tokenize into token ids with a tokenizer.json (or a folder holding "
                             "one) through the tokenizers library, or a module:function taking list[str] and "
                             "returning list[list[int]]")
    parser.add_argument("--batch-rows", type=int, default=65536, help="jsonl/parquet: rows per batch")
    parser.add_argument("--token-dtype", default="auto", choices=["auto", "uint16", "uint32", "int32", "int64"],
                        help="jsonl/parquet token ids: stored dtype (auto: uint16 if every id < 65536, "
                             "with --tokenizer if its vocabulary has at most 65536 entries)")
    parser.add_argument("--captions", default=None, help="media: captions JSONL or CSV (file -> caption)")
    parser.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                        help="media/webdataset: what to do with files the probe rejects (webdataset: and keys with no "
                             "media member or several)")
    parser.add_argument("--no-probe", action="store_true", help="media/webdataset: store basic meta only")
    parser.add_argument("--align", type=parse_size, default=None,
                        help="sample start alignment in bytes (default 4096 for media and webdataset, 0 for "
                             "token/text data)")
    parser.add_argument("--shard-bytes", type=parse_size, default=1 << 30, help="shard size (default 1G)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def split_kind(inputs: list[str]) -> tuple[str, list[str]]:
    """``[KIND] INPUT...`` -> (kind, inputs): the first word is a kind unless a file of that name exists here.

    >>> split_kind(["text.jsonl"])
    ('auto', ['text.jsonl'])
    >>> split_kind(["media", "photos/"])
    ('media', ['photos/'])
    """
    if len(inputs) > 1 and inputs[0] in KINDS and not os.path.exists(inputs[0]):
        return inputs[0], inputs[1:]
    return "auto", list(inputs)


def run(args: argparse.Namespace, *, shown_as: str | None = None) -> int:
    """Pack as ``args`` say into ``args.out``; ``shown_as`` is where the report says it went (a bucket URL, when
    :mod:`foresight.bucket.pack_cli` packs into a staging directory before uploading)."""
    args.kind, args.inputs = split_kind(args.inputs)
    # Errors (bad input, a full disk, an existing OUT) are reported by foresight.cli as one line naming the path.
    common = dict(shard_bytes=args.shard_bytes, overwrite=args.overwrite, progress=not args.no_progress)
    align = args.align if args.align is not None else (4096 if args.kind in ("media", "webdataset") else 0)
    if args.kind == "webdataset":
        out = pack_webdataset(args.inputs, args.out, probe=not args.no_probe, on_error=args.on_error, align=align,
                              **common)
    elif args.kind in ("auto", "jsonl", "parquet"):
        out = pack_records(args.inputs, args.out, kind=args.kind, split=args.split, column=args.column,
                           token_dtype=args.token_dtype, tokenizer=args.tokenizer, batch_rows=args.batch_rows,
                           align=align, **common)
    elif len(args.inputs) != 1:
        raise ValueError(f"pack {args.kind} takes one INPUT ({'a folder' if args.kind == 'media' else 'a prefix'}), "
                         f"got {len(args.inputs)}: {' '.join(args.inputs)}")
    elif args.kind == "media":
        out = pack_media(args.inputs[0], args.out, captions=args.captions, probe=not args.no_probe,
                         on_error=args.on_error, align=align, **common)
    else:
        out = pack_megatron(args.inputs[0], args.out, align=align, **common)
    ds = open_dataset(out)
    total = int(ds.sample_bytes().sum())
    sources = ds.manifest.extra.get("sources", [])
    origin = f" from {len(sources)} files" if len(sources) > 1 else ""
    print(f"packed {ds.num_samples} samples{origin} ({total} payload bytes) into {len(ds.shard_paths)} shard(s) "
          f"at {shown_as or out}; "
          f"modalities={','.join(ds.modalities) or '-'} token_dtype={ds.token_dtype} align={ds.align} "
          f"fingerprint={ds.fingerprint}")
    return 0
