"""What survives: commit-ordered retention and "latest", drains resumed after a kill, quarantine of a
step that lost its COMMIT marker."""
from __future__ import annotations

import os
import subprocess
import sys

import foresight.checkpoint as fc
import pytest
import torch
from foresight.checkpoint import store
from process_diagnostics import kill_and_reap, wait_for_lines


def state(step: int) -> dict:
    return {"w": torch.arange(300_000, dtype=torch.float32) * step, "b": torch.full((7,), float(step))}


def assert_state(got: fc.LoadedCheckpoint, step: int) -> None:
    assert got.step == step
    for k, v in state(step).items():
        assert torch.equal(got.state_dict[k], v), (step, k)


# -- commit order ------------------------------------------------------------------------------------

def test_rollback_keeps_what_wait_acknowledged(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root, keep=2) as ck:
        for step in (10, 20, 5):  # 5: a rollback, or a restart from an older step
            ck.save(state(step), step).wait()
        ck.wait()  # retention has run after the last save
        assert store.committed_steps(root) == [5, 20]
        assert [c.step for c in store.commits(root)] == [20, 5]  # commit order
        assert_state(ck.load("latest"), 5)
    assert fc.latest_step(root=root) == 5
    assert_state(fc.load("latest", root=root), 5)


def test_commit_order_continues_across_restarts_and_tiers(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with fc.Checkpointer([fast, slow], keep=[2, 2]) as ck:
        for step in (10, 20, 5):
            ck.save(state(step), step).wait()
    assert store.committed_steps(fast) == [5, 20] and store.committed_steps(slow) == [5, 20]
    # a new process: its first save is newer than everything already there, whatever its step
    with fc.Checkpointer([fast, slow], keep=[2, 2]) as ck:
        ck.save(state(3), 3).wait()
    for root in (fast, slow):
        assert [c.step for c in store.commits(root)] == [5, 3], root
    assert fc.latest_step(tiers=[fast, slow]) == 3
    assert_state(fc.load("latest", tiers=[fast, slow]), 3)


def test_resaving_a_step_loads_the_newest_commit_of_it(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with fc.Checkpointer([fast, slow]) as ck:
        ck.save(state(1), 7).wait()
        ck.save(state(2), 8).wait()
        ck.save(state(3), 7).wait()  # step 7 again, later: the newest commit
    got = fc.load(7, tiers=[fast, slow])
    assert torch.equal(got.state_dict["w"], state(3)["w"]) and got.tier == 0
    assert fc.latest_step(tiers=[fast, slow]) == 7


# -- a drain cut short by a kill is resumed ------------------------------------------------------------

_STALLING_SAVER = """
import os, sys, time, torch
import foresight.checkpoint as fc
from foresight.checkpoint import tier_drain as cp

local, durable = sys.argv[1], sys.argv[2]
def state(step):
    return {"w": torch.arange(300_000, dtype=torch.float32) * step, "b": torch.full((7,), float(step))}

copy = cp.copy_file
def copy_then_stall(src, dst, fio):
    copy(src, dst, fio)
    if os.path.basename(os.path.dirname(src)) == "step-00000002":
        print("stalled", flush=True)  # the data file is on the durable tier, the COMMIT marker not yet
        time.sleep(3600)              # the parent SIGKILLs us here
cp.copy_file = copy_then_stall

ck = fc.Checkpointer([local, durable])
ck.save(state(1), 1).wait()                # on both tiers
ck.save(state(2), 2).wait(durable=False)   # local only: its drain stalls
ck.save(state(3), 3).wait(durable=False)   # local only: queued behind it
print("committed", flush=True)
time.sleep(3600)
"""


def test_restart_resumes_a_drain_cut_short_by_sigkill(tmp_path):
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    output = tmp_path / "saver.out"  # a file, not a pipe: a bounded wait reads it, and says where a stuck saver waits
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _STALLING_SAVER, local, durable], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for_lines(proc, output, {"stalled", "committed"}, what="the saver", timeout=240)
    finally:
        kill_and_reap(proc, "the saver")  # SIGKILL at the forced point: no atexit, no cleanup
    assert store.committed_steps(local) == [1, 2, 3]
    assert store.committed_steps(durable) == [1]  # the drain of 2 (and 3 behind it) was cut short
    assert any(n.startswith(".tmp-step-00000002") for n in os.listdir(durable))

    with fc.Checkpointer([local, durable]) as ck:  # close() waits for the resumed drains
        resumed = [h.step for h in getattr(ck, "resumed", [])]
    assert store.committed_steps(durable) == [1, 2, 3]
    assert resumed == [2, 3]
    assert not [n for n in os.listdir(durable) if n.startswith(".tmp")]  # the dead drain's leftovers
    for step in (1, 2, 3):
        assert_state(fc.load(step, root=durable), step)
    with fc.Checkpointer([local, durable]) as ck:  # nothing left to resume
        assert ck.resumed == []


def test_resumed_drain_skips_what_durable_retention_deleted(tmp_path):
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    with fc.Checkpointer([local, durable], keep=[3, 1]) as ck:
        for step in (1, 2, 3):
            ck.save(state(step), step).wait()
    assert store.committed_steps(local) == [1, 2, 3] and store.committed_steps(durable) == [3]
    with fc.Checkpointer([local, durable], keep=[3, 1]) as ck:
        assert getattr(ck, "resumed", []) == []  # 1 and 2 are older than durable's newest: deleted on purpose
    assert store.committed_steps(durable) == [3]


# -- a lost COMMIT marker --------------------------------------------------------------------------------

def test_step_without_commit_is_quarantined_not_deleted(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
        ck.save(state(2), 2).wait()
    path = store.step_dir(root, 2)
    os.remove(os.path.join(path, store.COMMIT))  # lost: a bad sync, a user's rm, a torn copy
    files = sorted(os.listdir(path))
    with pytest.warns(RuntimeWarning, match="step-00000002 has no COMMIT marker.*its index and data verify"):
        ck = fc.Checkpointer(root)
    ck.close()
    assert len(ck.quarantined) == 1
    moved = ck.quarantined[0]
    assert os.path.basename(moved).startswith("quarantined-step-00000002.")
    assert sorted(os.listdir(moved)) == files and not os.path.exists(path)
    assert store.committed_steps(root) == [1]
    # the bytes are intact, for whoever decides what to do with them
    from foresight.checkpoint.reader import verify_uncommitted

    assert verify_uncommitted(moved) is None
    with fc.Checkpointer(root) as ck:  # nothing more to quarantine
        assert ck.quarantined == []


def test_quarantine_says_when_the_data_does_not_verify(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
    path = store.step_dir(root, 1)
    os.remove(os.path.join(path, store.COMMIT))
    with open(os.path.join(path, "data-00000.bin"), "r+b") as f:
        f.seek(5000)
        f.write(b"\x55")
    with pytest.warns(RuntimeWarning, match="does not verify.*tensor 'w'"):
        fc.Checkpointer(root).close()
    assert not os.path.exists(path) and store.committed_steps(root) == []


def test_retention_killed_mid_delete_leaves_nothing_to_quarantine(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
        ck.save(state(2), 2).wait()
    # retention takes a checkpoint out with one rename; a kill before the rmtree leaves this behind
    os.rename(store.step_dir(root, 1), os.path.join(root, ".retired-step-00000001.0badf00d"))
    with fc.Checkpointer(root) as ck:
        assert ck.quarantined == []
    assert sorted(os.listdir(root)) == [store.LOCK, "step-00000002"]
