"""Turns each bench's result JSON into the tables of BENCHMARKS.md: our figure, the anchors measured in the same run,
and the source paper's figure where there is one.

One summarizer per bench, registered in ``SUMMARIZERS``: ``summarize(name, payload) -> Section``. A summarizer only
reads the JSON; nothing here measures. Example::

    from report import render
    text = render({"read_path": json.load(open("bench/reference/quick/read_path.json"))}, preset="quick", ...)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# The source paper's results (shared/seeds/000_*), quoted beside ours where a bench measures the same mechanism.
PAPER = {
    "remote_merge": "76.1% lower merge latency (89.3% and 70.8% on two jobs)",
    "restart_storm": "40.8% lower checkpoint loading time (38.48 s -> 22.78 s at 2,048 GPUs)",
    "pushdown_stall": "63.2% fewer transformation stalls",
    "pushdown_p99": "85.7% lower P99 data-loading latency",
    "pushdown_cpu": "94% less data-loading CPU on the training hosts",
}


@dataclass
class Section:
    title: str
    command: str = ""
    notes: list[str] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list]]] = field(default_factory=list)  # (caption, header, rows)
    plots: list[str] = field(default_factory=list)  # file names under docs/bench/


def fmt(v) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


# -- per bench --------------------------------------------------------------------------------------------------


def read_path(payload: dict) -> Section:
    s = Section("Read path: random sample reads, foresight vs the best DataLoader, memmap and fio")
    s.notes.append(f"{payload['runs']} run(s) per method (median, spread shown), dataset "
                   f"{payload['dataset_bytes'] / 2**30:.0f} GiB per size; anchors chosen by a sweep of their knobs "
                   f"({payload.get('anchor_runs')} run(s) per configuration)")
    rows = [[r["size"], r["mode"], r["method"], r.get("samples_per_s"), r.get("mb_per_s"), r.get("mb_per_s_spread"),
             r.get("cpu_s_per_gb"), r.get("ios_per_sample"), r.get("x_fio_bw"), r.get("x_dl_sps"), r.get("x_dl_cpu"),
             r.get("config")] for r in payload["rows"]]
    s.tables.append(("per method (x_* = ratio to the anchor of the same order and cache state)",
                     ["size", "cache", "method", "samples/s", "MB/s", "MB/s spread", "CPU-s/GB", "I/Os per sample",
                      "x fio", "x DataLoader samples/s", "x DataLoader CPU", "anchor config"], rows))
    best = {}
    for r in payload.get("anchor_sweep") or []:
        key = (r["size"], r["mode"], r["anchor"])
        if r.get("mb_per_s") and r["mb_per_s"] > best.get(key, {}).get("mb_per_s", -1):
            best[key] = r
    s.tables.append(("knob sweeps: the best configuration of each anchor, and the Loader's (prefetch)",
                     ["size", "cache", "anchor", "best config", "MB/s", "configs tried"],
                     [[k[0], k[1], k[2], v["config"], v["mb_per_s"],
                       sum(1 for r in payload["anchor_sweep"] if (r["size"], r["mode"], r["anchor"]) == k)]
                      for k, v in best.items()]))
    s.tables.append(("targets", ["target", "goal", "value", "met", "detail"],
                     [[t["target"], t["goal"], t["value"], t["met"], t["detail"]] for t in payload["targets"]]))
    return s


def read_path_tokens(payload: dict) -> Section:
    s = Section("Read path, tokens: the Loader over a compact plan beside the same plan materialized")
    load = [(payload["machine"].get(k) or [None])[0] for k in ("load_avg_start", "load_avg_end")]
    s.notes.append(f"{payload['dataset_bytes'] / 2**20:g} MiB uint16 token dataset, {payload['run_bytes'] / 2**20:g} "
                   f"MiB per run; both kinds interleaved run by run (medians); 1-minute load average {load[0]:.1f} "
                   f"at the start, {load[1]:.1f} at the end")
    s.tables.append(("tokens per second", ["cache", "plan", "runs", "tokens/s", "CPU-s per Gtoken", "x materialized"],
                     [[r["mode"], r["plan"], r["runs"], r["tokens_per_s"], r["cpu_s_per_gtoken"],
                       r.get("x_materialized")] for r in payload["rows"]]))
    ratios = [f"{r['mode']} {r['x_materialized']:.2f}x" for r in payload["rows"]
              if r["plan"] == "compact" and r.get("x_materialized") is not None]
    if ratios:
        s.notes.append(f"target (issue 23): the loader's throughput unchanged with the compact kind: "
                       f"{', '.join(ratios)} the materialized plan's")
    return s


def object_store(payload: dict) -> Section:
    s = Section("Object store: training from a bucket, fetched ahead by the plan, cached by its future")
    sets = ", ".join(f"{d['kind']} {d['samples']} samples ({d['bytes'] / 2**20:.0f} MiB, {d['steps']} steps)"
                     for d in payload["datasets"])
    s.notes.append(f"SeaweedFS on loopback behind the WAN bed's delaying proxy ({payload['mbit']:g} Mbit/s shared "
                   f"pipe; round trips {', '.join(f'{r:g}' for r in payload['rtts_ms'])} ms); {sets}; "
                   f"{payload['runs']} run(s) per method, the median row shown")
    spans = payload.get("anchor_steps") or {}
    spans = spans if isinstance(spans, dict) else {d["kind"]: spans for d in payload["datasets"]}
    for kind, steps in spans.items():
        if steps:
            s.notes.append(f"the per-sample anchors (dl-boto3, s3torch) on {kind} over a span of {steps} steps: a "
                           f"pass of workers + {steps} steps less a pass of workers steps, both from the plan's "
                           f"start (the config column says which): their samples/s, CPU and link floor are the "
                           f"span's own, their start left out, their time to the first batch its own figure")
    if payload.get("sweep_once") or (payload.get("mosaic_sweep_fraction") or 1) < 1:
        s.notes.append("sweeps (worker counts; Mosaic's workers and predownload"
                       + (f", each point over the first {payload['mosaic_sweep_fraction']:.0%} of its epoch"
                          if (payload.get("mosaic_sweep_fraction") or 1) < 1 else "") + ")"
                       + (" run at the first round trip only, the config they chose run at every round trip"
                          if payload.get("sweep_once") else ""))
    s.tables.append(("per method (x link floor: the epoch's time over the plan's bytes / the link's rate)",
                     ["dataset", "RTT ms", "method", "samples/s", "x link floor", "requests/sample",
                      "bytes / plan's", "CPU-s/GB", "first batch s", "config"],
                     [[r["dataset"], r["rtt_ms"], r["method"], r.get("samples_per_s"), r.get("x_floor"),
                       r.get("requests_per_sample"), r.get("bytes_ratio"), r.get("cpu_s_per_gb"),
                       r.get("first_batch_s"), r.get("config")]
                      for r in payload["rows"]]))
    s.tables.append(("cache hit rate at a budget (the plan replayed for several epochs)",
                     ["dataset", "budget", "epochs", "foresight (live)", "foresight (replay)", "LRU",
                      "offline optimum", "Mosaic's shard cache"],
                     [[h["dataset"], f"{100 * h['budget_fraction']:g}%", h["epochs"], h["foresight_live"],
                       h["foresight_replay"], h["lru"], h["optimum"], h.get("mosaic_shards")]
                      for h in payload["hit_rates"]]))
    s.tables.append(("targets (issue 22; ceiling: the most any method can reach over that anchor on this link, "
                     "its epoch over the link floor)", ["target", "where", "value", "met", "ceiling"],
                     [[t["target"], t["where"], t["value"], t["met"], t.get("ceiling")] for t in payload["targets"]]))
    return s


def checkpoint(payload: dict) -> Section:
    s = Section("Checkpoints: training-blocking time, durable write, cold restore")
    for res in payload["results"]:
        rows = []
        for name, m in res["methods"].items():
            md = m["median"]
            rows.append([name + (" (best of sweep)" if name in (res.get("best_dcp_async"), res.get("best_dcp_save"))
                                 else ""), md["first_blocking"], md["first_total"], md["blocking"], md["total"],
                         md["blocking_vs_torch_save"], md["write_GBps"], md["restore"], md["restore_GBps"]])
        if res.get("fio"):
            for label, cfg in (("fio best write", res["fio"]["best_write"]), ("fio best read", res["fio"]["best_read"]),
                               ("fio at foresight's 8 MiB x 4", res["fio"]["own_config"])):
                rows.append([f"{label} ({cfg['bs']}, {cfg['numjobs']} jobs, QD {cfg['iodepth']})", None, None, None,
                             None, None, cfg["write_Bps"] / 1e9, None, cfg["read_Bps"] / 1e9])
        s.tables.append((f"{res['bytes'] / 2**30:.2f} GiB state ({res['tensors']} tensors), steady state = median "
                         f"of saves 2..{res['runs']}",
                         ["method", "1st save blocking s", "1st save total s", "blocking s", "total s",
                          "blocking / torch.save", "write GB/s", "restore s", "restore GB/s"], rows))
    s.notes += payload.get("verdicts", [])
    return s


def decode(payload: dict) -> Section:
    s = Section("Video decode: 8 frames over 4 s windows at 224x224")
    methods = [m for m in ("foresight", "pyav_start", "pyav_seek", "decord", "tc_exact", "tc_approx", "tc_mapped")]
    s.tables.append(("clips/s (median); vs_best_anchor = foresight / the fastest anchor",
                     ["clip", "threads", *methods, "vs best anchor", "best anchor"],
                     [[r["clip"], r["threads"], *[r.get(m) for m in methods], r.get("vs_best_anchor"),
                       r.get("best_anchor")] for r in payload["summary"]]))
    s.tables.append(("correctness of the timed 224x224 output and of native-resolution frames",
                     ["clip", "method", "frames", "wrong frame (native)", "wrong frame (224, timed)",
                      "mean abs diff (224)"],
                     [[c["clip"], c["method"], c["frames"], c["wrong_frame"], c.get("wrong_frame_224"),
                       c.get("mean_abs_diff_224")] for c in payload["correctness"]]))
    if payload.get("skipped"):
        s.notes.append(f"unavailable anchors (not compared): {payload['skipped']}")
    s.notes.append(f"{payload['samples_per_run']} windows per run, {payload['repeats']} repeats")
    return s


def _same_work_ratios(row: dict) -> list:
    """vs numpy / vs megatron-core, only where both build the same arrays: the compact kind computes steps on
    demand and materializes none, so a ratio of its build to theirs compares different work."""
    if "compact" in row["impl"]:
        return [None, None]
    return [row.get("vs_numpy"), row.get("vs_megatron")]


def plan_build(payload: dict) -> Section:
    s = Section("Plan build: time and memory")
    s.tables.append((f"median of {payload['repeats']}; vs_* = the other builder's time / ours",
                     ["kind", "samples", "builder", "build s", "vs numpy (same shuffle)", "vs megatron-core",
                      "memory GiB", "same as numpy", "what it computes"],
                     [[r["kind"], r["samples"], r["impl"], r.get("build_s"), *_same_work_ratios(r),
                       r.get("mem_gib"), r.get("same_as_numpy"), r.get("does") or r.get("note")]
                      for r in payload["rows"]]))
    mixing = payload.get("mixing") or []
    if mixing:
        s.tables.append(("mixing on one corpus (docs/formats.md, \"Mixing statistics\"): distance = mean sequence "
                         "distance of corpus-adjacent documents / sequences (uniform: 1/3); target: the compact kind "
                         "within 5% of the global shuffle",
                         ["order", "distance", "distance vs global", "within 5%", "same or adjacent sequence",
                          "source share std per step"],
                         [[r["impl"], r.get("distance"), r.get("distance_vs_global"), r.get("within_5pct"),
                           r.get("near"), r.get("share_std") if "distance" in r else r.get("note")]
                          for r in mixing]))
    scale = payload.get("compact_scale") or []
    if scale:
        s.tables.append(("compact plan at scale (seq_len 8,192, batch 512) beside megatron-core's GPTDataset indexes; "
                         "targets: <= 1 byte/seq resident, build <= 60 s at 1.8B sequences on 2 cores, open to first "
                         "step <= 0.5 s, a random step <= 1 ms, a 10,000-step window >= 1M seq/s per core",
                         ["builder", "sequences", "bytes/seq", "build s", "open s", "random step ms (fresh)",
                          "random step ms (cold)", "window seq/s", "window seq/CPU-s", "note"],
                         [[r["impl"], f"{r.get('seqs', r['seqs_target']):,}", r.get("bytes_per_seq"), r.get("build_s"),
                           r.get("open_s"), r.get("step_fresh_ms_median"), r.get("step_cold_ms_median"),
                           r.get("window_seqs_per_s"), r.get("window_seqs_per_cpu_s"), r.get("note")]
                          for r in scale]))
        top = max((r for r in scale if r["impl"] == "foresight-compact" and "build_s" in r),
                  key=lambda r: r["seqs"], default=None)
        compact_mix = next((r for r in mixing if r["impl"] == "compact" and "within_5pct" in r), None)
        if top:
            cold = top.get("step_cold_ms_median")
            checks = [("bytes/seq", top["bytes_per_seq"], top["bytes_per_seq"] <= 1),
                      ("build s", top["build_s"], top["build_s"] <= 60),
                      ("open s", top["open_s"], top["open_s"] <= 0.5),
                      ("random step ms (cold)", cold, cold is not None and cold <= 1),
                      ("window seq/CPU-s", top["window_seqs_per_cpu_s"], top["window_seqs_per_cpu_s"] >= 1e6)]
            if compact_mix:
                checks.append(("mixing distance vs global", compact_mix["distance_vs_global"],
                               compact_mix["within_5pct"]))
            s.notes.append(f"issue 23's targets at {top['seqs']:,} sequences: " + "; ".join(
                f"{name} {fmt(v)} ({'met' if ok else 'NOT met'})" for name, v, ok in checks))
    return s


def gpu_handoff(payload: dict) -> Section:
    s = Section("GPU handoff: pinned arena to GPU")
    if payload.get("skipped"):
        s.notes.append("not measured in this run: no CUDA device on this machine (bench/gpu_device.sh runs it on one)")
        return s
    s.tables.append(("host-to-device copies", list(payload["h2d"][0].keys()),
                     [list(r.values()) for r in payload["h2d"]]))
    return s


def remote_merge(payload: dict) -> Section:
    s = Section("Remote merge at an evaluation site (predictive replication)")
    w, c, m, r = payload["wan"], payload["checkpoint"], payload["merge"], payload["replication"]
    s.notes.append(f"link: {w['kind']}, RTT {w['rtt_ms_measured']:.1f} ms measured ({w['rtt_ms']:.0f} ms set), "
                   f"{w['mbit_per_direction']:.0f} Mbit/s per direction; checkpoint {c['tensors']} tensors "
                   f"({100 * c['under_16KiB']:.0f}% under 16 KiB), {c['bytes'] / 2**20:.1f} MiB "
                   f"({100 * c['bytes_in_large']:.0f}% of bytes in large tensors), {c['ranks']} ranks")
    s.notes.append(f"merge latency reduction vs per-tensor remote reads: {100 * m['reduction']:.1f}% (target >= 90%); "
                   f"commit -> merged: {100 * m['end_to_end_reduction']:.1f}%; every merge's output equals the saved state: "
                   f"{m.get('outputs_match_saved_state', m.get('outputs_identical'))}")
    s.notes.append(f"commit -> replica ready: {r['commit_to_ready_s']:.2f} s ({r['bytes'] / 2**20:.1f} MiB in "
                   f"{r['units']} units)")
    rows = [["baseline: each tensor read remotely", m["baseline"]["seconds"], m["baseline"]["round_trips"],
             m["baseline"]["bytes_over_link"] / 2**20, m["end_to_end_baseline_s"]],
            ["coalesced remote reads, no replica", m["coalesced_remote"]["seconds"],
             m["coalesced_remote"]["round_trips"], m["coalesced_remote"]["bytes_over_link"] / 2**20,
             m["coalesced_remote"]["seconds"]],
            ["foresight: local replica made during the save", m["foresight"]["seconds"], 0,
             m["foresight"]["bytes_over_link"] / 2**20, m["end_to_end_foresight_s"]]]
    s.tables.append(("merge at the evaluation site", ["method", "merge s", "round trips", "MiB over the link",
                                                      "commit -> merged s"], rows))
    if payload.get("arrival"):  # runs since issue 20 item 3: the site merges units as they arrive
        s.tables.append(("commit -> merged: merging as units arrive, by simulated write speed (MB/s per rank)",
                         ["write speed", "save s", "transfer s at link rate", "MiB left at commit",
                          "replica then merge s", "coalesced remote s", "bulk copy then merge s",
                          "merging on arrival s", "vs best alternative"],
                         [[a["write_MBps_per_rank"], a["save_s"], a["transfer_s_at_link_rate"],
                           a["MiB_left_at_commit"], a["commit_to_merged_replica_then_merge_s"],
                           a["commit_to_merged_coalesced_remote_s"], a.get("commit_to_merged_bulk_copy_s"),
                           a["commit_to_merged_arrival_s"], a["arrival_vs_best_alternative"]]
                          for a in payload["arrival"]]))
    if payload.get("jobs"):  # several jobs saving and replicating at once over the one shared link
        s.tables.append(("concurrent jobs on the one link (saves as fast as the disk): commit -> merged per job",
                         ["jobs", "save s", "all jobs' transfer s at link rate", "merging on arrival s",
                          "bulk copy then merge s", "streams per job", "slowest job: arrival vs bulk copy"],
                         [[j["jobs"], ", ".join(f"{x:.2f}" for x in j["save_s"]) if "save_s" in j else "not recorded",
                           j.get("transfer_s_at_link_rate"),
                           ", ".join(f"{x:.2f}" for x in j["commit_to_merged_arrival_s"]),
                           ", ".join(f"{x:.2f}" for x in j["commit_to_merged_bulk_copy_s"]),
                           j["bulk_streams_per_job"], j["arrival_vs_bulk_copy"]] for j in payload["jobs"]]))
    if payload.get("targets"):
        s.tables.append(("issue 20 targets", ["target", "case", "value", "bound", "met"],
                         [[t["target"], t["case"], t["value"], t["bound"], "met" if t["met"] else "not met"]
                          for t in payload["targets"]]))
    s.tables.append(("an unpredicted urgent evaluation during a bulk replication",
                     ["sender", "urgent replica ready s", "bulk ready s", "urgent MiB", "bulk MiB"],
                     [[u["lane"], u["urgent_ready_s"], u["bulk_ready_s"], u["urgent_bytes"] / 2**20,
                       u["bulk_bytes"] / 2**20] for u in payload.get("urgent", [])]))
    return s


def replication_overlap(payload: dict) -> Section:
    s = Section("Replication overlap: send while saving, and filling the link")
    s.notes.append(f"WAN bed: one shared pipe, RTT {payload['rtt_ms']:g} ms, {payload['mbit']:g} Mbit/s; "
                   f"{payload['unit_mib']:g} MiB units")
    links = payload.get("link", [])
    for lk in links:
        n = lk["streams"]
        s.notes.append(f"{lk['background']} background flow(s): replication {lk['vs_plain_1']:.2f}x one plain stream's "
                       f"throughput (target >= 0.9x), {lk[f'vs_plain_{n}']:.2f}x {n} parallel plain streams' "
                       f"(target >= 0.9x on a shared link)")
    rows = [_overlap_row(r) for r in payload.get("rows", [])]
    target = ("target: left <= floor + 10% of the save at the link rate, where floor = total - link rate x save "
              "(>= 0) is what no sender can have sent during a save shorter than the transfer (0 when the save lasts "
              "at least as long as the transfer: the issue's target as written)")
    if rows and all("MiB_not_received_whole_at_commit" in r for r in rows):
        s.notes.append("left at the commit: what the sender had not put on the link when the source committed (the "
                       "bed delivers each byte RTT/2 after the link sends it: bytes the site had not received by the "
                       "commit + RTT/2, units received in part counted for their bytes); beside it the bytes of the "
                       "units the site had not received whole by the commit, which also charges the propagation "
                       "delay and the site's intake to the sender; " + target)
    elif rows:
        s.notes.append("left at the commit: what had not crossed the link when the source committed (units the "
                       "site had not received whole); " + target)
    for r in rows:
        s.notes.append(f"save at {r['write_MB_s']:g} MB/s ({r['save_s']:.2f} s, transfer at link rate "
                       f"{r['transfer_s_at_link_rate']:.2f} s): {r['MiB_left_at_commit']:.1f} MiB left at the commit, "
                       f"{r['MiB_over_floor']:.1f} MiB over the floor of {r['floor_MiB']:.1f} MiB, target <= "
                       f"{r['target_MiB_left']:.1f} MiB: {'met' if r['met'] else 'not met'}")
    s.tables.append(("fill the link: a committed checkpoint, replication against plain TCP streams (medians)",
                     ["background flows", "MiB", "1 plain stream MB/s", "N plain streams MB/s", "N", "foresight MB/s",
                      "vs 1 stream", "vs N streams"],
                     [[lk["background"], lk["MiB"], lk["plain_1_MB_s"], lk[f"plain_{lk['streams']}_MB_s"],
                       lk["streams"], lk["foresight_MB_s"], lk["vs_plain_1"], lk[f"vs_plain_{lk['streams']}"]]
                      for lk in links]))
    s.tables.append(("send while saving: a replicated Checkpointer save at a simulated disk write speed (the save "
                     "with the median MiB left)",
                     ["write MB/s", "MiB", "save s", "transfer s at link rate", "MiB left at commit",
                      "range (saves)", "MiB not received whole at commit", "MiB unacknowledged at commit",
                      "floor MiB", "MiB over floor", "target MiB (floor + 10% of save)",
                      "met", "commit -> replica ready s", "save start -> ready s"],
                     [[r["write_MB_s"], r["MiB"], r["save_s"], r["transfer_s_at_link_rate"], r["MiB_left_at_commit"],
                       f"{r['MiB_left_range']} ({r['runs']})" if "runs" in r else "1 save",
                       r.get("MiB_not_received_whole_at_commit"), r.get("MiB_unacked_at_commit"), r["floor_MiB"],
                       r["MiB_over_floor"], r["target_MiB_left"],
                       "met" if r["met"] else "not met", r["commit_to_ready_s"], r["save_start_to_ready_s"]]
                      for r in rows]))
    return s


def _overlap_row(r: dict) -> dict:
    """A send-while-saving row with its floor and target (results written before they were recorded: derived from
    the save and the transfer time at the link rate; their "left" is the bytes not yet acknowledged)."""
    if "floor_MiB" in r:
        return r
    link_MiB_s = r["MiB"] / r["transfer_s_at_link_rate"]
    floor = max(0.0, r["MiB"] - link_MiB_s * r["save_s"])
    target = floor + 0.1 * r["save_s"] * link_MiB_s
    return {**r, "floor_MiB": floor, "MiB_over_floor": r["MiB_left_at_commit"] - floor, "target_MiB_left": target,
            "met": r["MiB_left_at_commit"] <= target}


def pushdown(payload: dict) -> Section:
    s = Section("Pushdown: decode on the storage node vs on the training host")
    cal = payload.get("calibration") or {}
    s.notes.append(f"{payload['steps']} steps of {payload['batch']} samples, simulated compute {payload['compute_s']} s "
                   "per step (host sleeps)" + (f" = {payload.get('compute_ratio')} x one step of host-side decode alone "
                   f"on the core ({cal['decode_step_s']:.3f} s)" if cal else "") +
                   "; training process and node each pinned to one core; scenario `shared`: "
                   f"{payload.get('host_busy', 1)} CPU-bound process(es) share the training core")
    cols = ["scenario", "mode", "steps", "stall_total_s", "p50_ms", "p99_ms", "host_cpu_s", "node_cpu_s", "wire_mb",
            "host_read_mb", "remote_samples", "raw_samples", "deferred_samples", "wall_s", "runs", "wall_spread"]
    s.tables.append(("per scenario and mode", ["host", "mode", "steps", "stall total s", "P50 ms", "P99 ms",
                                               "host CPU s", "node CPU s", "MB on the wire", "MB read by the host",
                                               "samples decoded on the node", "raw samples", "deferred samples",
                                               "wall s after start-up", "runs", "wall min-max s"],
                     [[r.get(c, "idle" if c == "scenario" else None) for c in cols[:-1]]
                      + [f"{r['wall_min_s']:.2f}-{r['wall_max_s']:.2f}" if "wall_min_s" in r else None]
                      for r in payload["rows"]]))
    if payload.get("repeats", 1) > 1:
        s.notes.append(f"each figure is the median of {payload['repeats']} runs per foresight mode, interleaved "
                       "(the torch DataLoader anchor, 2-3x slower than the rest, runs once)")
    sm = payload.get("summary", {})
    scen = [k for k, v in sm.items() if isinstance(v, dict) and k != "paper_targets_pct"]
    if not scen and "stall_reduction_pct" in sm:  # results written before the scenarios
        sm, scen = {"idle": sm}, ["idle"]
    compute = payload["compute_s"] * max(0, payload["steps"] - 1)  # the first step's stall is start-up, not counted

    def host_stall_pct(sc: str) -> float | None:
        h = next((r for r in payload["rows"] if r["mode"] == "host" and r.get("scenario", "idle") == sc), None)
        return None if h is None or not compute else 100 * h["stall_total_s"] / compute

    rows = []
    for key, label, paper in (("stall_reduction_pct", "stall", 63.2), ("p99_reduction_pct", "P99 latency", 85.7),
                              ("host_cpu_reduction_pct", "host data-loading CPU", 94.0)):
        cells = []
        for sc in scen:
            pct = host_stall_pct(sc)
            immaterial = key != "host_cpu_reduction_pct" and pct is not None and pct < 1.0
            cells.append(f"n/m (host stall {pct:.2f}% of compute)" if immaterial else sm[sc].get(key))
        rows.append([label] + cells + [paper])
    if scen:
        s.tables.append(("reductions (%) of pushdown against foresight's host-side decode, paper's figure beside",
                         ["figure"] + [f"ours, host {sc}" for sc in scen] + ["paper"], rows))
    if compute:
        modes = list(dict.fromkeys(r["mode"] for r in payload["rows"]))
        scen_rows = list(dict.fromkeys(r.get("scenario", "idle") for r in payload["rows"]))
        s.tables.append(("stall as % of the run's compute time (what the stall costs the job)",
                         ["host"] + modes,
                         [[sc] + [next((round(100 * r["stall_total_s"] / compute, 2) for r in payload["rows"]
                                        if r["mode"] == m and r.get("scenario", "idle") == sc), None) for m in modes]
                          for sc in scen_rows]))
        s.notes.append("when the host is alone on its core it keeps up (compute is 1.25x its decode step), so its stall "
                       "is near zero and a reduction of near-zero figures says little; the node, on one core like the "
                       "host, has the same decode capacity, and the shared scenario is where offloading pays, as in "
                       "the paper")
    for sc in scen:
        for guard, how in (("guard", "raw bytes over the wire, the host decodes"),
                           ("guard_defer", "deferred: the host reads and decodes")):
            g = sm[sc].get(f"{guard}_wall_vs_host")
            if g is not None:
                s.notes.append(f"host {sc}: CPU guard engaged ({how}): wall {g:.3f}x host-side decode's, stall "
                               f"{sm[sc].get(f'{guard}_stall_s_minus_host', 0):+.2f} s (target: <= 1.05x)")
    return s


SUMMARIZERS: dict[str, Callable[[dict], Section]] = {
    "read_path": read_path, "read_path_tokens": read_path_tokens, "checkpoint": checkpoint, "decode": decode,
    "plan_build": plan_build, "gpu_handoff": gpu_handoff, "remote_merge": remote_merge, "object_store": object_store,
    "pushdown": pushdown, "replication_overlap": replication_overlap,
}


def generic(name: str, payload: dict) -> Section:
    """A bench without its own summarizer: its ``report`` tables (``[{title, header, rows}]``) and paper figure."""
    s = Section(payload.get("title", name))
    for t in payload.get("report", []):
        s.tables.append((t["title"], t["header"], t["rows"]))
    s.notes += payload.get("notes", [])
    return s


def summarize(name: str, payload: dict) -> Section:
    fn = SUMMARIZERS.get(name)
    section = fn(payload) if fn else generic(name, payload)
    if name in PAPER or any(k.startswith(name) for k in PAPER):
        paper = [v for k, v in PAPER.items() if k == name or k.startswith(name + "_")]
        section.notes.append("paper: " + "; ".join(paper))
    return section


def render(results: dict[str, dict], *, preset: str, machine: dict, commands: dict[str, str],
           plots: dict[str, list[str]], elapsed_s: dict[str, float], failures: dict[str, str]) -> str:
    lines = ["# BENCHMARKS", "",
             "Generated by `python bench/run_all.py --preset " + preset + "` from one run; do not edit by hand. "
             "The result files behind every figure are committed under `bench/reference/" + preset + "/`.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "Relative figures only on this machine (a 2-core VM, virtio disk): ratios measured side by side in one "
             "run. Absolute figures need a GPU machine (`bench/gpu_device.sh`).", ""]
    if failures:
        lines += ["Benches that failed in this run (no figures): " +
                  "; ".join(f"`{k}`: {v}" for k, v in failures.items()), ""]
    for name, payload in results.items():
        sec = summarize(name, payload)
        lines += [f"## {sec.title}", "", f"`{commands[name]}` ({elapsed_s.get(name, 0):.0f} s)", ""]
        for note in sec.notes:
            lines += [f"- {note}"]
        if sec.notes:
            lines.append("")
        for caption, header, rows in sec.tables:
            lines += [f"*{caption}*", "", markdown_table(header, rows), ""]
        for p in plots.get(name, []):
            lines += [f"![{name}](docs/bench/{p})", ""]
    return "\n".join(lines)


# ---- README headlines ---------------------------------------------------------------------------------------------
HEADLINES_BEGIN = "<!-- headlines: generated by bench/run_all.py from bench/reference/quick; do not edit -->"
HEADLINES_END = "<!-- /headlines -->"


def _row(payload: dict, size: str, mode: str, method: str) -> dict:
    return next(r for r in payload["rows"] if (r["size"], r["mode"], r["method"]) == (size, mode, method))


def headlines(results: dict[str, dict]) -> str:
    """The README's headline table, computed from the committed result files (so every figure there traces)."""
    rows = []
    if "read_path" in results:
        rp = results["read_path"]
        cold, warm = _row(rp, "16K", "cold", "fs-uring"), _row(rp, "16K", "warm", "fs-uring")
        block = _row(rp, "16K", "cold", "fs-uring-block")
        fio, dl = _row(rp, "16K", "cold", "fio"), _row(rp, "16K", "cold", "torch-dl")
        rows.append([f"read path, 16 KiB random reads over {rp['dataset_bytes'] / 2**30:.0f} GiB, cold (O_DIRECT), "
                     f"{rp['runs']} runs",
                     f"{cold['mb_per_s']:,.0f} MB/s: {cold['x_fio_bw']:.2f}x fio's best ({fio['config']}), "
                     f"{cold['x_dl_sps']:.2f}x the best `DataLoader` ({dl['config']}) at {cold['x_dl_cpu']:.3f}x its "
                     f"CPU per GB; warm {warm['x_dl_sps']:.1f}x at {warm['x_dl_cpu']:.2f}x; block-local plans "
                     f"{block['x_dl_sps']:.1f}x with {block['ios_per_sample']:.3f} I/Os per sample", ""])
    if "checkpoint" in results:
        rows.append(["checkpoint", "; ".join(results["checkpoint"]["verdicts"]), ""])
    if "decode" in results:
        dc = results["decode"]
        sm, cpu = dc["summary"][0], dc["cpu_summary"][0]
        ours = next(c for c in dc["correctness"] if c["method"] == "foresight")
        exact = ours["pixel_exact_224"] == ours["frames_224"] and ours["wrong_frame_224"] == 0
        rows.append([f"video decode, 8 frames per window, {sm['clip']}, 224x224, {sm['threads']} thread",
                     f"{sm['vs_best_anchor']:.2f}x the fastest anchor ({sm['best_anchor']}), "
                     f"{1 / cpu['cpu_vs_best_anchor']:.2f}x its CPU, " + ("pixel-exact" if exact else "NOT pixel-exact"),
                     ""])
    if "pushdown" in results:
        sm = results["pushdown"]["summary"]
        sh, idle = sm.get("shared", {}), sm.get("idle", {})
        alone = (f" (host alone on its core: both keep up; CPU -{idle['host_cpu_reduction_pct']}%)"
                 if "host_cpu_reduction_pct" in idle else "")
        guard = (f"; CPU guard engaged (deferred reply): {sh['guard_defer_wall_vs_host']:.3f}x host decode's wall"
                 if sh.get("guard_defer_wall_vs_host") else "")
        rows.append(["pushdown, training core shared with a busy process",
                     f"stall -{sh['stall_reduction_pct']}%, P99 -{sh['p99_reduction_pct']}%, training host's "
                     f"data-loading CPU -{sh['host_cpu_reduction_pct']}%{alone}{guard}", "63.2%, 85.7%, 94%"])
    if "remote_merge" in results:
        rm = results["remote_merge"]
        rows.append([f"remote merge at an evaluation site, {rm['wan']['rtt_ms']:.0f} ms RTT",
                     f"merge latency -{100 * rm['merge']['reduction']:.1f}%", "76.1%"])
    if "restart_storm" in results and "layouts" in results["restart_storm"]:
        rs = results["restart_storm"]
        cfg = rs["config"]
        got = [f"{name} -{100 * lr['modes']['foresight']['reduction']:.1f}% "
               f"({lr['foresight_vs_best_alternative']:.2f}x the best alternative, {lr['best_alternative']})"
               for name, lr in rs["layouts"].items() if "foresight" in lr["modes"]]
        rows.append([f"synchronized restart, {cfg['ranks']:,} ranks ({cfg['ranks_per_host']} per host), {cfg['nodes']} "
                     f"nodes each limited to {cfg['limit']} (bytes/s:requests/s)",
                     "restore time with hints + per-host sharing, placement included: " + "; ".join(got), "40.8%"])
    elif "restart_storm" in results:  # a result file from before the per-host sharing (default vs hinted only)
        rs = results["restart_storm"]
        cfg = rs["config"]
        rows.append([f"synchronized restart, {cfg['ranks']:,} ranks, {cfg['nodes']} nodes each limited to {cfg['limit']} "
                     "(bytes/s:requests/s)", f"restore time -{100 * rs['reduction']:.1f}% with replication hints",
                     "40.8%"])
    return "\n".join([HEADLINES_BEGIN, markdown_table(["bench", "foresight against its best anchor", "paper"], rows),
                      HEADLINES_END])


def replace_headlines(readme: str, block: str) -> str:
    start, end = readme.find(HEADLINES_BEGIN), readme.find(HEADLINES_END)
    if start < 0 or end < 0:
        raise ValueError("README.md has no headline markers")
    return readme[:start] + block + readme[end + len(HEADLINES_END):]
