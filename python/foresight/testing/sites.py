"""Replication sites on one machine, as real processes (``foresight node serve --site``; tests, benches, examples).

Example::

    with EtcdProcess("/tmp/etcd") as etcd, SiteProcess("eval-b", "/tmp/eval", etcd=etcd.endpoint) as ev:
        with WanLink(("127.0.0.1", ev.port), rtt_ms=100) as link, \\
             SiteProcess("train-a", "/tmp/train", etcd=etcd.endpoint, routes={"eval-b": link.url}) as tr:
            ...
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from foresight.replication.flight_calls import call
from foresight.testing.processes import stop_process
from foresight.testing.tether import start_tethered


class SiteProcess:
    """A storage node of one site (``foresight node serve --site``) as a process; ``url`` is its Flight endpoint.
    Its JSON log goes to ``<root>.<site>.log``."""

    def __init__(self, site: str, root: str, *, etcd: str | None = None, routes: dict[str, str] | None = None,
                 unit_bytes: int = 32 << 20, streams: int = 2, replica_ttl: int = 3600, port: int = 0,
                 fifo: bool = False, timeout: float = 120.0, token: str = "", retry_s: float | None = None,
                 max_wait_s: float | None = None) -> None:
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
        if max_wait_s is not None:
            args += ["--replication-max-wait-s", str(max_wait_s)]
        for s, url in (routes or {}).items():
            args += ["--route", f"{s}={url}"]
        self.log_path = f"{os.path.abspath(root)}.{site}.log"
        self._log = open(self.log_path, "ab")
        self.proc = start_tethered(args, stdout=self._log, stderr=subprocess.STDOUT)
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
        return call(self.url, action, {**(body or {}), **({"token": self.token} if self.token else {})})

    def kill(self) -> None:
        """SIGKILL: the site dies mid-whatever (tests of cut transfers)."""
        try:
            stop_process(self.proc, f"site {self.site}", grace=0)
        finally:
            self._log.close()

    def stop(self) -> None:
        try:
            stop_process(self.proc, f"site {self.site}", grace=60)
        finally:
            self._log.close()

    def __enter__(self) -> SiteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
