"""Programs scripts/setup.sh installs (Debian packages) that tests need: a missing one fails the test that needs it,
naming the package, instead of skipping it, so a set-up that went wrong can never pass as a green run with parts
silently left out. Skips stay for what the set-up does not install (a GPU, the optional anchors, root, a kernel
that refuses io_uring or ptrace).

Example::

    from installed import require
    etcd = require("etcd")      # its path, or the test fails: "etcd is not installed (Debian package etcd-server...)"
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# program -> the Debian package scripts/setup.sh installs it from (its APT_PKGS)
PACKAGES = {"etcd": "etcd-server", "ffmpeg": "ffmpeg", "strace": "strace", "fio": "fio"}


def missing(program: str) -> str | None:
    """Why ``program`` cannot be used here, or None."""
    if shutil.which(program) is None:
        return (f"{program} is not installed (Debian package {PACKAGES[program]}; scripts/setup.sh installs it as "
                f"root): the set-up went wrong, so this test fails instead of skipping")
    return None


def require(program: str) -> str:
    """The path of ``program``; fails the calling test (no traceback) when it is not installed."""
    problem = missing(program)
    if problem:
        pytest.fail(problem, pytrace=False)
    return shutil.which(program)


def require_file(path: Path, package: str) -> Path:
    """``path``, a file the Debian ``package`` (installed by scripts/setup.sh) ships; fails the test when missing."""
    if not path.exists():
        pytest.fail(f"{path} is missing (Debian package {package}; scripts/setup.sh installs it as root): the set-up "
                    f"went wrong, so this test fails instead of skipping", pytrace=False)
    return path
