"""Servers that die with the process that started them: the one launcher of every test bed's server process.

A bed's server (``weed mini``, etcd, ``foresight node serve``, a WAN proxy, ...) started with plain ``Popen``
outlives a SIGKILLed pytest or bench: it is re-parented to init and keeps its ports, files and CPU. Linux's
``PR_SET_PDEATHSIG`` does not cover it: the signal follows the *thread* that forked, so a server a helper thread
started would die when that thread ends, and none is sent when the kill takes the whole process group.

:func:`start_tethered` starts the server in a session of its own and a watcher next to it: a small process (stdlib
only, in its own session too, so a kill of the parent's process group spares it) that holds a pidfd of the parent
process and one of the server. When the parent process exits, whatever the cause or the thread that launched the
server, the watcher SIGKILLs the server's process group; when the server exits first, the watcher leaves quietly.
The watcher is a grandchild (double fork): nothing is left for the parent to reap.

Example::

    proc = start_tethered(["etcd", "--data-dir", "/tmp/e"], stdout=log, stderr=subprocess.STDOUT)
    proc.watcher_pid        # the watcher: gone once etcd has exited
    stop_process(proc, "etcd", grace=10)
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

__all__ = ["start_tethered"]

WATCHER_START_TIMEOUT_S = 120.0  # a bound for a stuck start (a loaded machine starts Python in well under that)


def start_tethered(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kwargs)`` in a new session, SIGKILLed with its whole process group when this
    process exits (see the module's docstring). The returned ``Popen`` has ``watcher_pid`` set.

    Stop it as before (``stop_process``, ``proc.kill()``, or ``os.killpg(proc.pid, sig)``: it leads its group)."""
    if "start_new_session" in popen_kwargs or "process_group" in popen_kwargs or "preexec_fn" in popen_kwargs:
        raise ValueError("start_tethered sets the server's session itself (start_new_session, process_group and "
                         "preexec_fn are not accepted)")
    proc = subprocess.Popen(args, start_new_session=True, **popen_kwargs)
    try:
        proc.watcher_pid = _start_watcher(proc.pid)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def _start_watcher(server_pid: int) -> int:
    """Run this file as a script: it opens the pidfds while this process waits on it (so neither pid can have been
    reused yet: the server is our unreaped child), forks the watcher, prints its pid and exits."""
    done = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(server_pid)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True, timeout=WATCHER_START_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the watcher of pid {server_pid} did not start (exit {done.returncode}): "
                           f"{done.stderr.decode(errors='replace')[-2000:]}")
    return int(done.stdout)


def _watch(parent_pid: int, server_pid: int) -> None:
    """The script's body (stdlib only: ``-I -S``, nothing of foresight imported)."""
    parent = os.pidfd_open(parent_pid)
    server = os.pidfd_open(server_pid)
    if os.getppid() != parent_pid:  # the parent died before its pidfd was open: the pid may name another process
        _kill_group(server, server_pid)
        return
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the launcher reads our stdout and stderr to their end: let go of them
        os.dup2(devnull, fd)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready, _, _ = select.select([parent, server], [], [])
    if server not in ready:  # the parent exited while the server runs
        _kill_group(server, server_pid)


def _kill_group(server: int, server_pid: int) -> None:
    """SIGKILL the server's process group, unless the server is gone already (its pid, then its group id, could be
    reused: the pidfd says for sure whether it is still the same process)."""
    if select.select([server], [], [], 0)[0]:
        return
    try:
        os.killpg(server_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]))
