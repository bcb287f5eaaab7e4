"""The checkpoint bench still runs end to end (``--smoke``: tiny state dict, one run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from installed import require

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "checkpoint.py")


def test_checkpoint_bench_smoke(tmp_path):
    require("fio")  # its anchor: scripts/setup.sh installs it, so its figures must be there
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, BENCH, "--smoke", "--out", str(out), "--dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "foresight" in proc.stdout and "torch.save" in proc.stdout
    data = json.loads((out / "checkpoint_smoke.json").read_text())
    methods = data["results"][0]["methods"]
    assert {"torch.save", "dcp.save t1", "dcp.async_save t1", "dcp.async_save t2", "foresight"} <= set(methods)
    for m in methods.values():
        assert m["median"]["blocking"] > 0 and m["median"]["restore"] > 0 and m["median"]["first_total"] > 0
        assert len(m["samples"]["total"]) == 2  # first save and steady state are both measured
    res = data["results"][0]
    assert res["best_dcp_async"].startswith("dcp.async_save t")
    assert res["fio"]["own_config"] == {"bs": "8m", "numjobs": 4, "iodepth": 1,
                                        **{k: res["fio"]["own_config"][k] for k in ("write_Bps", "read_Bps", "own")}}
    assert (out / "checkpoint_smoke.png").stat().st_size > 0
    assert not (tmp_path / "work").exists()  # scratch files cleaned up
