"""Set-up keeps each checkout to itself: the package lives in this clone's .venv, never in the system Python.

Before, scripts/setup.sh ran `pip install -e .` with the system interpreter, so every fresh clone (CI makes one per
run) repointed the machine's `foresight` to itself, and deleting that clone broke `import foresight` everywhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import foresight

ROOT = Path(__file__).resolve().parents[1]


def test_tests_run_inside_the_checkouts_own_virtualenv():
    assert Path(sys.prefix).resolve() == (ROOT / ".venv").resolve(), (
        f"tests should run under {ROOT / '.venv'} (scripts/test.sh), not {sys.prefix}")
    assert Path(foresight.__file__).resolve().is_relative_to(ROOT / "python")


def test_system_python_does_not_see_this_checkout():
    base = getattr(sys, "_base_executable", None) or "python3"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([base, "-c", "import foresight, sys; sys.stdout.write(foresight.__file__)"],
                          capture_output=True, text=True, env=env, cwd="/", timeout=60)
    if proc.returncode == 0:  # another project's install is not ours to judge; this clone must not be it
        assert not Path(proc.stdout).resolve().is_relative_to(ROOT), (
            f"the system interpreter {base} imports foresight from this checkout: {proc.stdout}")
