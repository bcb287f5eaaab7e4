"""Benches for tests: ``bench/<name>.py`` loaded as a module (they are scripts beside their siblings, not a package),
for tests that check documents against them, or run as a script whose result files go to a fresh directory.

Example::

    proc, results = run_bench("decode", "--smoke", results=tmp_path / "results")
    data = json.loads((results / "decode_smoke.json").read_text())  # written by this run, never an earlier one
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS_ENV = "FORESIGHT_BENCH_RESULTS"  # bench/common.py: where RESULTS points


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (once per test process; its ``main`` is not run)."""
    module_name = f"_bench_{name}_for_tests"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(BENCH))  # it imports common (and report) from its own folder
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        sys.path.remove(str(BENCH))
    return module


def load_run_all() -> ModuleType:
    return load_bench("run_all")


def run_bench(name: str, *args: str, results: Path, timeout: float = 300,
              env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """Run ``bench/<name>.py args`` with its result files going to ``results`` (made here, must not exist yet)."""
    results.mkdir(parents=True)
    env = dict(os.environ if env is None else env, **{RESULTS_ENV: str(results)})
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, results
