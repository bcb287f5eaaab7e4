"""``foresight`` command line: one dispatcher, each subcommand owned by its layer's module.

Each module named in :data:`SUBCOMMANDS` provides ``add_arguments(parser)`` and ``run(args) -> int``.

Example::

    foresight pack jsonl data.jsonl out/ --column text
    foresight plan out/ --global-batch-size 64 --seq-len 2048 --steps 1000 --out plan/
    foresight inspect plan/ --step 0
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pack": ("foresight.format.cli", "pack JSONL/Parquet, a media folder or a Megatron dataset into shards"),
    "plan": ("foresight.plan.cli", "build a deterministic per-step sample plan"),
    "inspect": ("foresight.plan.inspect_cli", "print a dataset's manifest, a plan's summary, or step k"),
    "ckpt": ("foresight.checkpoint.replicate.cli", "checkpoint tools: merge a distributed checkpoint to safetensors"),
    "demo": ("foresight.demo", "pack, serve, train a toy model, checkpoint and resume, print what was measured"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="foresight", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Import only the module of the command asked for: the others may need heavy libraries.
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
