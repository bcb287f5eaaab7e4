"""The CLI explains itself: every option of every (sub)command has help, the help is plain text, a misspelt option
gets a suggestion, and ``inspect`` is compact, names a missing path and is quiet on a closed pipe."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import cli_env, run_cli
from foresight.cli import SUBCOMMANDS, build_parser
from foresight.plan import ArraySource, build_plan


def commands() -> list[tuple[str, ...]]:
    """Every command path: ("pack",), ("node", "serve"), ..."""
    out = []

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        out.append(path)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + (name,))

    for name in SUBCOMMANDS:
        top = build_parser(name)
        walk(next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name], (name,))
    return out


def parser_of(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(path[0])
    for word in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return parser


@pytest.mark.parametrize("path", [pytest.param(p, id=" ".join(p)) for p in commands()])
def test_every_option_has_help_and_the_help_is_plain_text(path):
    parser = parser_of(path)
    missing = [a.option_strings or a.dest for a in parser._actions
               if not a.help and not isinstance(a, argparse._SubParsersAction)]  # a subcommand's help is its own
    assert not missing, f"foresight {' '.join(path)}: options without help: {missing}"
    res = run_cli(*path, "--help")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "`" not in res.stdout, res.stdout
    for action in parser._actions:  # a default worth saying is said
        if action.option_strings and action.default not in (None, False, "", [], argparse.SUPPRESS) \
                and not isinstance(action, argparse._HelpAction):
            assert "default" in (action.help or "") or \
                f"(default: {action.default}" in " ".join(res.stdout.split()), (action.option_strings, res.stdout)


def test_top_level_help_is_plain_and_lists_every_command():
    res = run_cli("--help")
    assert res.returncode == 0 and "`" not in res.stdout
    assert all(name in res.stdout for name in SUBCOMMANDS)


def test_a_misspelt_option_gets_the_commands_usage_and_a_suggestion():
    res = run_cli("plan", "data/", "--seq_len", "2048")
    assert res.returncode == 2
    assert res.stderr.startswith("usage: foresight plan "), res.stderr
    assert "unrecognized arguments: --seq_len (did you mean --seq-len?)" in res.stderr
    res = run_cli("pack", "a.jsonl", "out", "--tok", "t.json")  # no abbreviations: a prefix is not an option
    assert res.returncode == 2 and "--tok (did you mean --tokenizer?)" in res.stderr, res.stderr


@pytest.fixture
def plan_dir(tmp_path):
    out = tmp_path / "plan"
    build_plan([(ArraySource(np.full(20000, 100), tokens=False), 1)], seed=0, global_batch_size=5000,
               epochs=1).save(str(out))
    return out


def test_inspect_prints_one_line_per_item(plan_dir):
    res = run_cli("inspect", str(plan_dir), "--step", "1", "--no-verify")
    assert res.returncode == 0, res.stderr
    step = json.loads(res.stdout)
    assert len(step["items"]) == 5000 and step["pieces"] == ["dataset", "sample", "offset", "length"]
    lines = res.stdout.splitlines()
    assert len(lines) < 5000 + 10  # one line per item, not one per number
    assert sum(line.strip().startswith('{"item": ') for line in lines) == 5000


def test_inspect_a_missing_path_says_so(tmp_path):
    res = run_cli("inspect", "plann/", cwd=tmp_path)
    assert res.returncode == 1 and res.stderr.strip() == "foresight inspect: error: no such directory: plann/"


def test_inspect_into_a_closed_pipe_exits_quietly(plan_dir):
    inspect = subprocess.Popen([sys.executable, "-m", "foresight", "inspect", str(plan_dir), "--step", "0",
                                "--no-verify"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    first = inspect.stdout.readline()  # `| head -1`: read one line, then close the pipe
    inspect.stdout.close()
    err = inspect.stderr.read()
    assert inspect.wait(timeout=60) == 141  # 128 + SIGPIPE, as `yes | head -1` reports for yes
    assert first.startswith(b"{") and err == b"", err
