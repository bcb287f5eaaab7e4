"""Two sites on one machine, as real processes: an etcd server and replication nodes (tests and the bench).

Example::

    with EtcdServer("/tmp/etcd") as etcd, SiteProcess("eval-b", "/tmp/eval", etcd=etcd.url) as ev:
        with WanLink(("127.0.0.1", ev.port), rtt_ms=100) as link, \\
             SiteProcess("train-a", "/tmp/train", etcd=etcd.url, routes={"eval-b": link.url}) as tr:
            ...
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """A single-member etcd (Debian ``etcd-server``) on loopback, its data in ``data_dir``."""

    def __init__(self, data_dir: str) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise FileNotFoundError("etcd is not installed (scripts/setup.sh installs etcd-server)")
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(os.path.dirname(os.path.abspath(data_dir)), exist_ok=True)
        self._log = open(f"{data_dir}.log", "w")
        self.proc = subprocess.Popen(
            [exe, "--data-dir", data_dir, "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        for _ in range(400):
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not start (see {data_dir}.log)")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SiteProcess:
    """A storage node of one site (``foresight node serve --site``) as a process; ``url`` is its Flight endpoint.
    Its JSON log goes to ``<root>.<site>.log``."""

    def __init__(self, site: str, root: str, *, etcd: str | None = None, routes: dict[str, str] | None = None,
                 unit_bytes: int = 32 << 20, streams: int = 2, replica_ttl: int = 3600, port: int = 0,
                 fifo: bool = False, timeout: float = 120.0, token: str = "", retry_s: float | None = None) -> None:
        self.site, self.root, self.token = site, root, token
        os.makedirs(root, exist_ok=True)
        self.ready_file = f"{os.path.abspath(root)}.{site}.ready.json"
        if os.path.exists(self.ready_file):
            os.unlink(self.ready_file)
        args = [sys.executable, "-m", "foresight", "node", "serve", "--root", root, "--port", str(port),
                "--ready-file", self.ready_file, "--site", site, "--replication-unit-bytes", str(unit_bytes),
                "--replication-streams", str(streams), "--replication-ttl", str(replica_ttl)]
        if etcd:
            args += ["--etcd", etcd]
        if fifo:
            args.append("--replication-fifo")
        if token:
            args += ["--replication-token", token]
        if retry_s is not None:
            args += ["--replication-retry-s", str(retry_s)]
        for s, url in (routes or {}).items():
            args += ["--route", f"{s}={url}"]
        self.log_path = f"{os.path.abspath(root)}.{site}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"site {site} did not start: {self.log()[-2000:]}")
            time.sleep(0.05)
        with open(self.ready_file) as f:
            self.url = json.load(f)["location"]
        self.port = int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def call(self, action: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One action on this site, with the site's token."""
        from foresight.checkpoint.replicate.service import call

        return call(self.url, action, {**(body or {}), **({"token": self.token} if self.token else {})})

    def kill(self) -> None:
        """SIGKILL: the site dies mid-whatever (tests of cut transfers)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> SiteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
