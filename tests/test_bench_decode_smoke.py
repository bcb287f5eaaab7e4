"""The decode bench runs end to end in --smoke mode (so it never rots) and every method it ran is correct."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--smoke", "--clips-dir", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "clips/s" in proc.stdout
    result = json.loads((ROOT / "bench" / "results" / "decode_smoke.json").read_text())
    assert result["smoke"] is True and result["summary"]
    methods = {c["method"] for c in result["correctness"]}
    assert {"foresight", "pyav_start", "pyav_seek"} <= methods
    for check in result["correctness"]:
        assert check["wrong_frame"] == 0, check
    fs = [c for c in result["correctness"] if c["method"] == "foresight"]
    assert all(c["pixel_exact"] == c["frames"] for c in fs)
    for check in result["correctness"]:  # the timed 224x224 output of every method is checked too
        assert check["frames_224"] > 0 and check["wrong_frame_224"] == 0, check
    # foresight's timed 224x224 frames equal the independent reference (PyAV's own conversion) bit for bit
    assert all(c["pixel_exact_224"] == c["frames_224"] and c["max_abs_diff_224"] == 0 for c in fs), fs
    for m in ("decord", "tc_exact", "tc_approx", "tc_mapped"):  # an anchor runs or is listed as unavailable
        assert m in methods or m in result["skipped"]
