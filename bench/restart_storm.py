"""Restart storm bench: a synchronized restore of thousands of ranks, default 3 replicas vs replication hints.

Several storage-node processes run on this machine (``foresight node serve --etcd``), each behind a per-node
service limit (token buckets on bytes and requests: one node serves a bounded load, as a real disk or NIC does).
A checkpoint lies on them HDFS-style: every file on 3 nodes chosen at random. Then a restore storm: ``--ranks``
simulated ranks (a thread pool of readers sharing one :class:`~foresight.checkpoint.hint_client.ReplicaReader`,
all released at once) each read the checkpoint's ``.metadata``, the data file of the replicated tensors (a DCP
checkpoint of whole tensors: every rank reads it) and its own shard file, every file verified by xxh3.

Side by side in one run, on the same nodes and files:

* ``default``: the 3 base copies only;
* ``hinted``: after ``set_replication_hints`` (derived from the DCP checkpoint and the world size), the hot files
  are copied node to node to ``ceil(readers / safe readers)`` nodes (capped by the nodes), then the same storm.

Reported: total checkpoint loading time (storm start -> last rank done), the slowest rank's time (its first read
to its last), the share of read time spent in the slowest 5% of reads, the hot files' share, reads per node, and
what the replicas cost (bytes copied, copies, time from the hint to the last copy placed).

Usage::

    python bench/restart_storm.py                  # 12 nodes, 2048 ranks (about two minutes on a quiet machine)
    python bench/restart_storm.py --quick          # 8 nodes, 2048 ranks, smaller files
    python bench/restart_storm.py --smoke          # 4 nodes, 256 ranks: checks the bench works (seconds)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))

from common import RESULTS, machine, print_table, write_results  # noqa: E402

JOB, TOKEN = "storm", "storm-token-0001"
NAME = f"{JOB}/step-00000100"
PRESETS = {
    "smoke": dict(nodes=4, ranks=256, replicated_kib=64, shard_kib=8, limit="2M:200", threads=64),
    "quick": dict(nodes=8, ranks=2048, replicated_kib=128, shard_kib=16, limit="4M:200", threads=256),
    "full": dict(nodes=12, ranks=2048, replicated_kib=256, shard_kib=32, limit="4M:200", threads=256),
}


# -- cluster ---------------------------------------------------------------------------------------------------
class Cluster:
    """etcd and ``nodes`` node processes, each with its own data root and service limit; started in parallel
    (:meth:`wait_ready` waits for them, so the caller can prepare the checkpoint meanwhile)."""

    def __init__(self, work: Path, nodes: int, limit: str, safe_readers: int) -> None:
        from foresight.node.etcd_process import EtcdProcess

        self.etcd = EtcdProcess(str(work / "etcd"))
        self.roots = [work / f"root-{i}" for i in range(nodes)]
        self.procs, self.ready = [], []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
        for i, root in enumerate(self.roots):
            root.mkdir(parents=True)
            ready = work / f"node-{i}.ready.json"
            log = open(work / f"node-{i}.log", "wb")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "foresight", "node", "serve", "--root", str(root), "--etcd", self.etcd.endpoint,
                 "--node-id", f"s{i:02d}", "--ttl", "5", "--cpu-threshold", "101", "--service-limit", limit,
                 "--safe-readers", str(safe_readers), "--replica-quota", "64G:100000", "--ready-file", str(ready),
                 "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT, env=env))
            self.ready.append(ready)
        self.work = work

    def wait_ready(self, timeout: float = 300.0) -> None:
        work = self.work
        deadline = time.monotonic() + timeout
        while not all(r.exists() for r in self.ready):
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"nodes {dead} exited or none ready in time; see {work}/node-*.log")
            time.sleep(0.2)
        self.nodes = [json.loads(r.read_text()) for r in self.ready]

    def stats(self) -> dict[str, dict]:
        import pyarrow.flight as flight

        out = {}
        for n in self.nodes:
            c = flight.FlightClient(n["location"])
            try:
                res = list(c.do_action(flight.Action("replicas.stats", b"{}")))
                out[n["node"]] = json.loads(res[0].body.to_pybytes())
            finally:
                c.close()
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 2  # figures are in: no need to wait for a graceful drain
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.etcd.close()


# -- checkpoint ------------------------------------------------------------------------------------------------
def write_checkpoint(work: Path, ranks: int, replicated_kib: int, shard_kib: int) -> tuple[Path, list[str]]:
    """A DCP checkpoint of whole (replicated) tensors plus one shard file per rank; returns (dir, shard names)."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    from foresight.checkpoint.dcp import ForesightStorageWriter

    src = work / "ckpt"
    elems = replicated_kib * 1024 // 4
    state = {"embed": torch.randn(elems // 2), "norm": torch.randn(elems - elems // 2)}
    dcp.save(state, storage_writer=ForesightStorageWriter(src))
    rng = np.random.default_rng(0)
    shards = []
    for r in range(ranks):
        name = f"shard-{r:05d}.bin"
        (src / name).write_bytes(rng.integers(0, 255, shard_kib * 1024, dtype=np.uint8).tobytes())
        shards.append(name)
    return src, shards


def place_default(cluster: Cluster, src: Path, replicas: int = 3, seed: int = 1) -> dict[str, list[str]]:
    """Every file on ``replicas`` nodes chosen at random (HDFS's default placement), then published there."""
    from foresight.checkpoint.hint_client import publish_checkpoint

    rng = random.Random(seed)
    where: dict[str, list[str]] = {}
    for f in sorted(os.listdir(src)):
        for i in rng.sample(range(len(cluster.roots)), replicas):
            d = cluster.roots[i] / JOB / "step-00000100"
            d.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, d / f)  # each node its own file, as on separate disks
            where.setdefault(f, []).append(cluster.nodes[i]["node"])
    for n, root in zip(cluster.nodes, cluster.roots):
        if (root / JOB).exists():
            publish_checkpoint(n["location"], NAME, job=JOB, token=TOKEN)
    return where


# -- the storm -------------------------------------------------------------------------------------------------
def storm(etcd: str, ranks: int, shards: list[str], hot: list[str], threads: int) -> dict:
    """All ranks released at once; each reads the hot files then its own shard. Per-read and per-rank times."""
    from foresight.checkpoint.hint_client import ReplicaReader

    reads: list[tuple[int, str, float, float]] = []
    lock = threading.Lock()
    with ReplicaReader(etcd, job=JOB, token=TOKEN, refresh_s=600) as reader:
        reader.copies(NAME)  # the copy list once, as each rank's loader would have it before the storm
        gate = threading.Event()

        def rank(r: int) -> tuple[float, float]:
            gate.wait()
            mine = []
            for f in [*hot, shards[r]]:
                t = time.perf_counter()
                reader.read(NAME, f)
                mine.append((r, f, t, time.perf_counter()))
            with lock:
                reads.extend(mine)
            return mine[0][2], mine[-1][3]

        with cf.ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(rank, r) for r in range(ranks)]
            t0 = time.perf_counter()
            gate.set()
            spans = [f.result() for f in futures]
        total = max(end for _, end in spans) - t0
        stats = dict(reader.stats)
    durations = sorted((end - start for _, _, start, end in reads), reverse=True)
    worst = durations[: max(1, len(durations) // 20)]
    hot_time = sum(end - start for _, f, start, end in reads if f in hot)
    rank_times = sorted(end - start for start, end in spans)
    return {"total_s": total, "slowest_rank_s": rank_times[-1], "median_rank_s": statistics.median(rank_times),
            "p99_rank_s": rank_times[int(0.99 * (len(rank_times) - 1))],
            "slowest_5pct_share": sum(worst) / sum(durations), "hot_share": hot_time / sum(durations),
            "reads": len(reads), "retries": stats["retries"], "verify_failures": stats["verify_failures"],
            "reads_by_node": dict(sorted(stats["by_node"].items()))}


def run(args: argparse.Namespace) -> dict:
    from foresight.checkpoint.hint_client import set_replication_hints, wait_for_replicas
    from foresight.checkpoint.hints import derive_dcp_hints

    work = Path(tempfile.mkdtemp(prefix="restart-storm-", dir=args.dir))
    cluster = None
    try:
        t = time.perf_counter()
        cluster = Cluster(work, args.nodes, args.limit, args.safe_readers)
        src, shards = write_checkpoint(work, args.ranks, args.replicated_kib, args.shard_kib)
        cluster.wait_ready()
        dcp_files = derive_dcp_hints(str(src), args.ranks)  # .metadata and the data file; shards are not in it
        hot = [h.path for h in dcp_files]
        where = place_default(cluster, src)
        setup_s = time.perf_counter() - t
        print(f"restart_storm: {args.nodes} nodes, {args.ranks} ranks, limit {args.limit}/node; "
              f"hot files {hot} on {[where[h] for h in hot]}; set-up {setup_s:.1f} s", flush=True)
        results = {}
        results["default"] = storm(cluster.etcd.endpoint, args.ranks, shards, hot, args.threads)
        print(f"  default: {results['default']['total_s']:.2f} s", flush=True)
        t = time.perf_counter()
        plan = set_replication_hints(NAME, etcd=cluster.etcd.endpoint, job=JOB, token=TOKEN, ttl_s=600,
                                     checkpoint_dir=str(src), world_size=args.ranks, hints=dcp_files)
        placed = wait_for_replicas(NAME, etcd=cluster.etcd.endpoint, job=JOB, token=TOKEN, timeout=300)
        place_s = time.perf_counter() - t
        results["hinted"] = storm(cluster.etcd.endpoint, args.ranks, shards, hot, args.threads)
        print(f"  hinted:  {results['hinted']['total_s']:.2f} s", flush=True)
        node_stats = cluster.stats()
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    d, h = results["default"], results["hinted"]
    cost = {"copy_bytes": plan["copy_bytes"], "new_replicas": plan["new_replicas"], "place_s": place_s,
            "copy_failures": placed["failed"],
            "files": [{k: f[k] for k in ("path", "size", "readers", "wanted", "replicas", "capped_by")}
                      for f in plan["files"]]}
    return {"config": {k: getattr(args, k) for k in ("nodes", "ranks", "replicated_kib", "shard_kib", "limit",
                                                       "threads", "safe_readers", "preset")},
            "default": d, "hinted": h, "replicas": cost, "base_placement": {f: where[f] for f in hot},
            "reduction": 1 - h["total_s"] / d["total_s"],
            "slowest_rank_reduction": 1 - h["slowest_rank_s"] / d["slowest_rank_s"],
            "node_stats": {n: {k: s[k] for k in ("reads", "bytes", "copies_made", "reclaimed")}
                           for n, s in node_stats.items()}}


# -- output ----------------------------------------------------------------------------------------------------
def report(res: dict) -> list[dict]:
    d, h, c = res["default"], res["hinted"], res["replicas"]
    rows = [[name, f"{r['total_s']:.2f}", f"{r['slowest_rank_s']:.2f}", f"{r['median_rank_s']:.2f}",
             f"{100 * r['slowest_5pct_share']:.1f}%", f"{100 * r['hot_share']:.1f}%", len(r["reads_by_node"]),
             r["retries"]] for name, r in (("default 3 replicas", d), ("hinted", h))]
    rows.append(["reduction", f"{100 * res['reduction']:.1f}%", f"{100 * res['slowest_rank_reduction']:.1f}%",
                 "", "", "", "", ""])
    cfg = res["config"]
    return [
        {"title": f"restore storm: {cfg['ranks']} ranks, {cfg['nodes']} nodes at {cfg['limit']} (bytes/s:requests/s) "
                  "each", "header": ["replication", "total s", "slowest rank s", "median rank s",
                                     "slowest 5% reads' share", "hot files' share", "nodes serving", "retries"],
         "rows": rows},
        {"title": "what the hinted replicas cost", "header": ["file", "bytes", "readers", "wanted", "replicas",
                                                              "capped by"],
         "rows": [[f["path"], f["size"], f["readers"], f["wanted"], f["replicas"], f["capped_by"] or "-"]
                  for f in c["files"]]
                 + [["total", c["copy_bytes"], "", "", f"+{c['new_replicas']} copies",
                     f"placed in {c['place_s']:.2f} s"]]},
    ]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["default", "hinted"]
    x = range(len(names))
    for j, (key, label) in enumerate([("total_s", "total loading"), ("slowest_rank_s", "slowest rank"),
                                      ("median_rank_s", "median rank")]):
        a.bar([i + (j - 1) * 0.27 for i in x], [res[n][key] for n in names], 0.27, label=label)
    a.set_xticks(list(x))
    a.set_xticklabels(["default 3 replicas", f"hinted (+{res['replicas']['new_replicas']} copies)"])
    a.set_ylabel("seconds")
    a.set_title(f"{res['config']['ranks']} ranks: {100 * res['reduction']:.0f}% less loading time")
    a.legend(fontsize=8)
    nodes = sorted(set(res["default"]["reads_by_node"]) | set(res["hinted"]["reads_by_node"]))
    for j, n in enumerate(names):
        b.bar([i + (j - 0.5) * 0.4 for i in range(len(nodes))], [res[n]["reads_by_node"].get(k, 0) for k in nodes],
              0.4, label=n)
    b.set_xticks(range(len(nodes)))
    b.set_xticklabels(nodes, rotation=45, fontsize=7)
    b.set_ylabel("reads served")
    b.set_title("reads per node")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="4 nodes, 256 ranks: checks the bench works")
    ap.add_argument("--quick", action="store_true", help="8 nodes, 2048 ranks, smaller files")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--replicated-kib", type=int, default=None, help="size of the replicated tensors' data file")
    ap.add_argument("--shard-kib", type=int, default=None, help="size of each rank's own shard file")
    ap.add_argument("--limit", default=None, help="per-node service limit BYTES[K|M|G]:REQUESTS per second")
    ap.add_argument("--threads", type=int, default=None, help="reader threads (ranks in flight at once)")
    ap.add_argument("--safe-readers", type=int, default=64, help="readers one replica serves well (the planner's)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: the system's temp directory)")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON and PNG go")
    args = ap.parse_args(argv)
    args.preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    res = run(args)
    d, h = res["default"], res["hinted"]
    for t in report(res):
        print()
        print_table([dict(zip(t["header"], r)) for r in t["rows"]], t["header"], t["title"])
    print(f"\nloading-time reduction {100 * res['reduction']:.1f}% (paper: 40.8%, target >= 50%); "
          f"verify failures {d['verify_failures'] + h['verify_failures']}")
    suffix = "" if args.preset == "full" else f"_{args.preset}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"title": "Restart storm: hot checkpoint files replicated ahead of a synchronized restore",
               "machine": machine(), **res, "report": report(res),
               "notes": ["total = storm start to the last rank done; slowest rank = its first read to its last; "
                         "slowest 5% reads' share = their part of all read time (paper: stragglers 67.97% of the "
                         "waiting); each node behind a token-bucket service limit"]}
    if out == RESULTS:
        path = write_results(f"restart_storm{suffix}", payload)
    else:
        path = out / f"restart_storm{suffix}.json"
        path.write_text(json.dumps(payload, indent=2, default=str))
    plot(res, out / f"restart_storm{suffix}.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
