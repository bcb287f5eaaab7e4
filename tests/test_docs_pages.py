"""The guide pages (docs/loader.md, docs/node.md, docs/benchmarks.md) stay copy-pasteable and true.

* Each ``python`` block of loader.md and of node.md, concatenated in page order, is one script that runs in an
  empty directory (node.md starts and stops its own ``foresight node serve`` processes). Blocks that need etcd,
  GPUs or several hosts are ``bash`` or ``text`` blocks and are not run, but: every ``foresight ...`` command in a
  ``bash`` block must parse with the real CLI parsers, and every ``from foresight... import`` in a ``text`` block
  must import.
* Every ``python bench/<name>.py ...`` command of benchmarks.md (``bash`` blocks and inline code) parses with that
  bench's own argument parser; each page must show at least one command of its kind.
* Every ``bench/<name>.py`` the benchmarks page names exists, and every bench ``bench/run_all.py`` runs is named.
* Every relative link of the three pages resolves (file, and heading anchor in a Markdown target).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from bench_presets import load_bench, load_run_all
from process_diagnostics import kill_and_reap

from foresight.testing.tether import start_tethered

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = ("loader.md", "node.md", "benchmarks.md")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"))
RUN_TIMEOUT_S = 420  # a bound for a hung page, not a timing assertion


def _blocks(page: str, lang: str) -> list[str]:
    text = (DOCS / page).read_text()
    return [body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M) if tag == lang]


def _run_script(script: str, cwd: Path) -> tuple[int, str]:
    """Run ``script`` in a session of its own, so the nodes it starts die with it if it fails or hangs. Output goes
    to a file, not a pipe: a node left running would hold a pipe open after the script itself has exited."""
    (cwd / "page.py").write_text(script)
    with open(cwd / "page.out", "w") as out:
        proc = start_tethered([sys.executable, "page.py"], cwd=cwd, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = -1
    finally:
        kill_and_reap(proc, "the page's script", group=True)  # if it hung; a node it started and never stopped
    text = (cwd / "page.out").read_text()
    return rc, text if rc != -1 else f"still running after {RUN_TIMEOUT_S} s\n{text}"


@pytest.mark.parametrize("page", ["loader.md", "node.md"])
def test_python_blocks_run_as_written(page, tmp_path):
    blocks = _blocks(page, "python")
    assert len(blocks) >= 4, f"{page} lost its python blocks"
    rc, out = _run_script("\n\n".join(blocks), tmp_path)
    assert rc == 0, f"the python blocks of docs/{page} failed (exit {rc}):\n{out[-6000:]}"


def _cli_parser() -> argparse.ArgumentParser:
    from foresight.cli import SUBCOMMANDS

    parser = argparse.ArgumentParser(prog="foresight", exit_on_error=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, _) in SUBCOMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name))
    return parser


# The commands each page must show: the CLI's on the guides, the benches' on the benchmarks page.
PAGE_PROGRAM = {"loader.md": "foresight", "node.md": "foresight", "benchmarks.md": "python bench/"}


def _runs_program(line: str, page: str) -> bool:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # prose in backticks with an odd quote: not a command
        return False
    if PAGE_PROGRAM[page] == "foresight":
        return words[:1] == ["foresight"]
    return len(words) >= 2 and words[0] == "python" and words[1].startswith("bench/")


def _commands(page: str) -> list[str]:
    """Lines of the page's ``bash`` blocks running its program; on the benchmarks page also inline code spans
    (the table of benches names each bench's command in one)."""
    lines = [line for block in _blocks(page, "bash") for line in block.replace("\\\n", " ").splitlines()]
    if PAGE_PROGRAM[page] != "foresight":
        outside_blocks = re.sub(r"^```.*?^```", "", (DOCS / page).read_text(), flags=re.S | re.M)
        lines += re.findall(r"`([^`\n]+)`", outside_blocks)
    return [line for line in lines if _runs_program(line, page)]


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once a bench's own parser accepted the arguments (nothing runs)."""


def _bench_parse_error(line: str, monkeypatch) -> str | None:
    """Parse ``python bench/<name>.py ARGS`` with the bench's own argparse parser (built in its ``main``, which
    stops right after parsing); the parser's message if it refuses them."""
    words = shlex.split(line, comments=True)
    script = ROOT / words[1]
    if not script.exists():
        return f"{words[1]} does not exist"
    module = load_bench(script.stem)
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [words[1], *words[2:]])
        try:
            with contextlib.redirect_stderr(err):
                module.main()
        except _Parsed:
            return None
        except SystemExit as e:
            return err.getvalue().strip() or f"exit {e.code}"
    return "its main() returned without parsing arguments"


@pytest.mark.parametrize("page", PAGES)
def test_every_cli_command_parses(page, monkeypatch):
    commands = _commands(page)
    assert commands, f"{page} shows no {PAGE_PROGRAM[page]!r} command"
    parser = _cli_parser()
    for line in commands:
        if PAGE_PROGRAM[page] != "foresight":
            problem = _bench_parse_error(line, monkeypatch)
            assert problem is None, f"docs/{page}: {line.strip()!r} does not parse: {problem}"
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(shlex.split(line, comments=True)[1:])
        except (SystemExit, argparse.ArgumentError) as e:
            pytest.fail(f"docs/{page}: {line.strip()!r} does not parse: {err.getvalue().strip() or e}")


@pytest.mark.parametrize("page", ["node.md", "buckets.md"])
def test_imports_of_text_blocks_exist(page):
    imports = 0
    for block in _blocks(page, "text"):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue  # not Python
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("foresight"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"docs/{page}: {node.module} has no {alias.name}"
                    imports += 1
    assert imports


def _bench_presets() -> dict:
    return load_run_all().PRESETS


def test_benchmarks_page_names_real_benches():
    text = (DOCS / "benchmarks.md").read_text()
    named = set(re.findall(r"\bbench/(\w+)\.py\b", text))
    assert sorted(n for n in named if not (ROOT / "bench" / f"{n}.py").is_file()) == []
    assert sorted(set(_bench_presets()) - named) == [], "a bench run_all.py runs is missing from the page"
    for path in re.findall(r"\b((?:bench|scripts)/[\w/]+\.sh)\b", text):
        assert (ROOT / path).is_file(), path


def _anchors(markdown: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    heads = re.findall(r"^#{1,6}\s+(.*)$", markdown.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES + ("buckets.md",))
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", (DOCS / page).read_text(), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        target = (DOCS / path).resolve() if path else DOCS / page
        assert target.exists(), f"docs/{page}: link {link!r} -> {target} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"docs/{page}: no heading #{anchor} in {target.name}"
