"""``foresight`` command line: one dispatcher, each subcommand owned by its layer's module.

Each module named in :data:`SUBCOMMANDS` provides ``add_arguments(parser)`` and ``run(args) -> int``. User errors
(:class:`~foresight.errors.ForesightError`, ``OSError``, ``ValueError``) raised by ``run`` are reported here, once for
every command: one line on stderr naming the path, exit status 1. ``FORESIGHT_DEBUG=1`` shows the traceback instead.
Ctrl-C is one line too (``foresight pack: interrupted``), exit status 130 as a shell reports a SIGINT; what the
command was writing is removed on the way out (a pack or a plan is written to a temporary name and renamed into
place only when complete), and a second Ctrl-C during that clean-up is ignored so it cannot be cut short.

Example::

    foresight pack jsonl data.jsonl out/ --column text
    foresight plan out/ --global-batch-size 64 --seq-len 2048 --steps 1000 --out plan/
    foresight inspect plan/ --step 0
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from foresight.errors import ForesightError

USER_ERRORS = (ForesightError, OSError, ValueError)

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pack": ("foresight.format.cli", "pack JSONL/Parquet, a media folder or a Megatron dataset into shards"),
    "plan": ("foresight.plan.cli", "build a deterministic per-step sample plan"),
    "inspect": ("foresight.plan.inspect_cli", "print a dataset's manifest, a plan's summary, or step k"),
    "ckpt": ("foresight.checkpoint.replicate.cli", "checkpoint tools: merge a distributed checkpoint to safetensors"),
    "node": ("foresight.node.cli", "run a storage node (serve), print node status, place shards on nodes"),
    "demo": ("foresight.demo", "pack, serve, train a toy model, checkpoint and resume, print what was measured"),
}


INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C


def _interrupt(signum: int, frame: object) -> None:
    """The first SIGINT raises KeyboardInterrupt where the command is; later ones are ignored (clean-up runs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _interrupt) if in_main_thread else None
    try:
        return _main(argv)
    except KeyboardInterrupt:
        command = argv[0] if argv and argv[0] in SUBCOMMANDS else ""
        print(f"foresight{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:
        if in_main_thread:  # main() called from Python (tests, scripts) leaves their handler as it was
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="foresight", description=__doc__.splitlines()[0],
                                     epilog="FORESIGHT_DEBUG=1 prints the traceback of an error.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Import only the module of the command asked for: the others may need heavy libraries.
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    from foresight.loader.logs import ensure_default_logging  # here: --help stays free of numpy

    ensure_default_logging()  # foresight's warnings as one concise line each (e.g. a pack of untokenized text)
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except USER_ERRORS as e:
        if os.environ.get("FORESIGHT_DEBUG", "") not in ("", "0"):
            raise
        print(f"foresight {args.command}: error: {describe_error(e)}", file=sys.stderr)
        return 1


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
