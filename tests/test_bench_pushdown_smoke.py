"""The pushdown bench runs end to end in --smoke mode (so it never rots), and its modes do what they claim."""
from __future__ import annotations

import json

from bench_presets import run_bench


def test_bench_pushdown_smoke(tmp_path):
    proc, results = run_bench("pushdown", "--smoke", "--data-dir", str(tmp_path / "data"),
                              results=tmp_path / "results", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pushdown bench" in proc.stdout
    result = json.loads((results / "pushdown_smoke.json").read_text())
    assert {r["scenario"] for r in result["rows"]} == {"idle", "shared"}
    assert result["calibration"]["decode_step_s"] > 0 and result["compute_s"] > 0  # the compute step was calibrated
    for scenario in ("idle", "shared"):
        rows = {r["mode"]: r for r in result["rows"] if r["scenario"] == scenario}
        assert set(rows) == {"torch", "host", "pushdown", "guard", "guard_defer"} and result["smoke"] is True
        assert all(r["steps"] == result["steps"] for r in rows.values())
        assert rows["pushdown"]["remote_samples"] > 0 and rows["pushdown"]["raw_samples"] == 0
        assert rows["guard"]["raw_samples"] > 0 and rows["guard"]["remote_samples"] == 0
        defer = rows["guard_defer"]
        assert defer["deferred_samples"] > 0 and defer["raw_samples"] == defer["remote_samples"] == 0
        assert rows["host"]["wire_mb"] == 0 and rows["pushdown"]["wire_mb"] > 0
        # the loader reads none of the node's samples; deferred ones the host reads itself
        assert rows["pushdown"]["host_read_mb"] == 0 and rows["guard"]["host_read_mb"] == 0
        assert defer["host_read_mb"] > 0 and defer["wire_mb"] < rows["guard"]["wire_mb"]
        assert {"stall_reduction_pct", "p99_reduction_pct", "host_cpu_reduction_pct",
                "guard_wall_vs_host", "guard_defer_wall_vs_host"} <= set(result["summary"][scenario])
