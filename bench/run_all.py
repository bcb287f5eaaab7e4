"""One command for every bench: run them, keep their result files, and write BENCHMARKS.md from that one run.

Presets:

* ``quick``: the read path at one sample size over a 4 GiB dataset, 3 runs (the bar for published figures), the
  other benches at reduced sizes and sweeps: about 15 minutes here.
* ``full``: the sizes and repeats the published figures need (>= 4 GiB datasets, >= 3 runs, full sweeps): hours.
* ``smoke``: every bench's ``--smoke`` run, seconds each, into a scratch directory (what CI runs); no BENCHMARKS.md.

Each bench runs as its own process, writing into a fresh directory of this run (``FORESIGHT_BENCH_RESULTS``); its
result JSON is copied to ``bench/reference/<preset>/`` and its plot to ``docs/bench/`` (both committed), and
BENCHMARKS.md is rendered from those files alone (``bench/report.py``), so every figure in it traces to a committed run.
``--render`` re-renders BENCHMARKS.md from the committed files.

Usage::

    python bench/run_all.py --preset quick            # then commit bench/reference/quick, docs/bench, BENCHMARKS.md
    python bench/run_all.py --preset full --only read_path,checkpoint
    python bench/run_all.py --render --preset quick   # tables again from the committed results, nothing measured
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_ENV, machine  # noqa: E402
from report import headlines, render, replace_headlines  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DOCS = ROOT / "docs" / "bench"

# bench -> preset -> arguments (after the script name)
PRESETS: dict[str, dict[str, list[str]]] = {
    "read_path": {"smoke": ["--smoke"],
                  "quick": ["--sizes", "16K", "--runs", "3", "--anchor-runs", "1", "--dataset-gib", "4",
                            "--no-sweep"],
                  "full": ["--runs", "5", "--anchor-runs", "2"]},
    "checkpoint": {"smoke": ["--smoke"], "quick": ["--sizes", "1", "--runs", "3", "--dcp-threads", "1,4"],
                   "full": ["--sizes", "1,4", "--runs", "4"]},
    # quick: one clip, one thread (CPU per clip is the figure robust to load), the expert anchors only (PyAV decoding
    # from the clip's start is the slowest method by 10x and no expert's choice; the full preset keeps it)
    "decode": {"smoke": ["--smoke"], "quick": ["--only", "720p_gop60", "--scaling", "", "--threads", "1", "--methods",
                                               "foresight,pyav_seek,decord,tc_exact,tc_approx,tc_mapped"],
               "full": []},
    # full: issue 23's figures. Build rows at 10M and 100M (2 runs each: 3 at 100M take too long on the loaded 2-core
    # VM), the mixing statistics, and the compact plan at 10M, 100M and 1.8B sequences (the 1.8B corpus's generated
    # document lengths, about 15 GB, go to a temporary directory of the system's, removed at the end)
    "plan_build": {"smoke": ["--smoke"], "quick": ["--sizes", "10000000", "--repeats", "3"],
                   "full": ["--sizes", "10000000,100000000", "--repeats", "2", "--sections", "build,mixing,scale",
                            "--compact-sizes", "10000000,100000000,1800000000"]},
    # issue 23: the Loader over a compact plan beside the same plan materialized, interleaved run by run
    "read_path_tokens": {"smoke": ["--smoke"], "quick": ["--dataset-gib", "1", "--runs", "5"],
                         "full": ["--dataset-gib", "2", "--runs", "9"]},
    "gpu_handoff": {"smoke": ["--smoke"], "quick": [], "full": []},
    # quick: the shared host core only (where offloading pays; the idle core is in full), 3 interleaved runs per mode
    "pushdown": {"smoke": ["--smoke"], "quick": ["--videos", "6", "--images", "8", "--steps", "12", "--scenarios",
                                                 "shared"], "full": []},
    "remote_merge": {"smoke": ["--smoke"],
                     "quick": ["--small", "600", "--large", "16", "--large-mib", "4", "--bulk-mib", "256",
                               "--unit-sweep", "", "--jobs", "1,2", "--unit-mib", "4"], "full": []},
    "restart_storm": {"smoke": ["--smoke"], "quick": ["--quick"], "full": []},
    "object_store": {"smoke": ["--smoke"], "quick": ["--preset", "quick"], "full": []},
    # quick: half the checkpoint (128 MiB), 3 runs per link method; full: the defaults (256 MiB)
    "replication_overlap": {"smoke": ["--smoke"], "quick": ["--mib", "128", "--repeats", "3"], "full": []},
}


def outputs(results_dir: Path, name: str, suffix: str) -> list[Path]:
    """What one bench wrote into the fresh results directory it ran with, oldest first."""
    found = list(results_dir.glob(f"{name}*{suffix}"))
    return sorted(found, key=lambda p: p.stat().st_mtime)


def run_one(name: str, preset: str, log_dir: Path,
            results_dir: Path) -> tuple[dict | None, list[Path], str, float, str | None]:
    """Run one bench with ``FORESIGHT_BENCH_RESULTS=results_dir`` (a directory of this run only, so a file an
    earlier run left can never stand in for this one's), and read its result back from there."""
    script = BENCH / f"{name}.py"
    args = PRESETS[name][preset]
    command = " ".join(["python", f"bench/{name}.py", *[a if a else "''" for a in args]])
    if not script.exists():
        return None, [], command, 0.0, "not present in this checkout"
    results_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{RESULTS_ENV: str(results_dir)})
    t0 = time.time()
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env=env)
    elapsed = time.time() - t0
    if proc.returncode != 0:
        tail = (log_dir / f"{name}.log").read_text().strip().splitlines()[-3:]
        return None, [], command, elapsed, f"exit {proc.returncode}: {' | '.join(tail)[-300:]}"
    jsons = outputs(results_dir, name, ".json")
    if not jsons:
        return None, [], command, elapsed, "wrote no result JSON"
    return json.loads(jsons[-1].read_text()), outputs(results_dir, name, ".png"), command, elapsed, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("smoke", "quick", "full"), default="quick")
    ap.add_argument("--only", default="", help="comma-separated benches (default: all)")
    ap.add_argument("--render", action="store_true", help="re-render BENCHMARKS.md from bench/reference/<preset>")
    ap.add_argument("--out", default=None, help="where BENCHMARKS.md goes (default: quick: the repository root; "
                                                "full: bench/reference/full; smoke: a scratch directory)")
    args = ap.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else PRESETS) if n]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        ap.error(f"unknown benches {unknown}; choose from {list(PRESETS)}")
    smoke = args.preset == "smoke"
    ref = ROOT / "bench" / "reference" / args.preset
    scratch = Path(tempfile.mkdtemp(prefix="foresight-run-all-")) if smoke else None
    if smoke:
        ref = scratch / "reference"
    # the top-level BENCHMARKS.md is the quick preset's; the full preset's page stays beside its result files
    out = Path(args.out) if args.out else (scratch if smoke else ROOT if args.preset == "quick" else ref)
    plots_dir = (scratch / "docs") if smoke else DOCS
    ref.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)
    index_path = ref / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"benches": {}}

    if not args.render:
        log_dir = ref / "logs" if not smoke else scratch
        log_dir.mkdir(parents=True, exist_ok=True)
        index["machine"] = machine()
        results_root = Path(tempfile.mkdtemp(prefix="foresight-run-all-results-"))
        for name in names:
            print(f"run_all: {name} ({args.preset}) ...", flush=True)
            payload, pngs, command, elapsed, failure = run_one(name, args.preset, log_dir, results_root / name)
            entry = {"command": command, "elapsed_s": round(elapsed, 1), "failure": failure,
                     "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "plots": []}
            if payload is not None:
                (ref / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))
                for png in pngs:
                    dest = f"{name}-{args.preset}{png.name[len(name):]}".replace(".png", "") + ".png"
                    shutil.copyfile(png, plots_dir / dest)
                    entry["plots"].append(dest)
            index["benches"][name] = entry
            print(f"run_all: {name} {'FAILED: ' + failure if failure else 'done'} in {elapsed:.0f} s", flush=True)
        shutil.rmtree(results_root, ignore_errors=True)  # what mattered was copied to the reference directory
        index_path.write_text(json.dumps(index, indent=1))

    results = {}
    for name, entry in index["benches"].items():
        if not entry.get("failure") and (ref / f"{name}.json").exists():
            results[name] = json.loads((ref / f"{name}.json").read_text())
    m = index.get("machine", {})
    described = {k: m[k] for k in ("cpu_model", "cpus", "memory_gib", "kernel", "python", "torch", "gpu") if k in m}
    text = render(results, preset=args.preset, machine=described,
                  commands={n: e["command"] for n, e in index["benches"].items()},
                  plots={n: e["plots"] for n, e in index["benches"].items()},
                  elapsed_s={n: e["elapsed_s"] for n, e in index["benches"].items()},
                  failures={n: e["failure"] for n, e in index["benches"].items()
                            if e.get("failure") and e["failure"] != "not present in this checkout"})
    target = out / "BENCHMARKS.md"
    target.write_text(text)
    print(f"run_all: wrote {target}")
    if args.preset == "quick" and not args.out:  # the README's headline table comes from the committed quick run
        readme = ROOT / "README.md"
        readme.write_text(replace_headlines(readme.read_text(), headlines(results)))
        print(f"run_all: updated the headline table in {readme}")
    failed = [n for n, e in index["benches"].items() if n in names and e.get("failure")
              and e["failure"] != "not present in this checkout"]
    if scratch and not args.out:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
