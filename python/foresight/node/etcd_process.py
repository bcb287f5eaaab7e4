"""Start and stop a local etcd (Debian ``etcd-server``) for tests, the demo and single-machine clusters.

Example::

    with EtcdProcess(data_dir="/tmp/etcd") as etcd:
        print(etcd.endpoint)          # http://127.0.0.1:PORT, ready (its /health answered)
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request

from foresight.errors import NodeError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    """One etcd member on loopback with its own data directory; ``close()`` stops it (SIGTERM, then SIGKILL).
    ``port``: the client port (default: a free one); give the old one to restart a member on the same endpoint."""

    def __init__(self, data_dir: str, *, binary: str | None = None, timeout: float = 30.0,
                 port: int | None = None) -> None:
        binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            raise NodeError("etcd not found (Debian package etcd-server; scripts/setup.sh installs it)", path=binary)
        os.makedirs(data_dir, exist_ok=True)
        client, peer = port or free_port(), free_port()  # port: restart on the same endpoint
        self.endpoint = f"http://127.0.0.1:{client}"
        self.log_path = os.path.join(data_dir, "etcd.log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "--name", "foresight-test", "--data-dir", os.path.join(data_dir, "data"),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"foresight-test=http://127.0.0.1:{peer}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise NodeError("etcd exited at start", code=self.proc.returncode, log=self.log_path)
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=2) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise NodeError("etcd did not become healthy", endpoint=self.endpoint, log=self.log_path)
            time.sleep(0.2)

    def close(self) -> None:
        """SIGTERM, 10 s to exit, then SIGKILL; an etcd still not reaped 60 s later is stuck in the kernel, and is
        reported instead of waited on forever."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    try:
                        self.proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        raise NodeError("etcd did not exit within 60 s of SIGKILL", pid=self.proc.pid,
                                        log=self.log_path) from None
        finally:
            self._log.close()

    def __enter__(self) -> "EtcdProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["EtcdProcess", "free_port"]
