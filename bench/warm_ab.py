"""Warm random 16 KiB reads, interleaved A/B: the Loader (in each configuration asked for) against fio's io_uring
random read (in each asked for) on the same page-cached file, run after run, medians and ranges printed.

read_path.py's warm row is one of many methods in a long run; on a shared machine a drift of load between its fio
and Loader rows moves the ratio by more than a change under test. Here every round runs every variant once, in
order, on the same warm file, so drift hits all alike, and the ratio to fio's best configuration (the highest
median) is computed per round. CPU-seconds per GB are printed too: a busy machine's share of its cores moves MB/s,
while CPU per byte shows what each method costs.

Usage::

    python bench/warm_ab.py --rounds 7                                  # Loader prefetch 1 and 2 vs two fio configs
    python bench/warm_ab.py --prefetch 1,2,4 --fio 2x32batch,1x128plain --run-mib 1024
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import read_anchors as anchors  # noqa: E402
from common import warm_file  # noqa: E402
from read_path import DEFAULT_DATA_DIR, GiB, MiB, SIZES, ensure_dataset, make_case, run_foresight  # noqa: E402


def fio_config(text: str) -> dict:
    """``2x32batch`` -> numjobs 2, iodepth 32, mode batch."""
    jobs, rest = text.split("x", 1)
    depth = "".join(ch for ch in rest if ch.isdigit())
    return {"numjobs": int(jobs), "iodepth": int(depth), "mode": rest[len(depth):] or "plain"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefetch", default="1,2", help="the Loader's prefetch values, one variant each")
    ap.add_argument("--fio", default="2x32batch,1x32plain", help="fio configurations: <numjobs>x<iodepth><mode>")
    ap.add_argument("--size", default="16K", choices=list(SIZES))
    ap.add_argument("--dataset-gib", type=float, default=4.0)
    ap.add_argument("--run-mib", type=int, default=512, help="bytes each run times")
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    args = ap.parse_args(argv)

    size = SIZES[args.size]
    ds = ensure_dataset(Path(args.data_dir), size, int(args.dataset_gib * GiB))
    case = make_case(args.size, size, ds, args.run_mib * MiB)
    variants = {f"loader prefetch={p}": (lambda c, p=int(p): run_foresight(c, False, prefetch=p))
                for p in args.prefetch.split(",")}
    variants.update({f"fio {t}": (lambda c, cfg=fio_config(t): anchors.run_fio(c, False, **cfg))
                     for t in args.fio.split(",")})
    print(f"{case.path}: batch {case.batch}, {case.steps} steps per run, {args.rounds} rounds, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    mbs: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # CPU-s/GB: what a busy machine's share hides
    for r in range(args.rounds):
        for name, fn in variants.items():
            warm_file(case.path)
            res = fn(case)
            mbs[name].append(res["mb_per_s"])
            cpu[name].append(res["cpu_s_per_gb"])
        print(f"  round {r + 1}: " + "  ".join(f"{n} {v[-1]:.0f}" for n, v in mbs.items()), flush=True)
    ours = [n for n in variants if n.startswith("loader")]
    fios = [n for n in variants if n.startswith("fio")]
    print(f"\nMB/s, median (min-max), and CPU-s/GB, median, over {args.rounds} rounds; load {os.getloadavg()[0]:.1f}")
    for name, v in mbs.items():
        print(f"  {name:28s} {statistics.median(v):7.0f} ({min(v):.0f}-{max(v):.0f})  "
              f"{statistics.median(cpu[name]):.3f} CPU-s/GB")
    if fios:  # fio's best: its configuration with the highest median, as read_path.py picks an anchor
        best = max(fios, key=lambda f: statistics.median(mbs[f]))
        for name in ours:
            ratio = [mbs[name][r] / mbs[best][r] for r in range(args.rounds)]
            print(f"  {name} / {best}, round by round: median {statistics.median(ratio):.2f}x "
                  f"({min(ratio):.2f}-{max(ratio):.2f}); CPU-s/GB {statistics.median(cpu[name]):.3f} vs "
                  f"{statistics.median(cpu[best]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
