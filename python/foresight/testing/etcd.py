"""The one etcd launcher: a local etcd (Debian ``etcd-server``) for the tests, benches, examples and the demo.

Example::

    with EtcdProcess(data_dir="/tmp/etcd") as etcd:
        print(etcd.endpoint)          # http://127.0.0.1:PORT, ready (its /health answered)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Sequence

from foresight.errors import NodeError
from foresight.testing.processes import free_ports, stop_process
from foresight.testing.tether import start_tethered


class EtcdProcess:
    """One etcd member on loopback with its own data directory; ``close()`` stops it (SIGTERM, then SIGKILL).
    ``port``: the client port (default: a free one); give the old one to restart a member on the same endpoint.
    ``args``: more etcd flags (e.g. ``["--max-request-bytes", "65536"]`` for a member with tighter limits)."""

    def __init__(self, data_dir: str, *, binary: str | None = None, timeout: float = 30.0,
                 port: int | None = None, args: Sequence[str] = ()) -> None:
        binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            raise NodeError("etcd not found (Debian package etcd-server; scripts/setup.sh installs it)", path=binary)
        os.makedirs(data_dir, exist_ok=True)
        client, peer = free_ports(2)
        client = port or client  # port: restart on the same endpoint
        self.endpoint = f"http://127.0.0.1:{client}"
        self.log_path = os.path.join(data_dir, "etcd.log")
        self._log = open(self.log_path, "ab")
        self.proc = start_tethered(
            [binary, "--name", "foresight-test", "--data-dir", os.path.join(data_dir, "data"),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"foresight-test=http://127.0.0.1:{peer}", *args],
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
            stop_process(self.proc, f"etcd ({self.log_path})", grace=10)
        finally:
            self._log.close()

    def __enter__(self) -> "EtcdProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["EtcdProcess"]
