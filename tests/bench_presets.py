"""bench/run_all.py loaded as a module (it is a script beside its siblings, not a package), for tests that check
documents against its PRESETS."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_run_all() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_run_all_for_tests", BENCH / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))  # it imports common and report from its own folder
    try:
        spec.loader.exec_module(run_all)
    finally:
        sys.path.remove(str(BENCH))
    return run_all
