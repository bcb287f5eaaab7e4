"""Free loopback ports and bounded process stops: the two things every test bed here needs.

Example::

    port = free_port()
    master, volume = free_ports(2)          # distinct: all bound at once, then released
    stop_process(proc, "etcd", grace=10)    # SIGTERM, 10 s, SIGKILL; never an endless wait
"""
from __future__ import annotations

import socket
import subprocess


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (each bound until all are chosen, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One free TCP port on 127.0.0.1."""
    return free_ports(1)[0]


def stop_process(proc: subprocess.Popen, what: str, grace: float) -> None:
    """SIGTERM and ``grace`` s to exit (0: SIGKILL at once), then SIGKILL; one still not reaped 60 s after SIGKILL
    is stuck in the kernel: RuntimeError naming it, never an endless wait."""
    if proc.poll() is None and grace > 0:
        proc.terminate()
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} (pid {proc.pid}) did not exit within 60 s of SIGKILL") from None


__all__ = ["free_port", "free_ports", "stop_process"]
