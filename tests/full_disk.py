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


@pytest.fixture
def small_ext4(tmp_path):
    """A pathlib.Path on an 8 MiB ext4 file system (a loop device; needs root, skipped elsewhere). Unlike tmpfs,
    whose pages a read of a shared mapping already allocates, a block file system allocates a block of a sparse,
    mapped file when a store first dirties its page: what fails (SIGBUS) once the disk is full."""
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 file system here: {made.stderr.strip()}")
    proc = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a loop device here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
            pytest.fail("the small ext4 disk could not be unmounted: a file on it was left open")
