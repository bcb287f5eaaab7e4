"""Where foresight's CPU goes on the object-store bench: foresight, foresight-nofill and obstore-ranges on one
dataset and one round trip, alternating runs, CPU-s/GB of the process and per thread (by name).

The same server, delaying proxy, datasets, plan and methods as bench/object_store.py (imported from it), without
the other anchors: a before/after check of the fetch path's CPU in a minute. CPU time (user + sys) is far less
disturbed by other load on a shared machine than wall time, but not free of it (see docs/buckets.md, "Where the
fill's CPU went"): take the medians of several runs. A first run, not counted, pays the imports and the first
connections. Per thread: the CPU (the scheduler's count) of every thread alive during the run, read every
``SAMPLE_S`` and at the last batch, grouped by name (``foresight-bucket``: the fetcher's GETs, checks and writes;
``tokio``: obstore's runtime; ``MainThread``: the loader's arena, the open and the consumer; ``python``: the I/O
engine's threads, the loader's read back of the cache; ``foresight-loader``, ``foresight-bucket-prefetch``).

Usage::

    python bench/object_store_cpu.py                          # media 160 MiB, 10 ms, 5 runs of each
    python bench/object_store_cpu.py --kind token --mib 32 --methods foresight --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import object_store as ob  # noqa: E402

GROUPS = ("foresight-bucket-prefetch", "foresight-bucket", "foresight-loader", "tokio", "MainThread")
SAMPLE_S = 0.2  # how often the threads' CPU is read during a run (so threads that end before its last batch count;
# reading /proc for ~70 threads costs ~1 ms a time: at 0.2 s under 0.01 CPU-s/GB of a media epoch)


def threads_cpu() -> dict[int, tuple[str, float]]:
    """CPU-s of each live thread of this process, with its name (Python's where it has one). From the scheduler's
    own count (``schedstat``, ns): the tick-sampled utime/stime of ``stat`` left over half of a media epoch's CPU
    out of the sum over its ~70 threads, most of them briefly busy."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        out[int(tid)] = (names.get(int(tid), comm), ns / 1e9)
    return out


class ThreadSampler:
    """The last CPU-s read of every thread alive at some point of a run: read every ``SAMPLE_S`` on a thread of
    its own, so a thread that ends before the last batch (the prefetcher's, once the plan is fetched) still
    counts, up to its last ``SAMPLE_S``."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.seen.update(threads_cpu())

    def __enter__(self) -> "ThreadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def group(name: str) -> str:
    return next((g for g in GROUPS if name.startswith(g)), name)


def run_foresight(case: ob.Case, env: dict, work: Path, fill: bool) -> dict:
    """One epoch as bench/object_store.py's run_foresight, with the threads' CPU taken at the last batch."""
    from foresight import open_dataset
    from foresight.bucket.prefetch import FILL_BLOCK, PlanPrefetcher
    from foresight.loader import Loader

    cache_dir = tempfile.mkdtemp(prefix="fs-", dir=work)
    at_end: dict = {}
    sampler = ThreadSampler().__enter__()
    try:
        with patch.dict(os.environ, env):
            before = threads_cpu()
            meter = ob.start_meter()
            ds = open_dataset(case.url, cache_dir=cache_dir)
            base = ds.fetcher.stats.as_dict()
            with ds, PlanPrefetcher(ds, case.plan, lookahead=ob.LOOKAHEAD,
                                    fill_block=FILL_BLOCK if fill else 0) as pf, \
                    Loader(case.plan, datasets=ds, prefetch=ob.PREFETCH, on_step=pf.on_step) as loader:
                def batches():
                    seen = 0
                    for batch in loader:
                        seen += len(batch["lengths"])
                        if seen >= case.samples:
                            sampler.__exit__()
                            at_end.update(sampler.seen)
                            at_end.update(threads_cpu())
                        yield batch

                samples, ttfb, wall, cpu = ob.consume(batches(), meter, case.samples)
                stats = ds.fetcher.stats.as_dict()
    finally:
        sampler.__exit__()
        shutil.rmtree(cache_dir, ignore_errors=True)
    gb = case.read_bytes / 1e9
    per: dict[str, float] = {}
    for tid, (name, c) in at_end.items():
        if name == "bench-sampler":
            continue
        per[group(name)] = per.get(group(name), 0.0) + c - before.get(tid, (name, 0.0))[1]
    return {"cpu_s_per_gb": cpu / gb, "samples_per_s": samples / wall,
            "requests_per_sample": (stats["requests"] - base["requests"]) / samples,
            "bytes_ratio": (stats["bytes"] - base["bytes"]) / case.needed_bytes,
            "threads_cpu_s_per_gb": {k: round(v / gb, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("media", "token"), default="media")
    ap.add_argument("--mib", type=int, default=160, help="the dataset's size (bench/object_store.py's quick: 160 "
                                                         "for media, 32 for token)")
    ap.add_argument("--rtt", type=float, default=10.0, help="round trip in ms")
    ap.add_argument("--mbit", type=float, default=800.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--methods", default="foresight,foresight-nofill,obstore-ranges")
    ap.add_argument("--data-dir", default="/tmp/foresight-bench/object-store")
    args = ap.parse_args(argv)

    from foresight.bucket.upload import upload_dataset
    from foresight.testing.seaweed import SeaweedServer
    from foresight.testing.wan import WanLink
    import torch.utils.data  # noqa: F401 - imported before any timed run, as bench/object_store.py does
    import foresight.loader  # noqa: F401

    ob.LINK_BPS[0] = args.mbit * 1e6 / 8
    work = Path(tempfile.mkdtemp(prefix="foresight-objstore-cpu-"))
    server = SeaweedServer(str(work / "seaweed"))
    server.start()
    ob.NETWORK_PIDS.append(server.proc.pid)
    try:
        direct = server.env()
        url = f"s3://bench/{args.kind}"
        with patch.dict(os.environ, direct):
            local = ob.make_dataset(Path(args.data_dir), args.kind, args.mib, 16)
            upload_dataset(local.path, url)
            case = ob.Case(args.kind, local, url, 8 if args.kind == "media" else 64)
        print(f"{args.kind}: {len(case.steps)} steps, {case.samples} samples, {case.needed_bytes / ob.MiB:.0f} MiB, "
              f"{args.rtt:g} ms, {args.mbit:g} Mbit/s", flush=True)
        with WanLink(("127.0.0.1", server.ports["s3.port"]), rtt_ms=args.rtt, mbit=args.mbit) as link:
            ob.NETWORK_PIDS.append(link.pid)
            env = dict(direct, AWS_ENDPOINT_URL=f"http://127.0.0.1:{link.port}")
            methods = {
                "foresight": lambda: run_foresight(case, env, work, True),
                "foresight-nofill": lambda: run_foresight(case, env, work, False),
                "obstore-ranges": lambda: ob.run_obstore(case, args.rtt, env),
            }
            methods = {m: methods[m] for m in args.methods.split(",")}
            next(iter(methods.values()))()  # imports and first connections: not counted
            got: dict[str, list[dict]] = {m: [] for m in methods}
            for _ in range(args.runs):  # alternating: load on the machine touches every method alike
                for m, fn in methods.items():
                    r = fn()
                    got[m].append(r)
                    print(m, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
                                         if k in ("cpu_s_per_gb", "samples_per_s", "threads_cpu_s_per_gb")}),
                          flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print()
    for m, rows in got.items():
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("cpu_s_per_gb", "samples_per_s", "requests_per_sample", "bytes_ratio")}
        each = ", ".join(f"{r['cpu_s_per_gb']:.2f}" for r in rows)
        print(f"{m:17s} CPU-s/GB {med['cpu_s_per_gb']:5.2f} (runs {each})"
              f"  samples/s {med['samples_per_s']:6.1f}  requests/sample {med['requests_per_sample']:.3f}"
              f"  bytes {med['bytes_ratio']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
