"""Tiers, drain, retention, stale-file cleanup, corruption detection and background error surfacing."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import foresight.checkpoint as fc
import pytest
import torch
from foresight.checkpoint import store
from foresight.errors import CheckpointError


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=g), "b": torch.randn(10, generator=g), "i": torch.tensor(seed)}


def test_drain_and_retention_per_tier(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with fc.Checkpointer([fast, slow], keep=[2, 3]) as ck:
        for s in range(1, 7):
            ck.save(state(s), s * 10).wait()
        ck.wait()  # retention is housekeeping that runs after each handle completes
        assert store.committed_steps(fast) == [50, 60]
        assert store.committed_steps(slow) == [40, 50, 60]
        assert ck.steps() == [40, 50, 60]
        got = ck.load("latest")
        assert got.tier == 0 and got.step == 60
        old = ck.load(40)  # only the durable tier still has it
        assert old.tier == 1 and torch.equal(old.state_dict["w"], state(4)["w"])
    shutil.rmtree(store.step_dir(fast, 60))
    got = fc.load("latest", tiers=[fast, slow])
    assert got.tier == 1 and got.step == 60 and torch.equal(got.state_dict["w"], state(6)["w"])


def test_handle_distinguishes_local_and_durable(tmp_path):
    with fc.Checkpointer([tmp_path / "a", tmp_path / "b"]) as ck:
        h = ck.save(state(1), 1)
        h.wait(durable=False)
        assert h.done(durable=False)
        h.wait()
        assert h.done() and store.committed_steps(str(tmp_path / "b")) == [1]


def test_retention_keeps_newest_and_resave_replaces(tmp_path):
    with fc.Checkpointer(tmp_path, keep=1) as ck:
        ck.save(state(1), 1).wait()
        ck.save(state(2), 2).wait()
        ck.wait()
        assert store.committed_steps(str(tmp_path)) == [2]
        ck.save(state(3), 2).wait()  # same step again: replaced atomically
        assert torch.equal(ck.load(2).state_dict["w"], state(3)["w"])
    assert store.apply_retention(str(tmp_path), 1) == []


def test_stale_temp_dirs_removed_and_interrupted_replace_undone(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(root, f".tmp-step-00000002.{socket.gethostname()}.{dead.pid}.deadbeef")
    live = os.path.join(root, f".tmp-step-00000003.{socket.gethostname()}.{os.getpid()}.cafecafe")
    os.makedirs(stale)
    os.makedirs(live)
    # a crash between the two renames of a replace: the old copy sits in the trash, the new one is absent
    os.rename(store.step_dir(root, 1), os.path.join(root, ".trash-step-00000001.0123abcd"))
    assert store.committed_steps(root) == []
    with fc.Checkpointer(root) as ck:
        assert not os.path.exists(stale) and os.path.exists(live)
        assert ck.steps() == [1]
        assert torch.equal(ck.load(1).state_dict["w"], state(1)["w"])


def test_uncommitted_dir_is_ignored_then_cleaned(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
        ck.save(state(2), 2).wait()
    os.remove(os.path.join(store.step_dir(root, 2), store.COMMIT))  # COMMIT lost
    assert fc.latest_step(root=root) == 1
    assert fc.load("latest", root=root).step == 1
    foreign = os.path.join(root, "step-7")  # another tool's directory that happens to match the pattern
    os.makedirs(foreign)
    open(os.path.join(foreign, ".metadata"), "w").close()
    with pytest.warns(RuntimeWarning, match="no COMMIT marker"):
        fc.Checkpointer(root).close()  # moved aside (test_checkpoint_recovery covers the details)
    assert not os.path.exists(store.step_dir(root, 2)) and store.committed_steps(root) == [1]
    assert os.path.exists(os.path.join(foreign, ".metadata"))  # left alone


def test_pending_save_finishes_at_interpreter_exit(tmp_path):
    code = ("import torch, foresight.checkpoint as fc\n"
            f"fc.save({{'w': torch.arange(1 << 20, dtype=torch.float32)}}, 3, root={str(tmp_path)!r})\n")
    subprocess.run([os.sys.executable, "-c", code], check=True, timeout=120)  # exits without wait()
    got = fc.load("latest", root=tmp_path)
    assert got.step == 3 and torch.equal(got.state_dict["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_corrupt_data_names_file_and_tensor(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
    path = store.step_dir(root, 1)
    index = json.load(open(os.path.join(path, store.INDEX)))
    i = index["tensors"]["name"].index("w")
    data = os.path.join(path, "data-00000.bin")
    with open(data, "r+b") as f:
        f.seek(index["tensors"]["offset"][i] + 1234)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match="checksum mismatch") as ei:
        fc.load(1, root=root)
    assert "tensor=w" in str(ei.value) and "data-00000.bin" in str(ei.value)
    # without verification the corrupt bytes load (explicit opt-out)
    assert fc.load(1, root=root, verify=False).step == 1


def test_corrupt_index_and_truncated_data(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        ck.save(state(1), 1).wait()
        ck.save(state(2), 2).wait()
    idx = os.path.join(store.step_dir(root, 1), store.INDEX)
    body = bytearray(open(idx, "rb").read())
    body[len(body) // 2] ^= 0x01
    open(idx, "wb").write(bytes(body))
    with pytest.raises(CheckpointError, match="index checksum mismatch") as ei:
        fc.load(1, root=root)
    assert "index.json" in str(ei.value)
    data = os.path.join(store.step_dir(root, 2), "data-00000.bin")
    os.truncate(data, 4096)
    with pytest.raises(CheckpointError, match="truncated"):
        fc.load(2, root=root)


def _rewrite_commit(path: str, edit) -> str:
    marker_path = os.path.join(path, store.COMMIT)
    raw = open(marker_path, "rb").read()
    open(marker_path, "wb").write(edit(raw))
    return marker_path


def test_corrupt_commit_marker_is_named_not_the_index(tmp_path):
    root = str(tmp_path)
    with fc.Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(state(step), step).wait()

    def flip_digest(raw: bytes) -> bytes:  # still valid JSON: one hex digit of the index checksum changed
        marker = json.loads(raw)
        d = marker["index_xxh3"]
        marker["index_xxh3"] = ("1" if d[0] != "1" else "2") + d[1:]
        return json.dumps(marker).encode()

    for step, edit in ((1, flip_digest), (2, lambda raw: raw[: len(raw) // 2])):
        marker_path = _rewrite_commit(store.step_dir(root, step), edit)
        with pytest.raises(CheckpointError, match="COMMIT marker is corrupt") as ei:
            fc.load(step, root=root)
        assert marker_path in str(ei.value) and store.INDEX not in str(ei.value)
    # the index itself damaged, under an intact marker: the index is named
    idx = os.path.join(store.step_dir(root, 3), store.INDEX)
    open(idx, "ab").write(b" ")
    with pytest.raises(CheckpointError, match="index is corrupt") as ei:
        fc.load(3, root=root)
    assert idx in str(ei.value)
    # retention never deletes a commit whose marker it cannot read (its age is unknown)
    assert store.apply_retention(root, 1) == []


def test_latest_passes_over_a_corrupt_marker_with_a_warning(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with fc.Checkpointer([fast, slow]) as ck:
        ck.save(state(1), 1).wait()
        ck.save(state(2), 2).wait()
    _rewrite_commit(store.step_dir(fast, 2), lambda raw: b"{")
    with pytest.warns(RuntimeWarning, match="ignoring .*fast/step-00000002"):
        got = fc.load("latest", tiers=[fast, slow])  # the durable copy of the same commit
    assert got.step == 2 and got.tier == 1 and torch.equal(got.state_dict["w"], state(2)["w"])
    _rewrite_commit(store.step_dir(slow, 2), lambda raw: b"{")
    with pytest.warns(RuntimeWarning, match="COMMIT marker is corrupt"):
        assert fc.latest_step(tiers=[fast, slow]) == 1


def test_corrupt_fast_tier_falls_back_to_durable(tmp_path):
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with fc.Checkpointer([fast, slow]) as ck:
        ck.save(state(5), 5).wait()
    data = os.path.join(store.step_dir(fast, 5), "data-00000.bin")
    with open(data, "r+b") as f:
        f.write(b"\xff" * 64)
    got = fc.load(5, tiers=[fast, slow])
    assert got.tier == 1 and torch.equal(got.state_dict["w"], state(5)["w"])


def test_background_error_surfaces_on_wait_and_next_save(tmp_path):
    root = tmp_path / "root"
    ck = fc.Checkpointer(root)
    try:
        ck.save(state(1), 1).wait()
        shutil.rmtree(root)
        root.write_text("the tier root became a file")  # every later write fails
        h = ck.save(state(2), 2)
        with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
            h.wait()
        h3 = ck.save(state(3), 3)  # nobody waits on this one ...
        while not h3.done():
            time.sleep(0.01)
        with pytest.raises(CheckpointError):  # ... so the next save reports it
            ck.save(state(4), 4)
        root.unlink()
        root.mkdir()
        ck.save(state(5), 5).wait()  # recovers once the path is usable again
        assert ck.steps() == [5]
    finally:
        ck.close()


def test_disk_full_surfaces(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here")
    try:
        with fc.Checkpointer(mnt) as ck:
            h = ck.save({"w": torch.zeros(1 << 20)}, 1)  # 4 MiB into 1 MiB
            with pytest.raises(CheckpointError) as ei:
                h.wait()
            assert "data-00000.bin" in str(ei.value)
            assert fc.latest_step(root=mnt) is None
            assert not [n for n in os.listdir(mnt) if n.startswith(".tmp")]  # failed attempt cleaned up
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
