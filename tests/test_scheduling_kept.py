"""Encoding test media must not change the test process's scheduling policy (the cause of the suite's old hangs).

SVT-AV1 run as root leaves the thread that opens its encoder SCHED_FIFO 99; every process started from that thread
afterwards inherited it, and a busy real-time child starved its equals for good. Without root the encoder cannot
change the policy, so the first test shows the problem only where it can arise (CI runs as root).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from foresight.testing.media_synth import make_video, scheduling_kept


def test_an_av1_encode_leaves_the_scheduling_policy_as_it_was():
    before = (os.sched_getscheduler(0), os.sched_getparam(0))
    make_video(codec="libsvtav1", width=64, height=64, seconds=0.2)
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may make a thread real-time")
def test_scheduling_kept_restores_a_real_time_policy_set_inside_it():
    def child_policy() -> int:  # what a process started from this thread inherits
        out = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                             capture_output=True, text=True, check=True, timeout=60)
        return int(out.stdout)

    before = os.sched_getscheduler(0)
    with scheduling_kept():
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        assert child_policy() == os.SCHED_FIFO  # a child would have inherited it
    assert os.sched_getscheduler(0) == before and child_policy() == before
