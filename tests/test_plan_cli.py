"""Plans over real datasets from ``foresight.format`` and the ``foresight plan`` / ``inspect`` commands."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from foresight.plan import ArraySource, build_plan, load_plan

fmt = pytest.importorskip("foresight.format")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foresight", *args], capture_output=True, text=True, check=False)


def documents(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 60_000, int(k), dtype=np.uint16) for k in rng.integers(0, 200, n)]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    docs_a, docs_b = documents(1, 400), documents(2, 150)
    with fmt.DatasetWriter(str(root / "web"), token_dtype="uint16", align=0, fsync=False) as w:
        w.add_many(np.concatenate(docs_a), [len(d) for d in docs_a], modality="tokens")
    fmt.write_megatron_dataset(str(root / "code"), docs_b, np.uint16)
    return str(root / "web"), str(root / "code"), docs_a, docs_b


def test_plan_over_real_datasets_reads_back_the_token_stream(datasets):
    web, code, docs_a, docs_b = datasets
    a, b = fmt.open_dataset(web), fmt.open_dataset(code)
    seq_len = 64
    plan = build_plan([(a, 0.6), (b, 0.4)], seed=7, global_batch_size=8, seq_len=seq_len, num_steps=60)
    assert plan.dataset_fingerprints == [a.fingerprint, b.fingerprint]
    plan.check_sources([a, b])
    docs = [docs_a, docs_b]
    sets = [a, b]
    # Every item is seq_len + 1 real tokens, read back from the files by (sample, offset, length).
    for item in range(0, plan.num_items, 7):
        p = plan.pieces(item, item + 1)
        got = np.concatenate([
            np.frombuffer(sets[d].read(int(s)), dtype=np.uint16)[o : o + n]
            for d, s, o, n in zip(p.dataset, p.sample, p.offset, p.length)
        ])
        want = np.concatenate([docs[d][s][o : o + n] for d, s, o, n in zip(p.dataset, p.sample, p.offset, p.length)])
        assert len(got) == seq_len + 1
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="does not match"):
        plan.check_sources([b, a])


def test_plan_and_inspect_commands(datasets, tmp_path):
    web, code, *_ = datasets
    out = str(tmp_path / "plan")
    res = run_cli("plan", web, code, "--weights", "3", "1", "--seed", "5", "--global-batch-size", "8",
                  "--seq-len", "32", "--steps", "20", "--out", out)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["summary"]["num_steps"] == 20 and report["digest"] == load_plan(out).digest

    res = run_cli("inspect", out)
    assert res.returncode == 0 and json.loads(res.stdout)["inputs"]["seed"] == 5
    res = run_cli("inspect", out, "--step", "3", "--rank", "1", "--world-size", "2")
    step = json.loads(res.stdout)
    assert [i["item"] for i in step["items"]] == [28, 29, 30, 31]
    assert step["pieces"] == ["dataset", "sample", "offset", "length"]
    assert all(sum(length for *_, length in i["pieces"]) == 33 for i in step["items"])

    res = run_cli("inspect", web)
    assert res.returncode == 0 and "format_version" in json.loads(res.stdout)
    res = run_cli("inspect", code)
    assert res.returncode == 0 and json.loads(res.stdout)["kind"] == "megatron"

    # Errors are one clear line, not a traceback.
    res = run_cli("plan", web, "--seed", "1", "--global-batch-size", "8", "--steps", "3", "--out", out)
    assert res.returncode == 1 and "seq_len" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("inspect", out, "--step", "99")
    assert res.returncode == 1 and "step" in res.stderr
    res = run_cli("inspect", str(tmp_path / "missing"))
    assert res.returncode == 1 and "Traceback" not in res.stderr


def test_inspect_a_plan_without_datasets(tmp_path):
    out = str(tmp_path / "plan")
    build_plan([(ArraySource(np.full(50, 1000), tokens=False), 1)], seed=0, global_batch_size=5, epochs=1).save(out)
    res = run_cli("inspect", out, "--step", "0", "--no-verify")
    assert res.returncode == 0
    step = json.loads(res.stdout)
    assert step["kind"] == "samples" and len(step["items"]) == 5
    assert all(i["pieces"][0][3] == 1000 for i in step["items"])
