"""The restart-storm bench still runs end to end (``--smoke``: 4 node processes, 256 ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "restart_storm.py")


def test_restart_storm_bench_smoke(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--out", str(out), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "default 3 replicas" in proc.stdout and "loading-time reduction" in proc.stdout
    data = json.loads((out / "restart_storm_smoke.json").read_text())
    d, h = data["default"], data["hinted"]
    for r in (d, h):  # every rank read the hot files and its shard, each verified
        assert r["reads"] == 3 * data["config"]["ranks"] and r["verify_failures"] == 0
        assert r["total_s"] > 0 and 0 < r["slowest_5pct_share"] <= 1
    assert len(d["reads_by_node"]) <= data["config"]["nodes"]
    cost = data["replicas"]
    assert cost["new_replicas"] > 0 and cost["copy_bytes"] > 0 and cost["copy_failures"] == 0
    hot = {f["path"]: f for f in cost["files"]}
    assert hot[".metadata"]["replicas"] == data["config"]["nodes"]  # 256 readers / 64 safe -> 4, all the nodes
    assert data["title"] and [t["title"] for t in data["report"]] and all(t["rows"] for t in data["report"])
    assert (out / "restart_storm_smoke.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # scratch files cleaned up
