"""Where a stuck process waits in the kernel: used by the suite's long-test dump (conftest.py) and by helpers that
SIGKILL a child and find it still alive."""
from __future__ import annotations

import os


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"<{e.strerror}>"


def kernel_state(pid: int) -> list[str]:
    """Lines describing a process: command, state, wait channel, the kernel stack of its main and busy tasks."""
    lines = []
    status = {k: v for k, v in (ln.split(":", 1) for ln in _read(f"/proc/{pid}/status").splitlines() if ":" in ln)}
    lines.append(f"  pid {pid} {' '.join(_read(f'/proc/{pid}/cmdline').split(chr(0)))[:160]}")
    lines.append(f"    state {status.get('State', '?').strip()}  wchan {_read(f'/proc/{pid}/wchan')}  "
                 f"threads {status.get('Threads', '?').strip()}")
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
