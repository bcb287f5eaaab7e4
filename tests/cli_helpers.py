"""Run the real ``foresight`` entry point in a subprocess (``python -m foresight ...``), as a user would."""
from __future__ import annotations

import os
import subprocess
import sys


def cli_env(**extra: str) -> dict[str, str]:
    """The test's environment without FORESIGHT_DEBUG/FORESIGHT_LOG (the defaults a user sees), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORESIGHT_DEBUG", "FORESIGHT_LOG")}
    env.update(extra)
    return env


def run_cli(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 300,
            **env: str) -> subprocess.CompletedProcess:
    """``foresight ARGS`` to completion; stdout/stderr as text."""
    return subprocess.run([sys.executable, "-m", "foresight", *args], capture_output=True, text=True,
                          env=cli_env(**env), cwd=cwd, timeout=timeout, check=False)
