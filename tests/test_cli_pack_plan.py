"""``foresight pack`` / ``plan`` as a new user types them: the default kind, the default seed, untokenized text."""
from __future__ import annotations

import json

from cli_helpers import run_cli
from foresight.plan import load_plan


def write_jsonl(path, n: int = 50) -> None:
    path.write_text("".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(n)))


def test_pack_without_a_kind_is_auto_and_warns_once_about_raw_text(tmp_path):
    write_jsonl(tmp_path / "text.jsonl")
    res = run_cli("pack", "text.jsonl", "out/", "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "packed 50 samples" in res.stdout
    warnings = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("foresight warning: "), res.stderr
    assert "'text'" in warnings[0] and "--tokenizer" in warnings[0]
    # An explicit kind still works, and a token column packs without the warning.
    (tmp_path / "tok.jsonl").write_text("".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(5)))
    res = run_cli("pack", "jsonl", "tok.jsonl", "tok/", "--no-progress", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_plan_with_seq_len_over_raw_text_says_re_pack_with_a_tokenizer(tmp_path):
    write_jsonl(tmp_path / "text.jsonl")
    assert run_cli("pack", "text.jsonl", "out", "--no-progress", cwd=tmp_path).returncode == 0
    res = run_cli("plan", "out", "--global-batch-size", "4", "--seq-len", "16", "--steps", "2", "--out", "plan",
                  cwd=tmp_path)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "re-pack with --tokenizer" in lines[0] and "out" in lines[0], res.stderr
    assert not (tmp_path / "plan").exists()


def test_plan_seed_defaults_to_0_printed_and_stored(tmp_path):
    write_jsonl(tmp_path / "text.jsonl")
    assert run_cli("pack", "text.jsonl", "out", "--no-progress", cwd=tmp_path).returncode == 0
    res = run_cli("plan", "out", "--global-batch-size", "4", "--steps", "3", "--out", "plan", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "seed 0 (the default" in res.stderr
    assert json.loads(res.stdout)["inputs"]["seed"] == 0
    assert load_plan(str(tmp_path / "plan")).inputs["seed"] == 0
    res = run_cli("plan", "out", "--global-batch-size", "4", "--steps", "3", "--out", "plan2", "--seed", "7",
                  cwd=tmp_path)
    assert res.returncode == 0 and "seed" not in res.stderr and json.loads(res.stdout)["inputs"]["seed"] == 7
