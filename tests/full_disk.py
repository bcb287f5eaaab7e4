"""A real full disk for tests: a small tmpfs mounted over a test directory (needs root; skipped elsewhere).

Example::

    from full_disk import full_disk   # the fixture: a pathlib.Path on a 1 MiB file system

    def test_x(full_disk):
        (full_disk / "big").write_bytes(bytes(2 << 20))   # OSError: [Errno 28] No space left on device
"""
from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def full_disk(tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        # A busy unmount means the code under test left a file open there: detach it anyway, then fail.
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
            pytest.fail("the full disk could not be unmounted: a file on it was left open")
