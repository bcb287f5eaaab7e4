"""The restart-storm bench still runs end to end (``--smoke``: 4 node processes, 64 ranks, 8 per host) and each mode
does what it claims: bytes the nodes served per host, hot-file fetches per host, extra bytes copied (only copies that
pay for their placement: at the smoke's sizes a 4th copy saves the readers less than placing it costs)."""
from __future__ import annotations

import json

from bench_presets import run_bench


def test_restart_storm_bench_smoke(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc, results = run_bench("restart_storm", "--smoke", "--dir", str(scratch), results=tmp_path / "results",
                              timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "default 3 copies" in proc.stdout and "loading-time reduction" in proc.stdout
    data = json.loads((results / "restart_storm_smoke.json").read_text())
    cfg = data["config"]
    ranks, per_host, nodes = cfg["ranks"], cfg["ranks_per_host"], cfg["nodes"]
    assert set(data["layouts"]) == {"fsdp7b", "shards16k"}
    for layout in data["layouts"].values():
        modes, hosts = layout["modes"], layout["hosts"]
        assert list(modes) == ["default", "reactive", "uniform", "host_cache", "hints", "foresight"]
        hot, shard, n_hot = layout["hot_bytes"], layout["shard_bytes"], len(layout["hot"])
        assert hosts * per_host == ranks and n_hot == 2  # .metadata and the replicated tensors' file
        for name, r in modes.items():  # every rank read the hot files and its shard, each verified
            assert r["reads"] == (n_hot + 1) * ranks and r["verify_failures"] == 0 and r["retries"] == 0, name
            assert r["total_s"] > 0 and 0 < r["slowest_5pct_share"] <= 1 and r["placement_error"] is None, name
            shared = name in ("host_cache", "foresight")
            # the nodes served each hot byte once per host with sharing, once per rank without
            assert r["node_bytes"] == (hosts if shared else ranks) * hot + ranks * shard, name
            assert r["hot_reads_per_host"] == n_hot * (1 if shared else per_host), name
            assert r["host_local_bytes"] == (hosts * hot if shared else 0), name
        assert modes["default"]["copy_bytes"] == 0 and modes["host_cache"]["copy_bytes"] == 0
        assert modes["uniform"]["copy_bytes"] == (min(5, nodes) - 3) * layout["ckpt_bytes"]
        for name in ("hints", "foresight", "reactive"):  # copies of the hot files only, those that pay
            r = modes[name]
            assert 0 <= r["copy_bytes"] <= (nodes - 3) * hot and r["place_s"] is not None, name
            files = r["files"]
            assert r["copy_bytes"] == sum((f["replicas"] - 3) * f["size"] for f in files), name
            for f in files:  # the formula's count, or (readers not held) the finish's, short of it only for a named cap
                assert f["sized_by"] == "finish", (name, f)  # the ranks are never held for the copies
                cap = min(f["wanted"], nodes) if f["sized_by"] == "formula" else nodes
                assert f["replicas"] == cap or f["capped_by"] == "placement_cost", (name, f)
        assert modes["reactive"]["detected_after_reads"] > 0  # hinted only once the storm had started
        readers = {f["path"]: f["readers"] for f in modes["foresight"]["files"]}
        assert readers == {f: hosts for f in layout["hot"]}  # one reader per host
        assert {f["readers"] for f in modes["hints"]["files"]} == {ranks}
        for name, r in modes.items():  # every mode's floor, from its bytes and reads, and the rounds behind the median
            f = r["floor"]
            assert f["node_bytes"] == r["node_bytes"] + (0 if name == "uniform" else r["copy_bytes"]), name
            assert f["node_reads"] == r["node_reads"], name
            assert f["floor_s"] == max(f["times_s"].values()) > 0 and r["bound"], name
            assert len(r["rounds_total_s"]) == cfg["repeats"] and r["spread_s"][0] <= r["total_s"] <= r["spread_s"][1]
        assert set(layout["foresight_vs"]) == set(modes) - {"foresight"}
    assert data["bed"].startswith(f"{nodes} nodes")
    assert data["title"] and [t["title"] for t in data["report"]] and all(t["rows"] for t in data["report"])
    assert (results / "restart_storm_smoke.png").stat().st_size > 0
    assert list(scratch.iterdir()) == []  # scratch files cleaned up
