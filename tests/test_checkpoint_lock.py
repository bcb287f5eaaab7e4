"""One writer per checkpoint root: a second Checkpointer (another rank, another process) gets a clear error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import foresight.checkpoint as fc
import pytest
import torch
from foresight.checkpoint import store
from foresight.errors import CheckpointError
from process_diagnostics import kill_and_reap, reap, wait_for_lines

_HOLDER = """
import sys
import foresight.checkpoint as fc
ck = fc.Checkpointer(sys.argv[1:])
print("ready", flush=True)
sys.stdin.read()  # hold the lock until the parent closes our stdin or kills us
ck.close()
"""


def _start_holder(*roots: str) -> subprocess.Popen:
    """A process holding the roots' lock until its stdin is closed (it only reads stdin: that pipe cannot fill)."""
    output = Path(roots[0]).parent / f"holder-{os.path.basename(roots[0])}.out"
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, *roots], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_lines(proc, output, {"ready"}, what="the lock holder")
    except BaseException:
        kill_and_reap(proc, "the lock holder")
        raise
    return proc


def test_second_process_on_the_same_root_gets_a_clear_error(tmp_path):
    root = str(tmp_path / "ckpt")
    holder = _start_holder(root)
    try:
        with pytest.raises(CheckpointError, match="in use by another Checkpointer") as ei:
            fc.Checkpointer(root)
        assert root in str(ei.value) and f"pid {holder.pid}" in str(ei.value)
        # a shared durable tier is a shared root too, and the failed attempt leaves its own tier unlocked
        other = str(tmp_path / "other-local")
        with pytest.raises(CheckpointError, match="in use by another Checkpointer"):
            fc.Checkpointer([other, root])
        store.RootLock(other).release()
    finally:
        kill_and_reap(holder, "the lock holder")  # SIGKILL: the kernel drops the lock with the process
    with fc.Checkpointer(root) as ck:
        ck.save({"w": torch.ones(3)}, 1).wait()
    assert fc.load(1, root=root).step == 1


def test_lock_released_by_close_and_held_within_a_process(tmp_path):
    root = str(tmp_path)
    ck = fc.Checkpointer(root)
    with pytest.raises(CheckpointError, match="in use by another Checkpointer") as ei:
        fc.Checkpointer(root)
    assert f"pid {os.getpid()}" in str(ei.value)
    ck.close()
    holder = _start_holder(root)  # another process can take it now
    holder.stdin.close()
    assert reap(holder, "the lock holder", after="its stdin closed") == 0
    fc.Checkpointer(root).close()


_FORKING_HOLDER = """
import os, sys, time
import foresight.checkpoint as fc
ck = fc.Checkpointer(sys.argv[1])
child = os.fork()
if child == 0:  # a DataLoader-style worker that outlives its parent
    time.sleep(3600)
    os._exit(0)
print(child)
print("forked", flush=True)
time.sleep(3600)
"""


def test_forked_child_does_not_keep_a_killed_parents_lock(tmp_path):
    root = str(tmp_path)
    output = tmp_path.parent / f"{tmp_path.name}-forking-holder.out"
    with open(output, "w") as out:
        parent = subprocess.Popen([sys.executable, "-c", _FORKING_HOLDER, root], stdout=out,
                                  stderr=subprocess.STDOUT, text=True)
    child = None
    try:
        wait_for_lines(parent, output, {"forked"}, what="the forking holder")
        child = int(output.read_text().split()[0])
        with pytest.raises(CheckpointError, match="in use"):
            fc.Checkpointer(root)
        kill_and_reap(parent, "the forking holder")
        os.kill(child, 0)  # the child still runs, with its copy of the parent's descriptors
        fc.Checkpointer(root).close()
    finally:
        kill_and_reap(parent, "the forking holder")
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)  # not our child (its parent's): init reaps it
            except ProcessLookupError:
                pass
