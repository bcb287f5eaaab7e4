"""Suite-wide guards and diagnostics.

* Scheduling: a test that leaves the test process with another scheduling policy fails, naming itself. The hangs
  once seen late in full runs (a vfork that never returned, a node that could neither start nor die of SIGKILL) came
  from one: SVT-AV1, encoding as root, left the pytest thread SCHED_FIFO 99, so every later child was real-time
  and a busy one starved the rest for good (``foresight.testing.media_synth.scheduling_kept`` fixes that
  encoder's calls).
* A test still running after ``FORESIGHT_TEST_DUMP_AFTER_S`` (default 300 s) prints the kernel state of every
  process it spawned (state, wait channel, kernel stack, scheduling policy), so a stuck child says where it waits.
  Reading ``/proc/PID/stack`` needs root (CI runs as root); elsewhere the state and wait channel still print. The dump
  goes to a file (pytest captures the test's stderr) and is printed in the run's summary.
"""
from __future__ import annotations

import os
import threading

import pytest
from process_diagnostics import dump_children

DUMP_AFTER_S = float(os.environ.get("FORESIGHT_TEST_DUMP_AFTER_S", "300"))
DUMP_FILE = os.environ.get("FORESIGHT_TEST_DUMP_FILE", f"/tmp/foresight-test-diagnostics-{os.getpid()}.log")


SESSION_SCHEDULING = (os.sched_getscheduler(0), os.sched_getparam(0))


def pytest_sessionstart(session) -> None:
    if os.path.exists(DUMP_FILE):  # a file left by an earlier run of the same pid
        os.unlink(DUMP_FILE)


@pytest.fixture(autouse=True)
def _scheduling_is_left_as_it_was():
    yield
    now = (os.sched_getscheduler(0), os.sched_getparam(0))
    if now != SESSION_SCHEDULING:
        os.sched_setscheduler(0, *SESSION_SCHEDULING)  # the tests after this one run as they should
        pytest.fail(f"this test left the test process with scheduling policy {now[0]} priority "
                    f"{now[1].sched_priority} (was {SESSION_SCHEDULING[0]}): children started later inherit it",
                    pytrace=False)


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
