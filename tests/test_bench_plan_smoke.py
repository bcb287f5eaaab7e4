"""The plan bench runs end to end (``--smoke``) and foresight's plan equals the numpy baseline's."""
from __future__ import annotations

import json
import os

from bench_presets import run_bench


def test_plan_build_bench_smoke(tmp_path):
    res, results = run_bench("plan_build", "--smoke", "--impls", "foresight,foresight-block,numpy",
                             results=tmp_path / "results")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "plan build" in res.stdout
    doc = json.loads((results / "plan_build_smoke.json").read_text())
    assert doc["machine"]["cpus"] == os.cpu_count()
    rows = {(r["kind"], r["impl"]): r for r in doc["rows"]}
    for kind in ("tokens", "media"):
        assert rows[(kind, "foresight")]["same_as_numpy"] is True
        assert rows[(kind, "foresight")]["items"] == rows[(kind, "numpy")]["items"] > 0
        assert rows[(kind, "foresight")]["build_s"] > 0 and rows[(kind, "foresight")]["mem_gib"] >= 0
