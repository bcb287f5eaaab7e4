"""An overwrite that crashed between its two renames (old directory aside, new one not yet in place) is recovered.

The crash states are built on disk directly: the dataset or plan is moved to ``.NAME.old-<pid>-<rand>`` exactly as
the overwrite's first rename does, with a process id that is no longer running.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from foresight.errors import FormatError, PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.io.durable import aside_path, recover_overwrite
from foresight.plan import build_plan, load_plan


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this id now (reuse within the test is not a concern)


def _crash_aside(path: str, pid: int | None = None, token: str = "0badc0de") -> str:
    """The state a crash after the overwrite's first rename leaves: only the old copy, beside the path."""
    parent, name = os.path.split(path)
    aside = os.path.join(parent, f".{name}.old-{_dead_pid() if pid is None else pid}-{token}")
    os.rename(path, aside)
    return aside


def _pack(path: str, seed: int, n: int = 20, overwrite: bool = False) -> list[bytes]:
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, int(rng.integers(1, 500)), dtype=np.uint8).tobytes() for _ in range(n)]
    with DatasetWriter(path, align=0, overwrite=overwrite, fsync=False) as w:
        for p in payloads:
            w.add(p, modality="bytes")
    return payloads


def _read_all(path: str) -> list[bytes]:
    ds = open_dataset(path)
    return [bytes(ds.read(i)) for i in range(ds.num_samples)]


def _siblings(path: str) -> list[str]:
    parent, name = os.path.split(path)
    return sorted(e for e in os.listdir(parent) if e.startswith(f".{name}."))


def test_open_dataset_renames_the_old_copy_back(tmp_path):
    path = str(tmp_path / "ds")
    payloads = _pack(path, seed=1)
    aside = _crash_aside(path)
    assert _read_all(path) == payloads
    assert not os.path.exists(aside) and _siblings(path) == []


def test_a_new_pack_recovers_first_and_does_not_replace_without_overwrite(tmp_path):
    path = str(tmp_path / "ds")
    payloads = _pack(path, seed=1)
    _crash_aside(path)
    with pytest.raises(FileExistsError, match="exists"):
        DatasetWriter(path)  # the data is back in place: a writer without overwrite leaves it alone
    assert _read_all(path) == payloads
    new = _pack(path, seed=2, overwrite=True)
    assert _read_all(path) == new and _siblings(path) == []


def test_stale_old_copies_beside_a_complete_dataset_are_removed(tmp_path):
    path = str(tmp_path / "ds")
    _pack(path, seed=1)
    new = _pack(str(tmp_path / "new"), seed=2)
    _crash_aside(path)  # the crash came after the second rename: the new copy is in place, the old one stayed
    os.rename(str(tmp_path / "new"), path)
    assert len(_siblings(path)) == 1
    assert _read_all(path) == new
    assert _siblings(path) == []


def test_the_old_copy_of_a_running_overwrite_is_not_touched(tmp_path):
    path = str(tmp_path / "ds")
    payloads = _pack(path, seed=1)
    aside = _crash_aside(path, pid=os.getpid())  # its writer still runs: it is between its two renames
    with pytest.raises(FormatError, match=rf"being overwritten by process {os.getpid()}.*old copy is at {aside}"):
        open_dataset(path)
    assert os.path.isdir(aside)
    os.rename(aside, path)
    assert _read_all(path) == payloads


def test_two_old_copies_and_no_dataset_name_both(tmp_path):
    path = str(tmp_path / "ds")
    _pack(path, seed=1)
    a = _crash_aside(path, token="aaaaaaaa")
    _pack(str(tmp_path / "other"), seed=2)
    os.rename(str(tmp_path / "other"), path)
    b = _crash_aside(path, token="bbbbbbbb")
    with pytest.raises(FormatError, match=rf"several old copies.*{a}.*{b}"):
        open_dataset(path)
    assert os.path.isdir(a) and os.path.isdir(b)


@contextlib.contextmanager
def _unwritable(directory: str):
    """No entry of ``directory`` can be renamed: read-only for a user, immutable (chattr +i) for root."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        undo = ["chmod", "755", directory]
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", directory], capture_output=True).returncode == 0:
        undo = ["chattr", "-i", directory]
    else:
        pytest.skip("cannot make a directory unwritable for root here (no chattr +i)")
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


def test_open_says_where_the_data_is_when_it_cannot_rename_it_back(tmp_path):
    path = str(tmp_path / "sub" / "ds")
    os.makedirs(os.path.dirname(path))
    _pack(path, seed=1)
    aside = _crash_aside(path)
    with _unwritable(os.path.dirname(path)):
        with pytest.raises(FormatError, match=rf"interrupted.*the data is at {aside}"):
            open_dataset(path)
    payloads = _read_all(path)  # once the directory is writable again, the open recovers it
    assert len(payloads) == 20 and not os.path.exists(aside)


@pytest.fixture()
def plan_setup(tmp_path):
    path = str(tmp_path / "ds")
    _pack(path, seed=1, n=40)
    ds = open_dataset(path)
    return ds, str(tmp_path / "plan")


def test_load_plan_and_save_plan_recover_an_interrupted_overwrite(plan_setup):
    ds, plan_dir = plan_setup
    first = build_plan([(ds, 1.0)], seed=1, global_batch_size=4, num_steps=5)
    first.save(plan_dir)
    _crash_aside(plan_dir)
    assert load_plan(plan_dir).digest == first.digest and _siblings(plan_dir) == []
    _crash_aside(plan_dir)
    second = build_plan([(ds, 1.0)], seed=2, global_batch_size=4, num_steps=5)
    with pytest.raises(PlanError, match="already exists"):
        second.save(plan_dir)  # recovered first, so not silently replaced without overwrite
    second.save(plan_dir, overwrite=True)
    assert load_plan(plan_dir).digest == second.digest and _siblings(plan_dir) == []


def test_a_plan_overwrite_leaves_nothing_beside_it(plan_setup):
    ds, plan_dir = plan_setup
    build_plan([(ds, 1.0)], seed=1, global_batch_size=4, num_steps=5).save(plan_dir)
    build_plan([(ds, 1.0)], seed=2, global_batch_size=4, num_steps=5).save(plan_dir, overwrite=True)
    assert _siblings(plan_dir) == []


def test_a_plan_aside_of_the_earlier_layout_is_recovered(plan_setup):
    """Earlier versions moved the old plan into ``.NAME.old-XXXXXXXX/plan`` (a temporary directory)."""
    ds, plan_dir = plan_setup
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=4, num_steps=5)
    plan.save(plan_dir)
    parent, name = os.path.split(plan_dir)
    trash = os.path.join(parent, f".{name}.old-k3x_9qzw")
    os.mkdir(trash)
    os.rename(plan_dir, os.path.join(trash, "plan"))
    assert load_plan(plan_dir).digest == plan.digest and _siblings(plan_dir) == []


def test_aside_path_names_the_writer(tmp_path):
    aside = aside_path(str(tmp_path / "x"))
    assert os.path.basename(aside).startswith(f".x.old-{os.getpid()}-")
    assert recover_overwrite(str(tmp_path / "x"), os.path.isdir) is None  # nothing to do
