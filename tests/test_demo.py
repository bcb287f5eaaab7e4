"""The README's main job runs end to end (short), and its resumed run is bit-exact."""
from __future__ import annotations

import json
import subprocess
import sys


def test_demo_runs_and_resumes_bit_exact(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "foresight", "demo", "--out", str(out), "--steps", "8"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = json.loads((out / "demo.json").read_text())
    assert measured["resume bit-exact"] is True
    assert measured["loader"]["steps"] == 8
    assert set(measured["media decode (s) by modality"]) >= {"image", "video"}
    # the demo serves its media through a storage node process and gets the host's tensors
    assert measured["node tensors equal host's"] is True
    assert measured["node"]["samples_remote"] > 0 and measured["node"]["parts_failed"] == 0
