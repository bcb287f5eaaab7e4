"""``foresight node serve`` with a bad option value exits at once with an error naming the option, with or without
etcd (a real process; the bound on the run is for a hang, not a timing check)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("option, value", [("--service-limit", "abc"), ("--service-limit", "-5"),
                                           ("--replica-quota", "x")])
def test_a_bad_option_value_is_an_error_at_start_without_etcd(tmp_path, option, value):
    """These two were parsed only when the replica manager started (with --etcd): without it the node served,
    the typo unnoticed."""
    proc = subprocess.run([sys.executable, "-m", "foresight", "node", "serve", "--root", str(tmp_path), option, value],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"value={value}" in proc.stderr and ("service limit" in proc.stderr or option in proc.stderr)
