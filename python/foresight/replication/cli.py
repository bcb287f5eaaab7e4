"""``foresight ckpt merge``: a distributed checkpoint -> one safetensors file per module group.

The source is a checkpoint directory, or a checkpoint name (``job/step-00001000``) resolved through etcd to
the nearest complete replica (``--etcd``, ``--site``: this site's replica first, then the training site's
copy read over the network); the replica is held (an etcd reader lease) until the merge is done.

Example::

    foresight ckpt merge /ckpt/dcp-step-1000 /eval/merged --group vision.=vision --group text.=text --reshard 4
    foresight ckpt merge job/step-00001000 /eval/merged --etcd http://10.0.0.5:2379 --site eval-b
"""
from __future__ import annotations

import argparse
import json
import os
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    m = sub.add_parser("merge", help="merge a distributed checkpoint into safetensors per module group")
    m.add_argument("source", help="checkpoint directory, or a checkpoint name resolved through etcd")
    m.add_argument("out", help="output directory")
    m.add_argument("--group", action="append", default=[], metavar="PREFIX=NAME",
                   help="tensors whose name starts with PREFIX go to NAME.safetensors (repeatable)")
    m.add_argument("--depth", type=int, default=1, help="without --group: group by the first DEPTH name parts")
    m.add_argument("--reshard", type=int, default=None, help="also cut each group for this evaluation world size")
    m.add_argument("--etcd", default=None, help="etcd endpoint (http://host:port) to resolve a checkpoint name")
    m.add_argument("--site", default=None, help="this site's name (with --etcd)")
    m.add_argument("--token", default="", help="job token for remote reads")


def run(args: argparse.Namespace) -> int:
    from foresight.replication.merge import merge_checkpoint  # lazy: torch, safetensors (ckpt --help must not)
    from foresight.replication.source import LocalSource  # lazy: ckpt --help stays fast

    groups = {}
    for g in args.group:
        prefix, sep, name = g.partition("=")
        if not sep or not name:
            raise SystemExit(f"--group wants PREFIX=NAME, got {g!r}")
        groups[prefix] = name
    t0 = time.perf_counter()
    if os.path.isdir(args.source):
        written = merge_checkpoint(LocalSource(args.source), args.out, groups=groups or None, depth=args.depth,
                                   reshard=args.reshard)
        where = args.source
    else:
        if not (args.etcd and args.site):
            raise SystemExit(f"{args.source!r} is not a directory; pass --etcd and --site to resolve it by name")
        from foresight.replication.resolver import Resolver  # lazy: ckpt --help stays fast

        with Resolver(args.etcd, site=args.site) as res, res.open(args.source, token=args.token) as (loc, src):
            written = merge_checkpoint(src, args.out, groups=groups or None, depth=args.depth, reshard=args.reshard)
            where = f"{loc.site}:{loc.path}"
    print(json.dumps({"source": where, "seconds": round(time.perf_counter() - t0, 3), "written": written}))
    return 0
