"""Child processes in tests, bounded: every wait has a limit, a child that outstays it is killed, and one that then
still does not exit is reported with where it waits in the kernel (a hang becomes a failure that says where).
Children write to files, never to a pipe the test may stop reading (a child blocked on a full pipe, or a grandchild
holding the pipe open, hangs whoever waits for it). Also the suite's long-test dump (conftest.py).

Example::

    with open(tmp_path / "child.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_lines(proc, tmp_path / "child.out", {"ready"}, what="the child", timeout=120)
    finally:
        kill_and_reap(proc, "the child")
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"<{e.strerror}>"


def kernel_state(pid: int) -> list[str]:
    """Lines describing a process: command, state, wait channel, scheduling policy (a real-time one starves its
    equals), the kernel stack of its main and busy tasks."""
    lines = []
    status = {k: v for k, v in (ln.split(":", 1) for ln in _read(f"/proc/{pid}/status").splitlines() if ":" in ln)}
    lines.append(f"  pid {pid} {' '.join(_read(f'/proc/{pid}/cmdline').split(chr(0)))[:160]}")
    try:
        policy = f"{os.sched_getscheduler(pid)}/{os.sched_getparam(pid).sched_priority}"
    except OSError:
        policy = "?"
    lines.append(f"    state {status.get('State', '?').strip()}  wchan {_read(f'/proc/{pid}/wchan')}  "
                 f"threads {status.get('Threads', '?').strip()}  policy/priority {policy}")
    for task in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else []:
        state = _read(f"/proc/{pid}/task/{task}/stat").split(") ")[-1][:1]
        if state in ("D", "R") or task == str(pid):
            stack = _read(f"/proc/{pid}/task/{task}/stack").replace("\n", " | ")
            lines.append(f"    task {task} [{state}] {_read(f'/proc/{pid}/task/{task}/comm')}: {stack[:600]}")
    return lines


def dump_children(test_id: str, after_s: float, path: str) -> None:
    """Append the kernel state of every process this one spawned to ``path``."""
    try:
        import psutil
    except ImportError:
        return
    lines = [f"\n[foresight diagnostics] {test_id} still running after {after_s:.0f} s; its child processes:"]
    for child in psutil.Process().children(recursive=True):
        lines += kernel_state(child.pid)
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def _report(proc: subprocess.Popen, what: str, why: str, output: Path | None = None) -> str:
    lines = [f"{what} (pid {proc.pid}) {why}", *kernel_state(proc.pid)]
    if output is not None and output.exists():
        lines.append(f"  its output ({output}), last 2000 characters:\n{output.read_text(errors='replace')[-2000:]}")
    return "\n".join(lines)


def reap(proc: subprocess.Popen, what: str, timeout: float = 60.0, after: str = "SIGKILL") -> int:
    """Wait (at most ``timeout`` s) for a child that was killed (or told to exit: ``after`` says how); one still
    there is killed and reported, naming where it waited in the kernel, instead of waited on forever."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        report = _report(proc, what, f"did not exit within {timeout:.0f} s of {after}")
        proc.kill()
        raise RuntimeError(report) from None


def kill_and_reap(proc: subprocess.Popen, what: str, timeout: float = 60.0, *, group: bool = False) -> int:
    """SIGKILL (the child's whole process group with ``group``: it was started with ``start_new_session``) and
    :func:`reap`."""
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # also what it started and never stopped
        except ProcessLookupError:
            pass
    elif proc.poll() is None:
        proc.kill()
    return reap(proc, what, timeout)


def stop(proc: subprocess.Popen, what: str, grace: float = 60.0, timeout: float = 60.0) -> int:
    """SIGTERM, then at most ``grace`` s to exit; a child still running is killed and reported (ignoring SIGTERM
    that long is a defect of its own), never left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        report = _report(proc, what, f"still running {grace:.0f} s after SIGTERM; killed. Where it was")
        kill_and_reap(proc, what, timeout)
        raise RuntimeError(report) from None


def wait_for_lines(proc: subprocess.Popen, output: Path, lines: set[str], *, what: str,
                   timeout: float = 120.0) -> None:
    """Wait until ``output`` (the child's stdout file) holds every one of ``lines``; raise with the child's kernel
    state and output if it exits first or ``timeout`` s pass (a bound for a stuck child, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = set(output.read_text(errors="replace").split("\n")) if output.exists() else set()
        if lines <= {line.strip() for line in seen}:
            return
        if proc.poll() is not None:
            raise AssertionError(_report(proc, what, f"exited with {proc.returncode} before printing "
                                                     f"{sorted(lines - seen)}", output))
        if time.monotonic() > deadline:
            raise AssertionError(_report(proc, what, f"printed no {sorted(lines - seen)} in {timeout:.0f} s",
                                         output))
        time.sleep(0.05)
