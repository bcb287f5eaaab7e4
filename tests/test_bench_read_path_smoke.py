"""The read-path benches run end to end (``--smoke``) so they never rot; figures are not checked, only shape."""
from __future__ import annotations

import json

import pytest
from bench_presets import run_bench
from installed import require


def test_read_path_smoke(tmp_path):
    require("fio")  # an anchor scripts/setup.sh installs: its rows must be there
    proc, results = run_bench("read_path", "--smoke", results=tmp_path / "results", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "read path" in proc.stdout and "targets" in proc.stdout
    result = json.loads((results / "read_path_smoke.json").read_text())
    assert result["smoke"] and result["machine"]["cpus"]
    methods = {r["method"] for r in result["rows"]}
    assert {"fs-uring", "fs-uring-nocoal", "fs-pread", "fs-uring-block", "torch-dl", "torch-dl-block", "memmap",
            "memmap-block"} <= methods
    # every anchor comes from a printed sweep of its knobs; block-local rows are only compared with block anchors
    sweep = result["anchor_sweep"]
    assert any(r["anchor"] == "fio" for r in sweep)
    # the Loader's prefetch is swept like an anchor's knobs, and its rows run at the best one
    loader_sweep = [r for r in sweep if r["anchor"] == "fs-uring"]
    assert {r["mode"] for r in loader_sweep} == {"cold", "warm"} and all(r["prefetch"] >= 1 for r in loader_sweep)
    assert all("prefetch=" in r["config"] for r in result["rows"] if r["method"].startswith("fs-"))
    assert {"batched", "workers", "prefetch_factor"} <= set(next(r for r in sweep if r["anchor"] == "torch-dl"))
    assert any(r["direct"] for r in sweep if r["anchor"] == "torch-dl" and r["mode"] == "cold")
    assert all(r["config"] for r in result["rows"] if r["method"].startswith(("torch-dl", "memmap")))
    assert all("x_fio_bw" not in r for r in result["rows"] if r["method"].endswith("-block"))
    for row in result["rows"]:
        assert not row["errors"], row
        assert row["samples_per_s"] > 0 and row["mb_per_s"] > 0 and row["cpu_s_per_gb"] >= 0
    block = [r for r in result["rows"] if r["method"] == "fs-uring-block"]
    assert block and all(r["ios_per_sample"] < 1 for r in block)  # a block-local step coalesces
    nocoal = [r for r in result["rows"] if r["method"] == "fs-uring-nocoal"]
    assert nocoal and all(r["ios_per_sample"] == 1 for r in nocoal)
    assert result["sweep"] and result["best_coalescing"]
    assert (results / "read_path_smoke.png").stat().st_size > 0


def test_gpu_handoff_smoke(tmp_path):
    torch = pytest.importorskip("torch")
    proc, results = run_bench("gpu_handoff", "--smoke", results=tmp_path / "results", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "gpu_handoff_smoke.json").read_text())
    if not torch.cuda.is_available():
        assert "gpu_handoff: skipped (no CUDA device)" in proc.stdout
        assert result["skipped"] is True
    else:
        assert not result["skipped"] and result["containment"]["inside_slot"]
        assert result["cuda_rows_match_cpu"] and result["h2d"]


def test_gpu_handoff_arena_containment_on_cpu(tmp_path):
    """The zero-copy claim (batch tensors view the arena slot the engine read into) holds without a GPU too."""
    pytest.importorskip("torch")
    proc, results = run_bench("gpu_handoff", "--smoke", "--cpu-check", results=tmp_path / "results", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((results / "gpu_handoff_smoke.json").read_text())
    c = result["containment"]
    assert c["inside_slot"] and c["slot"] is not None
    assert c["offset_in_slot"] + c["tensor_bytes"] <= c["slot_bytes"]
