"""``foresight`` command line: one dispatcher, each subcommand owned by its layer's module.

Each module named in :data:`SUBCOMMANDS` provides ``add_arguments(parser)`` and ``run(args) -> int``. User errors
(:class:`~foresight.errors.ForesightError`, ``OSError``, ``ValueError``) raised by ``run`` are reported here, once for
every command: one line on stderr naming the path, exit status 1. ``FORESIGHT_DEBUG=1`` shows the traceback instead.

Example::

    foresight pack jsonl data.jsonl out/ --column text
    foresight plan out/ --global-batch-size 64 --seq-len 2048 --steps 1000 --out plan/
    foresight inspect plan/ --step 0
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from foresight.errors import ForesightError

USER_ERRORS = (ForesightError, OSError, ValueError)
#: The extra of ``pip install 'foresight[EXTRA]'`` that brings each optional module a command may import.
EXTRA_OF = {"torch": "torch", "av": "media", "PIL": "media", "safetensors": "checkpoint", "tokenizers": "text",
            "etcd3gw": "node", "prometheus_client": "node"}

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pack": ("foresight.format.cli", "pack JSONL/Parquet, a media folder or a Megatron dataset into shards"),
    "plan": ("foresight.plan.cli", "build a deterministic per-step sample plan"),
    "inspect": ("foresight.plan.inspect_cli", "print a dataset's manifest, a plan's summary, or step k"),
    "ckpt": ("foresight.checkpoint.replicate.cli", "checkpoint tools: merge a distributed checkpoint to safetensors"),
    "node": ("foresight.node.cli", "run a storage node (serve), print node status, place shards on nodes"),
    "demo": ("foresight.demo", "pack, serve, train a toy model, checkpoint and resume, print what was measured"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="foresight", description=__doc__.splitlines()[0],
                                     epilog="FORESIGHT_DEBUG=1 prints the traceback of an error.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Import only the module of the command asked for: the others may need heavy libraries.
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    try:
        for name, (module, help_text) in SUBCOMMANDS.items():
            p = sub.add_parser(name, help=help_text)
            if name == wanted:
                importlib.import_module(module).add_arguments(p)
        args = parser.parse_args(argv)
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except USER_ERRORS as e:
        if os.environ.get("FORESIGHT_DEBUG", "") not in ("", "0"):
            raise
        print(f"foresight {wanted or 'command'}: error: {describe_error(e)}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        if os.environ.get("FORESIGHT_DEBUG", "") not in ("", "0") or not e.name:
            raise
        print(f"foresight {wanted or 'command'}: error: {missing_module(e.name)}", file=sys.stderr)
        return 1


def missing_module(name: str) -> str:
    """One line for a missing optional module, naming the extra that installs it.

    >>> missing_module("prometheus_client")
    "the Python module 'prometheus_client' is missing; install it with: pip install 'foresight[node]'"
    """
    top = name.split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        shown = name if top == "foresight" else top  # one of ours: its native part was not built, say which
        return f"the Python module {shown!r} is missing (FORESIGHT_DEBUG=1 shows where it was imported)"
    return f"the Python module {top!r} is missing; install it with: pip install 'foresight[{extra}]'"


def describe_error(e: BaseException) -> str:
    """One line for a user error; an OSError leads with its path, as the shell does (``PATH: No space left...``).

    >>> describe_error(FileNotFoundError(2, "No such file or directory", "/data/x"))
    '/data/x: No such file or directory'
    """
    text = str(e)
    if isinstance(e, OSError) and not isinstance(e, ForesightError) and e.filename is not None:
        where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
        text = f"{where}: {e.strerror}"
    return " ".join(text.split("\n")) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
