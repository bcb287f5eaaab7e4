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
import difflib
import importlib
import os
import signal
import sys
import threading

from foresight.errors import ForesightError

USER_ERRORS = (ForesightError, OSError, ValueError)
#: The extra of ``pip install 'foresight[EXTRA]'`` that brings each optional module a command may import.
EXTRA_OF = {"torch": "torch", "av": "media", "PIL": "media", "safetensors": "checkpoint", "tokenizers": "text",
            "etcd3gw": "node", "prometheus_client": "node", "obstore": "bucket"}

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pack": ("foresight.bucket.pack_cli",
             "pack JSONL/Parquet, a media folder, WebDataset tars or a Megatron dataset into shards"),
    "plan": ("foresight.plan.cli", "build a deterministic per-step sample plan"),
    "inspect": ("foresight.plan.inspect_cli", "print a dataset's manifest, a plan's summary, or step k"),
    "ckpt": ("foresight.replication.cli", "checkpoint tools: merge a distributed checkpoint to safetensors"),
    "node": ("foresight.node.cli", "run a storage node (serve), print node status, place shards on nodes"),
    "demo": ("foresight.demo", "pack, serve, train, checkpoint, resume, read a bucket, replicate; print the figures"),
}


INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C
CLOSED_PIPE = 141  # 128 + SIGPIPE: what `yes | head -1` reports for yes
DESCRIPTION = """foresight: plan-driven data loading and checkpoints for training jobs.

Typical use:
  foresight pack data.jsonl shards/ --tokenizer tokenizer.json
  foresight plan shards/ --global-batch-size 64 --seq-len 2048 --steps 1000 --out plan/
  foresight inspect plan/ --step 0
Then, in the training script: Loader("plan/")."""
EPILOG = "foresight COMMAND --help lists a command's options. FORESIGHT_DEBUG=1 prints the traceback of an error."


def _interrupt(signum: int, frame: object) -> None:
    """The first SIGINT raises KeyboardInterrupt where the command is; later ones are ignored (clean-up runs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _interrupt) if in_main_thread else None
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else ""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"foresight{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except ModuleNotFoundError as e:  # building the command's parser or running it: name the extra to install
        if os.environ.get("FORESIGHT_DEBUG", "") not in ("", "0") or not e.name:
            raise
        print(f"foresight {command or 'command'}: error: {missing_module(e.name)}", file=sys.stderr)
        return 1
    finally:
        if in_main_thread:  # main() called from Python (tests, scripts) leaves their handler as it was
            signal.signal(signal.SIGINT, previous)


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help already says it (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or "%(default)" in text
                or action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or action.default in ("", [])):
            return text
        return text + " (default: %(default)s)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``foresight`` parser; only ``command``'s options are added (the other modules may need heavy libraries).

    >>> build_parser("plan").parse_args(["plan", "data/", "--out", "p", "--global-batch-size", "8",
    ...                                  "--steps", "10"]).seed is None
    True
    """
    parser = argparse.ArgumentParser(prog="foresight", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter,
                           allow_abbrev=False)
        if name == command:
            importlib.import_module(module).add_arguments(p)
            for nested in _nested(p):  # the command's own subcommands (node serve, ckpt merge) alike
                nested.formatter_class, nested.allow_abbrev = HelpFormatter, False
    return parser


def _nested(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser`` (subcommands of subcommands)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                out += [p, *_nested(p)]
    return out


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The deepest (sub)command parser that ``argv`` names: its usage and options are the ones that matter."""
    for word in argv:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            if word.startswith("-"):
                continue
            break
        parser = actions[0].choices[word]
    return parser


def _suggest(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """'unrecognized arguments: --seq_len (did you mean --seq-len?)'."""
    options = [o for a in parser._actions for o in a.option_strings]
    said = []
    for word in unknown:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag.replace("_", "-"), options, n=1, cutoff=0.6) if flag[:1] == "-" else []
        said.append(f"{word} (did you mean {close[0]}?)" if close else word)
    return "unrecognized arguments: " + " ".join(said)


def _main(argv: list[str]) -> int:
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(command)
    # An unknown --option first (before "required" errors), with the subcommand's usage and a suggestion.
    sub = _subparser(parser, argv)
    known = {o for a in sub._actions for o in a.option_strings}
    words = argv[: argv.index("--")] if "--" in argv else argv
    unknown = [w for w in words if w.startswith("--") and w.split("=", 1)[0] not in known]
    if unknown:
        sub.error(_suggest(sub, unknown))
    args = parser.parse_args(argv)
    from foresight.loader.logs import ensure_default_logging  # lazy: --help stays free of numpy

    ensure_default_logging()  # foresight's warnings as one concise line each (e.g. a pack of untokenized text)
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except BrokenPipeError:  # `foresight inspect plan/ | head -1`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit must not fail again
        return CLOSED_PIPE
    except USER_ERRORS as e:
        if os.environ.get("FORESIGHT_DEBUG", "") not in ("", "0"):
            raise
        print(f"foresight {args.command}: error: {describe_error(e)}", file=sys.stderr)
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
