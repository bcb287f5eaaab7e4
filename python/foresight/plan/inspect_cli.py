"""``foresight inspect``: print a plan's summary or one step, or a dataset's manifest, as JSON.

Example::

    foresight inspect plan/                     # inputs, summary, digest
    foresight inspect plan/ --step 3            # the global batch of step 3, piece by piece
    foresight inspect plan/ --step 3 --rank 1 --world-size 4
    foresight inspect data/                     # the dataset's manifest
"""
from __future__ import annotations

import argparse
import json
import os

from foresight.errors import PlanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a plan directory, a dataset directory, or a Megatron .idx/.bin prefix")
    parser.add_argument("--step", type=int, default=None, help="print this step of a plan")
    parser.add_argument("--rank", type=int, default=None, help="with --step: only this rank's items")
    parser.add_argument("--world-size", type=int, default=None, help="with --rank: the number of ranks")
    parser.add_argument("--no-verify", action="store_true", help="skip the plan's digest check (faster)")


def run(args: argparse.Namespace) -> int:
    # Errors are reported by foresight.cli as one line naming the path.
    if os.path.isfile(os.path.join(args.path, "plan.json")):
        out = _plan(args)
    else:
        if args.step is not None or args.rank is not None:
            raise PlanError("--step/--rank apply to plans only, and this is not a plan directory", path=args.path)
        out = _dataset(args.path)
    print(out)
    return 0


def _plan(args: argparse.Namespace) -> str:
    from foresight.plan.store import load_plan

    plan = load_plan(args.path, verify=not args.no_verify)
    if args.step is None:
        if args.rank is not None or args.world_size is not None:
            raise PlanError("--rank/--world-size need --step")
        return json.dumps(plan.describe(), indent=1)
    return plan.step_json(args.step, rank=args.rank, world_size=args.world_size)


def _dataset(path: str) -> str:
    from foresight.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_manifest

    manifest = os.path.join(path, MANIFEST_NAME)
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        # Only a valid foresight manifest is printed (any other JSON there is refused, naming the file).
        return json.dumps(parse_manifest(raw, path=manifest).to_json(), indent=1)
    from foresight.format import open_dataset

    ds = open_dataset(path)
    info = {
        "path": ds.path,
        "kind": ds.kind,
        "num_samples": ds.num_samples,
        "modalities": list(ds.modalities),
        "token_dtype": None if ds.token_dtype is None else str(ds.token_dtype),
        "shard_paths": list(ds.shard_paths),
        "fingerprint": ds.fingerprint,
    }
    return json.dumps(info, indent=1)
