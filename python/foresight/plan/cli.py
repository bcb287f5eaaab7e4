"""``foresight plan``: build a deterministic plan over one or more datasets and save it.

Example::

    foresight plan data/web data/code --weights 0.7 0.3 --seed 1 --global-batch-size 64 \\
        --seq-len 2048 --steps 1000 --out plan/
    foresight plan media/ --seed 1 --global-batch-size 32 --epochs 2 --shuffle block \\
        --block-size 256 --out plan/
    FORESIGHT_BUCKET_CACHE=/nvme/cache foresight plan s3://data/wiki --seed 1 --global-batch-size 64 \\
        --seq-len 2048 --steps 1000 --out s3://data/plans/p1
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from foresight.errors import PlanError
from foresight.plan.builder import SHUFFLES

DEFAULT_SEED = 0  # documented in docs/config.md; stored in plan.json's inputs like any seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("datasets", nargs="+",
                        help="dataset directories (or Megatron .idx/.bin prefixes), local or s3://bucket/prefix "
                             "(read through the cache directory FORESIGHT_BUCKET_CACHE)")
    parser.add_argument("--out", required=True,
                        help="plan directory to write (atomically), or s3://bucket/prefix (uploaded, plan.json last)")
    parser.add_argument("--weights", nargs="+", type=float, default=None,
                        help="mixture weights, one per dataset (default: equal)")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"shuffle seed, stored in the plan (default: {DEFAULT_SEED}, printed)")
    parser.add_argument("--global-batch-size", type=int, required=True,
                        help="items per step across all ranks (sequences of --seq-len tokens, or samples)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (token data only; required for it)")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="number of steps")
    length.add_argument("--epochs", type=float, help="passes over the mixture")
    parser.add_argument("--shuffle", choices=SHUFFLES, default="global",
                        help="global: a uniform permutation per epoch; block: runs of --block-size samples stay "
                             "together (fewer, larger reads)")
    parser.add_argument("--block-size", type=int, default=None, help="samples per block (--shuffle block)")
    parser.add_argument("--compact", action="store_true",
                        help="compact plan: steps computed on demand from a few bytes per block (token data; "
                             "--block-size is then documents per block: default 256, fewer under a million "
                             "documents)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing plan directory")


def run(args: argparse.Namespace) -> int:
    from foresight.bucket.opener import open_dataset, resolve_cache_dir  # lazy: pyarrow, numpy (--help stays fast)
    from foresight.bucket.mirror import refuse_existing_at  # lazy: plan --help stays fast
    from foresight.bucket.url import is_bucket_url  # lazy: plan --help stays fast
    from foresight.plan.files import PLAN_JSON  # lazy: plan --help stays fast
    from foresight.format.writer import check_parent_dir  # lazy: plan --help stays fast
    from foresight.plan.builder import build_plan  # lazy: plan --help stays fast

    # Errors are reported by foresight.cli as one line naming the path.
    weights = args.weights or [1.0] * len(args.datasets)
    if len(weights) != len(args.datasets):
        raise PlanError(f"{len(args.datasets)} datasets but {len(weights)} weights")
    if is_bucket_url(args.out):  # before the build, which can take minutes
        resolve_cache_dir(args.out)
        if not args.overwrite:
            refuse_existing_at(args.out, PLAN_JSON, "plan")
    else:
        check_parent_dir(args.out)
    datasets = [open_dataset(p) for p in args.datasets]
    if args.seq_len is not None:
        _check_token_data(datasets)
    if args.seed is None:
        args.seed = DEFAULT_SEED
        print(f"foresight plan: seed {DEFAULT_SEED} (the default; --seed N for another order)", file=sys.stderr)
    t0 = time.perf_counter()
    plan = build_plan(
        list(zip(datasets, weights)), seed=args.seed, global_batch_size=args.global_batch_size,
        seq_len=args.seq_len, num_steps=args.steps, epochs=args.epochs, shuffle=args.shuffle,
        block_size=args.block_size, compact=args.compact,
    )
    built = time.perf_counter() - t0
    plan.save(args.out, overwrite=args.overwrite)
    report = plan.describe()
    report["build_seconds"] = round(built, 3)
    print(json.dumps(report, indent=1))
    return 0


def _check_token_data(datasets: list) -> None:
    """--seq-len over a dataset of raw text: say how to get token ids (the builder only knows they are missing)."""
    for ds in datasets:
        if ds.token_dtype is None:
            extra = getattr(getattr(ds, "manifest", None), "extra", {}) or {}
            what = "raw text" if extra.get("content") == "text" else f"whole samples ({', '.join(ds.modalities)})"
            hint = ("; re-pack with --tokenizer (foresight pack INPUT OUT --tokenizer tokenizer.json)"
                    if extra.get("content") == "text" else "; drop --seq-len to plan whole samples")
            raise PlanError(f"--seq-len needs token data, but this dataset holds {what}{hint}", path=ds.path)
