"""The plan bench runs end to end (``--smoke``), foresight's plan equals the numpy baseline's, and the compact kind's
mixing and scale sections run."""
from __future__ import annotations

import json
import os

from bench_presets import run_bench


def test_plan_build_bench_smoke(tmp_path):
    res, results = run_bench("plan_build", "--smoke", "--impls", "foresight,foresight-block,numpy,foresight-compact",
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
    assert rows[("tokens", "foresight-compact")]["build_s"] > 0
    # mixing: the compact kind spreads corpus neighbours as the global shuffle does; the block shuffle does not
    mixing = {r["impl"]: r for r in doc["mixing"]}
    assert mixing["compact"]["within_5pct"] is True and mixing["block"]["within_5pct"] is False
    assert mixing["compact"]["share_maxdev"] <= 1 and mixing["global"]["pairs"] > 0
    scale = {r["impl"]: r for r in doc["compact_scale"]}
    assert scale["foresight-compact"]["seqs"] > 0 and scale["foresight-compact"]["window_seqs_per_s"] > 0
