"""Every user error of the ``foresight`` commands is one line on stderr naming the path, with a non-zero exit.

Real commands in subprocesses on real files (a full disk is a 1 MiB tmpfs, where root may mount one).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from foresight.format import DatasetWriter, write_megatron_dataset
from full_disk import full_disk  # noqa: F401 (a fixture)


def run_cli(*args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FORESIGHT_DEBUG"}
    if debug:
        env["FORESIGHT_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", "foresight", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def one_line_error(res: subprocess.CompletedProcess, command: str, *named: str) -> str:
    """Assert the command failed with a single ``foresight COMMAND: error: ...`` line naming each of ``named``."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"foresight {command}: error: "), res.stderr
    for name in named:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": "word " * 300}) + "\n" for _ in range(2000)))  # ~3 MiB of text
    return path


def test_pack_to_an_unwritable_place(jsonl):
    one_line_error(run_cli("pack", "jsonl", str(jsonl), "/proc/x", "--no-progress"), "pack", "/proc/",
                   "No such file or directory")


def test_pack_onto_a_full_disk_names_the_shard_and_leaves_nothing(jsonl, full_disk):
    res = run_cli("pack", "jsonl", str(jsonl), str(full_disk / "out"), "--no-progress")
    one_line_error(res, "pack", "shard-00000.bin", "No space left on device", str(full_disk / "out"))
    assert os.listdir(full_disk) == []


def test_plan_out_under_a_file(tmp_path):
    write_megatron_dataset(tmp_path / "m", [np.arange(50, dtype=np.uint16)] * 10, np.uint16)
    (tmp_path / "somefile").write_text("")
    res = run_cli("plan", str(tmp_path / "m"), "--seed", "1", "--global-batch-size", "2", "--steps", "2",
                  "--seq-len", "8", "--out", str(tmp_path / "somefile" / "p"))
    one_line_error(res, "plan", str(tmp_path / "somefile"), "Not a directory")


def test_bad_argument_values(jsonl, tmp_path):
    res = run_cli("pack", "jsonl", str(jsonl), str(tmp_path / "o"), "--shard-bytes", "0", "--no-progress")
    one_line_error(res, "pack", "shard_bytes must be a positive integer")
    res = run_cli("plan", str(jsonl), str(jsonl), "--weights", "1", "--seed", "1", "--global-batch-size", "2",
                  "--steps", "2", "--out", str(tmp_path / "p"))
    one_line_error(res, "plan", "2 datasets but 1 weights")


def test_inspect_refuses_json_that_is_not_a_foresight_manifest(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "manifest.json").write_text(json.dumps({"format": "something-else", "shards": []}))
    one_line_error(run_cli("inspect", str(tmp_path / "d")), "inspect", "not a foresight-shards manifest",
                   str(tmp_path / "d" / "manifest.json"))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "plan.json").write_text(json.dumps({"a": 1}))
    one_line_error(run_cli("inspect", str(tmp_path / "p")), "inspect", str(tmp_path / "p" / "plan.json"))
    (tmp_path / "x.json").write_text("{}")
    one_line_error(run_cli("inspect", str(tmp_path / "x.json")), "inspect", str(tmp_path / "x.json"))
    # A real manifest is still printed.
    with DatasetWriter(tmp_path / "ds", fsync=False) as w:
        w.add(b"x", modality="bytes")
    res = run_cli("inspect", str(tmp_path / "ds"))
    assert res.returncode == 0 and json.loads(res.stdout)["num_samples"] == 1


def test_pack_media_of_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not media")
    res = run_cli("pack", "media", str(tmp_path / "empty"), str(tmp_path / "out"), "--no-progress")
    one_line_error(res, "pack", "no media files", str(tmp_path / "empty"))
    assert not (tmp_path / "out").exists()


def test_pack_megatron_refuses_an_inconsistent_pair(tmp_path):
    write_megatron_dataset(tmp_path / "a", [np.arange(40, dtype=np.uint16)] * 3, np.uint16)
    write_megatron_dataset(tmp_path / "b", [np.arange(90, dtype=np.uint16)] * 3, np.uint16)
    os.replace(tmp_path / "b.bin", tmp_path / "a.bin")
    res = run_cli("pack", "megatron", str(tmp_path / "a"), str(tmp_path / "out"), "--no-progress")
    one_line_error(res, "pack", str(tmp_path / "a.bin"), "does not belong")
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.idx"]


def test_debug_env_shows_the_traceback(tmp_path):
    res = run_cli("inspect", str(tmp_path / "missing"), debug=True)
    assert res.returncode != 0 and "Traceback" in res.stderr and "FormatError" in res.stderr
    res = run_cli("inspect", str(tmp_path / "missing"))
    one_line_error(res, "inspect", str(tmp_path / "missing"))
