"""``foresight pack {jsonl,parquet,media,megatron} INPUT OUT [options]``: pack data into foresight shards.

Example::

    foresight pack jsonl data.jsonl out/ --column text
    foresight pack parquet tok.parquet out/ --column input_ids --token-dtype auto
    foresight pack media photos/ out/ --captions captions.csv
    foresight pack megatron data/wiki_text_document out/ --align 4096
"""
from __future__ import annotations

import argparse
import re

__all__ = ["add_arguments", "run", "parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4096', '64K', '512M', '1G', '1GiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4096, 64K, 512M, 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("kind", choices=["jsonl", "parquet", "media", "megatron"], help="input kind")
    parser.add_argument("input", help="input file, media folder, or Megatron prefix (path without .idx/.bin)")
    parser.add_argument("out", help="dataset directory to create")
    parser.add_argument("--column", default=None, help="jsonl/parquet: text or token-id column (default: auto)")
    parser.add_argument("--token-dtype", default="auto", choices=["auto", "uint16", "uint32", "int32", "int64"],
                        help="jsonl/parquet token-id columns: stored dtype (auto: uint16 if every id < 65536)")
    parser.add_argument("--captions", default=None, help="media: captions JSONL or CSV (file -> caption)")
    parser.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                        help="media: what to do with files the probe rejects")
    parser.add_argument("--no-probe", action="store_true", help="media: store basic meta only")
    parser.add_argument("--align", type=parse_size, default=None,
                        help="sample start alignment in bytes (default 4096 for media, 0 for token/text data)")
    parser.add_argument("--shard-bytes", type=parse_size, default=1 << 30, help="shard size (default 1G)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from . import pack_jsonl, pack_media, pack_megatron, pack_parquet
    from .reader import open_dataset

    # Errors (bad input, a full disk, an existing OUT) are reported by foresight.cli as one line naming the path.
    common = dict(shard_bytes=args.shard_bytes, overwrite=args.overwrite, progress=not args.no_progress)
    align = args.align if args.align is not None else (4096 if args.kind == "media" else 0)
    if args.kind in ("jsonl", "parquet"):
        fn = pack_jsonl if args.kind == "jsonl" else pack_parquet
        out = fn(args.input, args.out, column=args.column, token_dtype=args.token_dtype, align=align, **common)
    elif args.kind == "media":
        out = pack_media(args.input, args.out, captions=args.captions, probe=not args.no_probe,
                         on_error=args.on_error, align=align, **common)
    else:
        out = pack_megatron(args.input, args.out, align=align, **common)
    ds = open_dataset(out)
    total = int(ds.sample_bytes().sum())
    print(f"packed {ds.num_samples} samples ({total} payload bytes) into {len(ds.shard_paths)} shard(s) at {out}; "
          f"modalities={','.join(ds.modalities) or '-'} token_dtype={ds.token_dtype} align={ds.align} "
          f"fingerprint={ds.fingerprint}")
    return 0
