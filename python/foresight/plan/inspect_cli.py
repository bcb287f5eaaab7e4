"""``foresight inspect``: print a plan's summary or one step, or a dataset's manifest, as JSON.

A step prints one line per item (its pieces as ``[dataset, sample, offset, length]``), so ``| head`` and ``grep``
work on it and the whole stays one JSON document.

Example::

    foresight inspect plan/                     # inputs, summary, digest
    foresight inspect plan/ --step 3            # the global batch of step 3, one item per line
    foresight inspect plan/ --step 3 --rank 1 --world-size 4
    foresight inspect data/                     # the dataset's manifest
    foresight inspect s3://data/plans/p1        # the same for a plan or dataset in a bucket (through the cache
                                                # directory FORESIGHT_BUCKET_CACHE)
"""
from __future__ import annotations

import argparse
import json
import os

from foresight.bucket.url import is_bucket_url
from foresight.errors import FormatError, PlanError
from foresight.plan.files import PLAN_JSON

PIECE_FIELDS = ("dataset", "sample", "offset", "length")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a plan directory, a dataset directory, or a Megatron .idx/.bin prefix; local "
                                     "or s3://bucket/prefix")
    parser.add_argument("--step", type=int, default=None, help="print this step of a plan")
    parser.add_argument("--rank", type=int, default=None, help="with --step: only this rank's items")
    parser.add_argument("--world-size", type=int, default=None, help="with --rank: the number of ranks")
    parser.add_argument("--no-verify", action="store_true", help="skip the plan's digest check (faster)")


def run(args: argparse.Namespace) -> int:
    # Errors are reported by foresight.cli as one line naming the path.
    if is_bucket_url(args.path):
        from foresight.bucket.mirror import holds  # lazy: obstore, numpy (inspect --help stays fast)

        is_plan = holds(args.path, PLAN_JSON)
    elif not os.path.exists(args.path) and not os.path.exists(args.path + ".idx"):
        raise FormatError(f"no such directory: {args.path}")
    else:
        is_plan = os.path.isfile(os.path.join(args.path, PLAN_JSON))
    if is_plan:
        out = _plan(args)
    else:
        if args.step is not None or args.rank is not None:
            raise PlanError("--step/--rank apply to plans only, and this is not a plan directory", path=args.path)
        out = _dataset(args.path)
    print(out)
    return 0


def _plan(args: argparse.Namespace) -> str:
    from foresight.plan.store import load_plan  # lazy: numpy (inspect --help stays fast)

    plan = load_plan(args.path, verify=not args.no_verify)
    if args.step is None:
        if args.rank is not None or args.world_size is not None:
            raise PlanError("--rank/--world-size need --step")
        return json.dumps(plan.describe(), indent=1)
    return step_text(plan.step_dict(args.step, rank=args.rank, world_size=args.world_size))


def step_text(step: dict) -> str:
    """A step as JSON with one line per item, pieces as ``[dataset, sample, offset, length]``.

    >>> print(step_text({"step": 0, "items": [{"item": 0, "pieces": [{"dataset": 0, "sample": 5, "offset": 0,
    ...                                                                "length": 9}]}]}))
    {"step": 0,
     "pieces": ["dataset", "sample", "offset", "length"],
     "items": [
      {"item": 0, "pieces": [[0, 5, 0, 9]]}
    ]}
    """
    head = {k: v for k, v in step.items() if k != "items"}
    lines = [json.dumps({k: v}) [1:-1] for k, v in head.items()]
    lines.append(json.dumps({"pieces": list(PIECE_FIELDS)})[1:-1])
    items = [json.dumps({**{k: v for k, v in item.items() if k != "pieces"},
                         "pieces": [[p[f] for f in PIECE_FIELDS] for p in item["pieces"]]}) for item in step["items"]]
    return "{" + ",\n ".join(lines) + ',\n "items": [\n  ' + ",\n  ".join(items) + "\n]}"


def _dataset(path: str) -> str:
    from foresight.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_manifest  # lazy: --help stays fast

    manifest = os.path.join(path, MANIFEST_NAME)
    if not is_bucket_url(path) and os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        # Only a valid foresight manifest is printed (any other JSON there is refused, naming the file).
        return json.dumps(parse_manifest(raw, path=manifest).to_json(), indent=1)
    from foresight.bucket.opener import open_dataset  # lazy: pyarrow (inspect --help stays fast)

    ds = open_dataset(path)
    if is_bucket_url(path) and ds.kind == "foresight":  # as a local one: its manifest (fetched into the cache)
        return json.dumps(ds.manifest.to_json(), indent=1)
    info = {
        **({"url": path} if is_bucket_url(path) else {}),
        "path": ds.path,
        "kind": ds.kind,
        "num_samples": ds.num_samples,
        "modalities": list(ds.modalities),
        "token_dtype": None if ds.token_dtype is None else str(ds.token_dtype),
        "shard_paths": list(ds.shard_paths),
        "fingerprint": ds.fingerprint,
    }
    return json.dumps(info, indent=1)
