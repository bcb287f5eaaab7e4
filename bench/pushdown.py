"""Pushdown bench: the paper's transformation-offload experiment on this machine.

The training process is pinned to one core (``taskset``) and runs a fixed simulated compute step (the GPU's time:
the host sleeps) and then asks for the next batch; the storage node is pinned to the other core. The dataset is
video + images (full run: 720p H.264 clips of 30-60 s and JPEGs of 1-4 MP; ``--smoke``: tiny ones).

The compute step is calibrated, not guessed: a first pass measures what one step of host-side decode costs on the
training core with nothing else running (``D``), and the compute step is ``--compute-ratio`` times that (default 1.25:
a host that is alone on its core keeps up). Two scenarios then run every mode:

* ``idle``    the training core runs only the training process (the issue's set-up: host idle during compute)
* ``shared``  the training core also runs ``--host-busy`` CPU-bound processes, as the paper's hosts share their CPUs
              between the data loaders of all their GPUs and the framework (its storage nodes idled at 20-30% CPU)

Side by side in each scenario:

* ``torch``     a torch DataLoader (1 worker, on the training core) decoding with PyAV (seek to the keyframe before the
                window, decode from there, as PyAV's docs show) and Pillow
* ``host``      foresight's host-side decode: Loader + MediaDecodeStage (frame-selective) on the training core
* ``pushdown``  foresight pushdown: ``Loader(plan, datasets=ds, decode=stage, source=NodeSource(...))``; the node reads and
                decodes ahead on its core, the host receives the tensors (it reads nothing itself)
* ``guard``     pushdown with the node's CPU guard engaged (threshold 0), ``guard_reply="raw"``: the node sends the raw
                sample bytes, decoded on the training core
* ``guard_defer`` the same guard, ``guard_reply="defer"``: the node names the samples and the training core reads and
                decodes them itself (shared storage: the bytes need not pass through the node)

Per scenario and mode: per-step stall (time the training loop waited for its batch), P50/P99 of the data-loading
latency (the same wait, per step), the training process's CPU seconds from its first step to its last, imports and
start-up excluded (all of it is data loading: compute is a sleep), the node's CPU seconds, bytes on the wire and read
by the host, the wall time from the first batch to the end (start-up excluded, as for the stall; ``wall_total_s``
keeps it); then the reductions of pushdown against host-side decode and each guard's wall ratio.

Usage::

    python bench/pushdown.py            # full run (tens of minutes on 2 cores; encodes the dataset once)
    python bench/pushdown.py --smoke    # about a minute: tiny clips and images, a few steps, one run per mode
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, machine, print_table, write_results  # noqa: E402

MODES = ("torch", "host", "pushdown", "guard", "guard_defer")
NODE_MODES = {"pushdown": None, "guard": "raw", "guard_defer": "defer"}  # mode -> guard reply (None: guard off)
TOKEN = "bench-token-123"


def _specs():
    from foresight.media import FrameSampling, TransformSpec

    return {"video": TransformSpec(modality="video", frames=FrameSampling(num_frames=8, window_s=4.0), size=(224, 224),
                                   crop="random_resized"),
            "image": TransformSpec(modality="image", size=(224, 224), crop="random_resized", flip=0.5)}


# -- data ----------------------------------------------------------------------------------------------------


def make_data(root: Path, *, smoke: bool, videos: int, images: int, steps: int, batch: int) -> None:
    """Pack the dataset once (cached by its size) and build the plan for this run."""
    from foresight.format import open_dataset
    from foresight.plan import build_plan

    stamp = root / f".made-{int(smoke)}-{videos}-{images}"  # the encoded media; the plan is cheap, built each run
    if not stamp.exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        _encode(root, smoke=smoke, videos=videos, images=images)
        stamp.touch()
    ds = open_dataset(str(root / "media"))
    shutil.rmtree(root / "plans", ignore_errors=True)
    build_plan([(ds, 1.0)], seed=1, global_batch_size=batch, num_steps=steps).save(str(root / "plans" / "p"))


def _encode(root: Path, *, smoke: bool, videos: int, images: int) -> None:
    from foresight.format import DatasetWriter
    from foresight.media import probe_media
    from foresight.testing.media_synth import make_image, make_video

    rng = np.random.default_rng(0)
    with DatasetWriter(str(root / "media"), shard_bytes=(4 << 20) if smoke else (256 << 20)) as w:
        for i in range(max(videos, images)):
            if i < videos:
                if smoke:
                    data = make_video(width=160, height=120, seconds=5.0, fps=25, gop=25)
                else:
                    data = make_video(width=1280, height=720, seconds=float(rng.integers(30, 61)), fps=30, gop=60)
                w.add(data, modality="video", meta=probe_media(data, "video"))
            if i < images:
                if smoke:
                    data = make_image(width=320, height=240, seed=i)
                else:
                    mp = float(rng.uniform(1, 4))
                    wd = int((mp * 1e6 * 4 / 3) ** 0.5)
                    data = make_image(width=wd, height=wd * 3 // 4, seed=i, quality=90)
                w.add(data, modality="image", meta=probe_media(data, "image"))


# -- the training process (run pinned, in a subprocess) ---------------------------------------------------


class _TorchDecode:
    """The plain DataLoader baseline: PyAV decoding from the clip's start, Pillow for images, numpy crops."""

    def __init__(self, ds, plan, rank_items):
        self.ds, self.plan, self.items = ds, plan, rank_items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import io

        import av
        import torch
        from PIL import Image

        start, stop = self.items[i]
        p = self.plan.pieces(start, stop)
        rng = np.random.default_rng(i)
        out = []
        from foresight.format import Modality

        for sid in np.asarray(p.sample).tolist():
            data = self.ds.read(int(sid))
            kind = Modality(int(self.ds.modality_codes()[sid])).label
            if kind == "video":
                with av.open(io.BytesIO(bytes(data))) as c:
                    s = c.streams.video[0]
                    s.thread_type = "AUTO"
                    dur = float(s.duration * s.time_base) if s.duration else 5.0
                    t0 = rng.uniform(0, max(0.0, dur - 4.0))
                    want = list(np.linspace(t0, t0 + 4.0, 8, endpoint=False))
                    frames = []
                    # as a PyAV user would: seek to the keyframe at or before the window, decode from there
                    c.seek(int(t0 / s.time_base), stream=s, backward=True, any_frame=False)
                    for f in c.decode(s):
                        if f.time is not None and want and f.time >= want[0]:
                            frames.append(f.to_ndarray(format="rgb24", width=224, height=224))
                            want.pop(0)
                        if not want:
                            break
                    while len(frames) < 8:
                        frames.append(frames[-1] if frames else np.zeros((224, 224, 3), np.uint8))
                out.append(torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2))
            else:
                img = Image.open(io.BytesIO(bytes(data))).convert("RGB")
                w, h = img.size
                cw, ch = int(w * rng.uniform(0.5, 1)), int(h * rng.uniform(0.5, 1))
                x, y = int(rng.uniform(0, w - cw)), int(rng.uniform(0, h - ch))
                out.append(torch.from_numpy(np.asarray(img.resize((224, 224), box=(x, y, x + cw, y + ch))))
                           .permute(2, 0, 1))
        return out


def _timed_steps(it, steps: int, compute_s: float, stalls: list) -> float:
    """The training loop: wait for the next batch (the stall, recorded), then the simulated compute (host idle).
    Returns when the first batch arrived (the end of start-up)."""
    first = None
    for _ in range(steps):
        t0 = time.perf_counter()
        next(it)
        stalls.append(time.perf_counter() - t0)
        first = first or time.perf_counter()
        time.sleep(compute_s)
    return first


def trainer(args: argparse.Namespace) -> None:
    from foresight.format import open_dataset
    from foresight.plan import load_plan

    root = Path(args.root)
    ds = open_dataset(str(root / "media"))
    plan = load_plan(str(root / "plans" / "p"))
    stalls: list[float] = []
    extra: dict = {}
    import torch  # noqa: F401  imports are start-up, not data loading: measured CPU starts after them

    import foresight.loader  # noqa: F401
    import foresight.media  # noqa: F401
    import foresight.node.client  # noqa: F401

    cpu0 = _cpu()
    t_start = time.perf_counter()
    if args.mode == "torch":
        import torch

        items = [plan.rank_items(s, 0, 1) for s in range(plan.num_steps)]
        loader = torch.utils.data.DataLoader(_TorchDecode(ds, plan, items), batch_size=None, num_workers=1,
                                             prefetch_factor=2, collate_fn=lambda x: x)
        it = iter(loader)
        t_first = _timed_steps(it, plan.num_steps, args.compute_s, stalls)
        del it, loader  # the worker exits and is reaped: its CPU counts as the children's
    else:
        from foresight.loader import Loader, MediaDecodeStage

        stage = MediaDecodeStage([ds], _specs(), seed=1, threads=1)
        source = None
        if args.mode in NODE_MODES:  # the loader reads none of the node's samples: batches come from the node
            from foresight.node.client import NodeSource

            source = NodeSource(stage, plan, nodes=[args.node], token=TOKEN, job=f"bench-{args.mode}",
                                lead=args.lead, timeout=120, guard_reply=NODE_MODES[args.mode] or "raw")
        loader = Loader(plan, datasets=ds, decode=stage, source=source, prefetch=2)
        it = iter(loader)
        t_first = _timed_steps(it, plan.num_steps, args.compute_s, stalls)
        loader.close()
        extra = {"loader_bytes_read": loader.stats.bytes_read}
        if source is not None:
            extra.update(source.stats)
            source.close()
        stage.close()
    end = time.perf_counter()
    print(json.dumps({"stalls": stalls, "cpu_s": _cpu() - cpu0, "wall_s": end - t_first,
                      "wall_total_s": end - t_start, "client": extra}))


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (the DataLoader's worker)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# -- the driver ------------------------------------------------------------------------------------------------


def _pin(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") and (os.cpu_count() or 1) >= 2 else []


def _start_busy(count: int) -> list[subprocess.Popen]:
    """CPU-bound processes on the training core: the rest of a shared host (other ranks' loaders, the framework)."""
    from foresight.testing.tether import start_tethered

    return [start_tethered(_pin(0) + [sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def run_mode(mode: str, args: argparse.Namespace, root: Path, workdir: Path, *, scenario: str = "idle",
             compute_s: float | None = None) -> dict:
    import psutil

    from foresight.testing.tether import start_tethered

    compute_s = args.compute_s if compute_s is None else compute_s
    node_proc, node_loc, node_cpu0 = None, None, 0.0
    busy: list[subprocess.Popen] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "python"), os.environ.get("PYTHONPATH", "")]))
    if mode in NODE_MODES:
        ready = workdir / f"node-{mode}.json"
        ready.unlink(missing_ok=True)
        log = open(workdir / f"node-{mode}.log", "wb")
        node_proc = start_tethered(
            _pin(1) + [sys.executable, "-m", "foresight", "node", "serve", "--root", str(root), "--ready-file",
                       str(ready), "--cpu-threshold", "101" if NODE_MODES[mode] is None else "0",
                       "--decode-threads", "1",
                       "--max-lead", str(args.lead)], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while not ready.exists():
            if node_proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"node did not start; see {workdir / f'node-{mode}.log'}")
            time.sleep(0.1)
        node_loc = json.loads(ready.read_text())["location"]
        node_cpu0 = sum(psutil.Process(node_proc.pid).cpu_times()[:2])
    try:
        busy = _start_busy(args.host_busy if scenario == "shared" else 0)
        cmd = _pin(0) + [sys.executable, str(Path(__file__).resolve()), "--role", "trainer", "--mode", mode,
                         "--root", str(root), "--compute-s", str(compute_s), "--lead", str(args.lead)]
        if node_loc:
            cmd += ["--node", node_loc]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if out.returncode != 0:
            raise SystemExit(f"trainer {mode} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        node_cpu = sum(psutil.Process(node_proc.pid).cpu_times()[:2]) - node_cpu0 if node_proc else 0.0
    finally:
        for b in busy:
            b.kill()
            b.wait()
        if node_proc is not None:
            node_proc.terminate()
            node_proc.wait(timeout=60)
    st = np.asarray(res["stalls"][1:] or res["stalls"])  # step 0 includes start-up (registration, first reads)
    client = res["client"]
    return {"scenario": scenario, "mode": mode, "steps": len(res["stalls"]), "stall_total_s": float(st.sum()),
            "stall_mean_ms": float(st.mean() * 1e3), "p50_ms": float(np.percentile(st, 50) * 1e3),
            "p99_ms": float(np.percentile(st, 99) * 1e3), "host_cpu_s": res["cpu_s"], "node_cpu_s": node_cpu,
            "wire_mb": client.get("bytes_received", 0) / 1e6, "raw_samples": client.get("samples_raw", 0),
            "remote_samples": client.get("samples_remote", 0), "local_samples": client.get("samples_local", 0),
            "deferred_samples": client.get("samples_deferred", 0),
            "host_read_mb": (client.get("loader_bytes_read", 0) + client.get("bytes_read_here", 0)) / 1e6,
            "wall_s": res["wall_s"], "wall_total_s": res["wall_total_s"],
            "stalls_ms": [round(x * 1e3, 2) for x in res["stalls"]]}


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (scenario, mode): the median of each figure over its repeats (per-step stalls: the median-wall
    run's), with ``runs`` and the figures' spread (min-max of the wall) beside."""
    rows = []
    for key in dict.fromkeys((r["scenario"], r["mode"]) for r in runs):
        mine = [r for r in runs if (r["scenario"], r["mode"]) == key]
        walls = sorted(r["wall_s"] for r in mine)
        mid = min(mine, key=lambda r: abs(r["wall_s"] - float(np.median(walls))))
        row = {k: (float(np.median([r[k] for r in mine])) if isinstance(v, (int, float)) and k != "repeat" else v)
               for k, v in mid.items() if k != "repeat"}
        row.update(steps=mid["steps"], runs=len(mine), wall_min_s=walls[0], wall_max_s=walls[-1])
        rows.append(row)
    return rows


def _reduction(base: float, new: float) -> float | None:
    """Percent less than ``base``; two decimals, so that a near-total reduction does not read as 100%."""
    return None if not base else round(100.0 * (1 - new / base), 2)


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    scenarios = list(dict.fromkeys(r.get("scenario", "idle") for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    colors = {"torch": "#999", "host": "#48c", "pushdown": "#2a7", "guard": "#c84", "guard_defer": "#d9a"}
    width = 0.8 / max(1, len(modes))
    for ax, key, label in zip(axes, ("stall_total_s", "p99_ms", "host_cpu_s"),
                              ("total stall (s)", "P99 data-loading latency (ms)", "training-process CPU (s)")):
        for j, m in enumerate(modes):
            vals = [next((r[key] for r in rows if r["mode"] == m and r.get("scenario", "idle") == sc), 0)
                    for sc in scenarios]
            ax.bar(np.arange(len(scenarios)) + j * width, vals, width, label=m, color=colors.get(m, "#666"))
        ax.set_xticks(np.arange(len(scenarios)) + width * (len(modes) - 1) / 2, [f"host {sc}" for sc in scenarios])
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle("Transformation pushdown (lower is better)")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def calibrate(args: argparse.Namespace, root: Path) -> dict:
    """One step of host-side decode on the training core, nothing else running (compute 0: the decode is the pace)."""
    row = run_mode("host", args, root, root.parent, scenario="idle", compute_s=0.0)
    return {"decode_step_s": row["p50_ms"] / 1e3, "host_cpu_per_step_s": row["host_cpu_s"] / max(1, row["steps"])}


def summarize(rows: list[dict]) -> dict:
    """Per scenario: the reductions of pushdown against host-side decode (the paper's three figures) and the guard."""
    out: dict = {"paper_targets_pct": {"stall": 63.2, "p99": 85.7, "host_cpu": 94.0}}
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        by = {r["mode"]: r for r in rows if r["scenario"] == sc}
        cur: dict = {}
        if "host" in by and "pushdown" in by:
            h, p = by["host"], by["pushdown"]
            cur.update(stall_reduction_pct=_reduction(h["stall_total_s"], p["stall_total_s"]),
                       p99_reduction_pct=_reduction(h["p99_ms"], p["p99_ms"]),
                       host_cpu_reduction_pct=_reduction(h["host_cpu_s"], p["host_cpu_s"]))
        if "torch" in by and "pushdown" in by:
            cur["stall_reduction_vs_torch_pct"] = _reduction(by["torch"]["stall_total_s"], by["pushdown"]["stall_total_s"])
        for guard in ("guard", "guard_defer"):
            if "host" in by and guard in by:
                # stall is near zero when the host keeps up, so the guard is judged on the step time the loop saw
                h, g = by["host"], by[guard]
                cur[f"{guard}_wall_vs_host"] = round(g["wall_s"] / h["wall_s"], 3) if h["wall_s"] else None
                cur[f"{guard}_stall_s_minus_host"] = round(g["stall_total_s"] - h["stall_total_s"], 3)
        out[sc] = cur
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny clips and images, a few steps (under a minute)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--scenarios", default="idle,shared", help="idle: host alone on its core; shared: with --host-busy")
    ap.add_argument("--host-busy", type=int, default=1, help="CPU-bound processes sharing the training core (shared)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="samples per step")
    ap.add_argument("--compute-s", type=float, default=None,
                    help="simulated compute per step (host idle); default: --compute-ratio x the calibrated decode step")
    ap.add_argument("--compute-ratio", type=float, default=1.25,
                    help="compute step / one step of host-side decode alone on the core (>1: the idle host keeps up)")
    ap.add_argument("--lead", type=int, default=3, help="steps the node prepares ahead")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each foresight mode per scenario, medians reported (default 3; --smoke: 1); the "
                         "torch anchor runs once")
    ap.add_argument("--videos", type=int, default=None, help="clips in the dataset (full: 24)")
    ap.add_argument("--images", type=int, default=None, help="images in the dataset (full: 24)")
    ap.add_argument("--data-dir", default="/tmp/foresight_bench_pushdown")
    ap.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--node", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        return trainer(args)
    steps = args.steps or (4 if args.smoke else 40)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    batch = args.batch or (4 if args.smoke else 8)
    data = Path(args.data_dir) / ("smoke" if args.smoke else "full")
    videos = args.videos if args.videos is not None else (8 if args.smoke else 24)
    images = args.images if args.images is not None else (8 if args.smoke else 24)
    make_data(data, smoke=args.smoke, videos=videos, images=images, steps=steps, batch=batch)
    calibration = None
    if args.compute_s is None:
        calibration = calibrate(args, data)
        args.compute_s = round(args.compute_ratio * calibration["decode_step_s"], 4)
        print(f"calibrated: one step of host-side decode {calibration['decode_step_s']:.3f} s alone on the core; "
              f"compute step {args.compute_s:.3f} s (x{args.compute_ratio})")
    modes = [m for m in args.modes.split(",") if m]
    runs = []
    for sc in [s for s in args.scenarios.split(",") if s]:
        for rep in range(args.repeats):  # interleaved, so a slow spell of the machine touches every mode alike
            for m in modes:
                if m == "torch" and rep:  # the far-off anchor (2-3x slower than every other mode) runs once
                    continue
                runs.append(dict(run_mode(m, args, data, data.parent, scenario=sc), repeat=rep))
    rows = median_rows(runs)
    print_table(rows, ["scenario", "mode", "steps", "stall_total_s", "p50_ms", "p99_ms", "host_cpu_s", "node_cpu_s",
                       "wire_mb", "host_read_mb", "remote_samples", "raw_samples", "deferred_samples", "wall_s"],
                title=f"pushdown bench (compute {args.compute_s:.3f} s/step, {batch} samples/step, "
                      f"shared = {args.host_busy} busy process(es) on the training core)")
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    name = "pushdown_smoke" if args.smoke else "pushdown"
    path = write_results(name, {"machine": machine(), "smoke": args.smoke, "steps": steps, "batch": batch,
                                "compute_s": args.compute_s, "compute_ratio": args.compute_ratio,
                                "calibration": calibration, "host_busy": args.host_busy, "lead": args.lead,
                                "videos": videos, "images": images, "repeats": args.repeats, "rows": rows,
                                "runs": runs, "summary": summary})
    png = plot(rows, RESULTS / f"{name}.png")
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
