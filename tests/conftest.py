"""Suite-wide diagnostics: a test still running after ``FORESIGHT_TEST_DUMP_AFTER_S`` (default 300 s) prints the kernel
state of every process it spawned (state, wait channel, kernel stack), because a few process-spawning tests have hung
late in full runs with a child that survived SIGKILL; the next occurrence then says where in the kernel it waits.
Reading ``/proc/PID/stack`` needs root (CI runs as root); elsewhere the state and wait channel still print. The dump
goes to a file (pytest captures the test's stderr, and a rerun hides it) and is printed in the run's summary.
"""
from __future__ import annotations

import os
import threading

import pytest
from process_diagnostics import dump_children

DUMP_AFTER_S = float(os.environ.get("FORESIGHT_TEST_DUMP_AFTER_S", "300"))
DUMP_FILE = os.environ.get("FORESIGHT_TEST_DUMP_FILE", f"/tmp/foresight-test-diagnostics-{os.getpid()}.log")


def pytest_sessionstart(session) -> None:
    if os.path.exists(DUMP_FILE):  # a file left by an earlier run of the same pid
        os.unlink(DUMP_FILE)


@pytest.fixture(autouse=True)
def _dump_kernel_state_of_a_stuck_test(request):
    timer = threading.Timer(DUMP_AFTER_S, dump_children, args=(request.node.nodeid, DUMP_AFTER_S, DUMP_FILE))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def pytest_terminal_summary(terminalreporter) -> None:
    if os.path.exists(DUMP_FILE):
        terminalreporter.write_sep("=", "foresight diagnostics: tests that ran long, and their children's kernel state")
        with open(DUMP_FILE) as f:
            terminalreporter.write(f.read())
