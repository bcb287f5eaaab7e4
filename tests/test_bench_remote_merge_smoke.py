"""The remote-merge bench still runs end to end (``--smoke``: small checkpoint, 100 ms link, both urgent runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from installed import require

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "remote_merge.py")


def test_remote_merge_bench_smoke(tmp_path):
    require("etcd")
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--out", str(out), "--dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "merge latency reduction" in proc.stdout and "urgent evaluation" in proc.stdout
    data = json.loads((out / "remote_merge_smoke.json").read_text())
    m = data["merge"]
    assert m["outputs_identical"]
    assert m["baseline"]["round_trips"] > data["checkpoint"]["tensors"]  # one per chunk, split ones twice
    assert m["coalesced_remote"]["round_trips"] <= 4  # .metadata, a probe, one read per data file
    assert data["checkpoint"]["under_16KiB"] > 0.6 and data["checkpoint"]["bytes_in_large"] > 0.5
    assert data["replication"]["bytes"] > 0 and data["wan"]["rtt_ms_measured"] >= data["wan"]["rtt_ms"] - 2
    assert [r["lane"] for r in data["urgent"]] == ["fifo", "priority"]
    assert (out / "remote_merge_smoke.png").stat().st_size > 0
    assert not (tmp_path / "work").exists()  # scratch files cleaned up
