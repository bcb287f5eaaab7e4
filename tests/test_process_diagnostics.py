"""Children of tests are bounded: one that never prints, ignores SIGTERM or leaves a process holding its output is
killed and reported (with where it waits in the kernel), never waited on until the suite's timeout."""
from __future__ import annotations

import subprocess
import sys

import pytest
from node_helpers import wait_for
from process_diagnostics import stop, wait_for_lines
from test_examples import run

SILENT = "import time\ntime.sleep(3600)"
IGNORES_SIGTERM = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n" \
                  "time.sleep(3600)"
# prints the pid of a grandchild that keeps this script's stdout open, then exits at once
LEAVES_A_GRANDCHILD = "import subprocess, sys\np = subprocess.Popen(['sleep', '3600'])\nprint(p.pid, flush=True)"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_that_never_prints_is_reported_with_its_kernel_state(tmp_path):
    output = tmp_path / "child.out"
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SILENT], stdout=out, stderr=subprocess.STDOUT)
    try:
        with pytest.raises(AssertionError, match=r"printed no \['ready'\] in 1 s") as e:
            wait_for_lines(proc, output, {"ready"}, what="the child", timeout=1)
        assert f"pid {proc.pid}" in str(e.value) and "wchan" in str(e.value)
    finally:
        proc.kill()
        proc.wait(60)


def test_a_child_ignoring_sigterm_is_killed_and_reported(tmp_path):
    output = tmp_path / "child.out"
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=out, stderr=subprocess.STDOUT)
    wait_for_lines(proc, output, {"ready"}, what="the child")
    with pytest.raises(RuntimeError, match="still running 1 s after SIGTERM; killed"):
        stop(proc, "the child", grace=1)
    assert proc.returncode == -9


def test_a_grandchild_holding_the_output_neither_blocks_the_run_nor_outlives_it():
    proc = run([sys.executable, "-c", LEAVES_A_GRANDCHILD], timeout=60)
    grandchild = int(proc.stdout.split()[0])
    assert proc.returncode == 0
    wait_for(lambda: not _alive(grandchild), timeout=30, what="the grandchild killed with the run's session")
