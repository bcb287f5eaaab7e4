"""Restart storm bench: a synchronized restore of thousands of ranks, six ways to serve its hot files.

Several storage-node processes run on this machine (``foresight node serve --etcd``), each behind a per-node
service limit (token buckets on bytes and requests: one node serves a bounded load, as a real disk or NIC does).
A checkpoint lies on them HDFS-style: every file on 3 nodes chosen at random. Then a restore storm: ``--ranks``
simulated ranks (a thread pool of readers sharing one :class:`~foresight.replication.hint_client.ReplicaReader`,
all released at once), ``--ranks-per-host`` to a host, each read the checkpoint's hot files (``.metadata`` and the
data file of the replicated tensors: every rank reads them) and its own shard file, every file verified by xxh3.

Side by side, each on a fresh placement of the same files on the same nodes (one checkpoint name per mode), each
planning from the same cluster state (the placement time the nodes learned from earlier modes' hints is dropped):

* ``default``: the 3 base copies only;
* ``reactive``: the storage side notices a hot file once ``safe readers`` ranks have read it (after the storm
  started), watches the load for ``--detect-s`` more, then replicates the files that crossed the line: copies land
  mid-storm;
* ``uniform``: every file on 5 copies (2 extra, capped by the nodes), made when the checkpoint was written (HDFS's
  replication factor raised): no placement on the restore's clock, but 2 extra copies of every byte;
* ``host cache``: a per-host read-through cache alone (:class:`~foresight.replication.host_share.HostShare`: the
  ranks of a host read each hot file once), base copies only;
* ``hints``: replication hints for the hot files (``ceil(readers / safe readers)`` copies) when the restart is
  declared;
* ``foresight``: hints for one reader per host (``ranks_per_host``) plus the per-host sharing.

Placement is inside every hinted total: the clock starts when the hint is sent. The hinted modes send it through
:class:`~foresight.replication.restore_schedule.HintedRestore`: the ranks start at once and are never held; while
the copies are placed every rank reads its own shard first (with sharing, a host's ranks other than local rank 0
always do), so placement runs behind the shards; each copy joins the reads when it is listed (the hot files' copy
records re-read every 50 ms); meanwhile hot fetches are admitted 4 per listed copy (a fetch queued at a base copy
would stay in its queue after the new copies land). The hint carries ``copies_join`` and the shards' bytes and reads, so the planner sizes
each hot file's copies by the file's finish (``replica_plan.finish_replicas``: up to one per node). Reactive copies
land mid-storm (their source reads go ahead of the storm's at the holder: the service limit's priority lane; one
thread of the process re-reads the copy list every ``--refresh-s`` for the ranks).

Each mode's *floor* (:mod:`storm_floors`): the least time the bed allows it, the largest of its node bytes over all
nodes' bandwidth, its reads over their request rate, and a hot file's reads over its copies; reported beside the
measured time with what set it, the CPU the bed used during the storm over the machine's cores (its CPU floor), the
machine's busy share, and the bound as run (CPU when the CPU floor is above the bytes' floor). ``--repeats`` rounds
of every mode (rotated order, the same base placement for all modes of a round): medians, the range, and foresight's ratio to each mode per round.

Layouts (``--layouts``), each scaled down by keeping its ratios (hot bytes : per-rank bytes, ranks per host, readers
per safe reader); nodes, ranks and the per-node limit set the absolute time:

* ``fsdp7b``: a 7B-parameter model with Adam under FSDP at 2,048 ranks, 8 ranks per host. Per rank: fp32 parameters
  plus the two moments, 12 bytes x 7.0e9 / 2048 = 41 MB. Hot: DCP's ``.metadata`` (every rank reads it whole, in
  ``dcp.load``'s local step), which lists each chunk of each sharded tensor: 291 parameters x 3 (parameter and two
  moments) x 2,048 chunks x 179 bytes (measured: a pickled chunk entry and storage entry of foresight's DCP writer)
  = 320 MB, plus the replicated ``step`` scalars (bytes). Hot : per-rank = 8 : 1, kept here as 256 KiB : 32 KiB.
* ``shards16k``: the earlier bed: 128 KiB of replicated tensors, 16 KiB per-rank shards.

Safe readers per copy scale with the ranks (64 at 2,048 ranks). Reported per mode: total loading time (storm start
-> last rank done, placement included), slowest and median rank, the slowest 5% of reads' share, bytes and hot-file
reads from the nodes per host, extra bytes copied between nodes, host-local bytes, and the placement time.

Usage::

    python bench/restart_storm.py                  # 12 nodes, 1024 ranks
    python bench/restart_storm.py --quick          # 8 nodes, 512 ranks, 3 rounds
    python bench/restart_storm.py --smoke          # 4 nodes, 64 ranks: checks the bench works (seconds)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
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
from storm_floors import bed_line, mode_floor  # noqa: E402

JOB, TOKEN = "storm", "storm-token-0001"
MODES = ["default", "reactive", "uniform", "host_cache", "hints", "foresight"]
LABELS = {"default": "default 3 copies", "reactive": "reactive replication", "uniform": "uniform 5 copies",
          "host_cache": "per-host cache alone", "hints": "hints alone", "foresight": "foresight (hints + host share)"}
LAYOUTS = {"fsdp7b": dict(replicated_kib=256, shard_kib=32), "shards16k": dict(replicated_kib=128, shard_kib=16)}
PRESETS = {
    "smoke": dict(nodes=4, ranks=64, limit="2M:200", threads=64, layouts="fsdp7b,shards16k", scale=1 / 4, repeats=1),
    "quick": dict(nodes=8, ranks=512, limit="2M:100", threads=256, layouts="fsdp7b,shards16k", scale=1.0, repeats=3),
    "full": dict(nodes=12, ranks=1024, limit="2M:100", threads=256, layouts="fsdp7b,shards16k", scale=1.0,
                 repeats=3),
}
REAL_RANKS, REAL_SAFE_READERS = 2048, 64
# Node limits: a read's CPU (Flight, Python, verification: about 4 ms all processes together on this bed) against its
# byte time at a node. At 4 MiB/s a 32 KiB shard takes 8 ms, so the bed's CPU (2.8 CPU-s a shared storm on 2 cores)
# sat above the per-host modes' byte floors and the storm measured the CPU; a real restore's 41 MB shard takes ~40 ms
# at 1 GB/s against ~1 ms of CPU. 2 MiB/s and 100 requests/s (both halved) put the bytes back in charge.
# Threads stay under the ranks (256): with one thread per rank, the 7 of every 8 ranks waiting for their host's
# shared fetch poll for it in this one process, and the per-host cache's storm measured that CPU (3 s -> 8 s at
# 2M:100), which real ranks on their own hosts' cores do not pay.


# -- cluster ---------------------------------------------------------------------------------------------------
class Cluster:
    """etcd and ``nodes`` node processes, each with its own data root and service limit; started in parallel
    (:meth:`wait_ready` waits for them, so the caller can prepare the checkpoint meanwhile)."""

    def __init__(self, work: Path, nodes: int, limit: str, safe_readers: int) -> None:
        from foresight.testing.etcd import EtcdProcess
        from foresight.testing.tether import start_tethered

        self.etcd = EtcdProcess(str(work / "etcd"))
        self.roots = [work / f"root-{i}" for i in range(nodes)]
        self.procs, self.ready = [], []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
        for i, root in enumerate(self.roots):
            root.mkdir(parents=True)
            ready = work / f"node-{i}.ready.json"
            log = open(work / f"node-{i}.log", "wb")
            self.procs.append(start_tethered(
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

    src = work
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


def place_default(cluster: Cluster, src: Path, name: str, replicas: int = 3, seed: int = 1) -> dict[str, list[str]]:
    """Every file on ``replicas`` nodes chosen at random (HDFS's default placement), then published there."""
    from foresight.replication.hint_client import publish_checkpoint

    rng = random.Random(seed)
    where: dict[str, list[str]] = {}
    for f in sorted(os.listdir(src)):
        for i in rng.sample(range(len(cluster.roots)), replicas):
            d = cluster.roots[i].joinpath(*name.split("/"))
            d.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, d / f)  # each node its own file, as on separate disks
            where.setdefault(f, []).append(cluster.nodes[i]["node"])
    for n, root in zip(cluster.nodes, cluster.roots):
        if root.joinpath(*name.split("/")).exists():
            publish_checkpoint(n["location"], name, job=JOB, token=TOKEN)
    return where


# -- the storm -------------------------------------------------------------------------------------------------
def make_placement(etcd: str, name: str, hints: list, *, ranks_per_host: int = 1, cold_bytes: int = 0,
              cold_reads: int = 0) -> "HintedRestore":
    """The hint of one mode, sent from a thread of its own (:class:`~foresight.replication.restore_schedule.
    HintedRestore`): at the storm's start (``hints``, ``foresight``) or once hot files are seen (``reactive``)."""
    from foresight.replication.restore_schedule import HintedRestore

    return HintedRestore(name, etcd=etcd, job=JOB, token=TOKEN, hints=hints, ranks_per_host=ranks_per_host,
                         cold_bytes=cold_bytes, cold_reads=cold_reads, ttl_s=600, timeout=600, poll_s=0.05)


class Detector:
    """Reactive replication: counts the reads of each file; once one file reached ``threshold`` readers, it watches
    for ``window_s`` more (a monitoring interval), then hints the files that reached ``threshold`` (one hint per
    checkpoint), as a storage system reacting to load would."""

    def __init__(self, placement: "HintedRestore", hot_hints: dict, threshold: int, window_s: float) -> None:
        self.placement, self.hot_hints, self.threshold, self.window_s = placement, hot_hints, threshold, window_s
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._reads = 0
        self._timer: threading.Timer | None = None
        self.fired_after_reads: int | None = None

    def saw(self, file: str) -> None:
        with self._lock:
            self._reads += 1
            self.counts[file] = self.counts.get(file, 0) + 1
            if self._timer is None and self.counts[file] >= self.threshold:
                self._timer = threading.Timer(self.window_s, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self.fired_after_reads = self._reads
            seen = [self.hot_hints[f] for f, c in self.counts.items() if f in self.hot_hints and c >= self.threshold]
        self.placement.hints = seen
        self.placement.start()

    def join(self) -> None:
        if self._timer is not None:
            self._timer.join()
        self.placement.join()


def storm(etcd: str, name: str, args: argparse.Namespace, shards: list[str], hot: list[str], *,
          share_root: Path | None = None, placement: "HintedRestore | None" = None,
          detector: Detector | None = None) -> dict:
    """All ranks released at once; each reads the hot files then its own shard. Per-read and per-rank times."""
    from foresight.replication.hint_client import ReplicaReader
    from foresight.replication.host_share import HostShare, SharedReplicaReader

    ranks, per_host = args.ranks, args.ranks_per_host
    hosts = math.ceil(ranks / per_host)
    reads: list[tuple[int, str, float, float]] = []
    lock = threading.Lock()
    shares = ([HostShare(name, directory=str(share_root / f"host-{r // per_host:04d}")) for r in range(ranks)]
              if share_root is not None else None)  # each rank joins before the first read, as at a restart
    with ReplicaReader(etcd, job=JOB, token=TOKEN, refresh_s=3600) as replicas:
        replicas.copies(name)  # the copy list once, as each rank's loader would have it before the storm
        gate = threading.Event()
        done = threading.Event()

        def refresh() -> None:
            """One thread re-reads the copy list (the ranks share it), so copies placed mid-storm take readers
            without every rank asking etcd at once."""
            while not done.wait(args.refresh_s):
                try:
                    replicas.copies(name, force=True)
                except Exception as e:  # etcd slow under the storm: keep the list we have, say so
                    print(f"  copy-list refresh failed: {str(e)[:120]}", flush=True)

        base = placement.scheduled(replicas) if placement is not None else replicas  # hot fetches admitted

        def rank(r: int) -> tuple[float, float]:
            reader = SharedReplicaReader(base, shares[r], hot=hot) if shares else base
            gate.wait()
            mine = []
            files = [*hot, shards[r]]
            for f in placement.order(files, local_rank=r % per_host) if placement is not None else files:
                if detector is not None:
                    detector.saw(f)
                t = time.perf_counter()
                reader.read(name, f)
                mine.append((r, f, t, time.perf_counter()))
            with lock:
                reads.extend(mine)
            return mine[0][2], mine[-1][3]

        refresher = None
        if detector is not None:
            refresher = threading.Thread(target=refresh, name="storm-copy-list", daemon=True)
        with cf.ThreadPoolExecutor(args.threads) as pool:
            futures = [pool.submit(rank, r) for r in range(ranks)]
            t0 = time.perf_counter()
            if placement is not None:  # inside the total; the ranks read their cold files meanwhile
                placement.reader = replicas
                placement.start()
            if refresher is not None:
                refresher.start()
            gate.set()
            try:
                spans = [f.result() for f in futures]
            finally:
                done.set()
        if refresher is not None:
            refresher.join()
        total = max(end for _, end in spans) - t0
        stats = dict(replicas.stats)
    host_fetches = hosts * len(hot) * per_host  # without sharing every rank fetches every hot file
    local_bytes = 0
    if shares is not None:
        host_fetches = sum(s.stats["fetched"] for s in shares)
        local_bytes = sum(s.stats["fetched_bytes"] for s in shares)
        for s in shares:
            s.close()
        left = [p for p in share_root.iterdir() if any(p.iterdir())]
        if left:
            raise RuntimeError(f"host shares left files behind: {left[:3]}")
    if placement is not None:
        placement.join()
    durations = sorted((end - start for _, _, start, end in reads), reverse=True)
    worst = durations[: max(1, len(durations) // 20)]
    rank_times = sorted(end - start for start, end in spans)
    out = {"total_s": total, "slowest_rank_s": rank_times[-1], "median_rank_s": statistics.median(rank_times),
           "p99_rank_s": rank_times[int(0.99 * (len(rank_times) - 1))],
           "slowest_5pct_share": sum(worst) / sum(durations), "reads": len(reads),
           "node_reads": stats["reads"], "node_bytes": stats["bytes"], "bytes_per_host": stats["bytes"] / hosts,
           "hot_reads_per_host": host_fetches / hosts, "host_local_bytes": local_bytes,
           "retries": stats["retries"], "verify_failures": stats["verify_failures"],
           "reads_by_node": dict(sorted(stats["by_node"].items())), "copy_bytes": 0, "new_replicas": 0,
           "place_s": None, "placement_error": None}
    if placement is not None:
        out.update(copy_bytes=(placement.plan or {}).get("copy_bytes", 0),
                   new_replicas=(placement.plan or {}).get("new_replicas", 0), place_s=placement.place_s,
                   placement_error=placement.error, joined_s=placement.joined_s, held_s=placement.held_s,
                   lead_s=(placement.plan or {}).get("lead_s"),
                   placement_cost_s=(placement.plan or {}).get("placement_cost_s"),
                   copy_failures=(placement.placed or {}).get("failed"),
                   place_steps=(placement.placed or {}).get("steps_s"),
                   files=plan_files(placement))
    return out


def plan_files(placement: "HintedRestore") -> list[dict]:
    """The plan per hot file: readers, copies wanted and placed, the cap that bit (e.g. ``placement_cost``)."""
    return [{k: f.get(k) for k in ("path", "size", "readers", "wanted", "replicas", "capped_by", "sized_by")}
            for f in (placement.plan or {}).get("files", [])][:4]


def release(cluster: Cluster, name: str, timeout: float = 300.0) -> None:
    """End a mode's hint and wait until the nodes reclaimed its copies: a node checks each copy it holds against
    etcd every second, so copies left from one mode would slow the next one's nodes."""
    from foresight.replication.hint_client import release_replication_hints

    release_replication_hints(name, etcd=cluster.etcd.endpoint, job=JOB, token=TOKEN)
    deadline = time.monotonic() + timeout
    while any(s["hinted_copies"] for s in cluster.stats().values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"hinted copies of {name} not reclaimed within {timeout} s")
        time.sleep(0.2)


def cpu_sample(pids: list[int]) -> tuple[float, float, float]:
    """(machine busy CPU-s, machine CPU-s, this bed's CPU-s: the bench process, its nodes and etcd) so far."""
    import psutil

    t = psutil.cpu_times()
    total = sum(t)
    busy = total - t.idle - getattr(t, "iowait", 0.0)
    ours = 0.0
    for pid in pids:
        try:
            c = psutil.Process(pid).cpu_times()
            ours += c.user + c.system
        except psutil.Error:  # a node gone: its CPU is no longer counted (the storm's figures say why)
            pass
    return busy, total, ours


def forget_placements(etcd: str) -> None:
    """Every mode plans from the same cluster state: the placement time the nodes learned from the previous modes'
    hints (``{p}/replicas/.placement``, a running mean the planner prices copies with) is dropped, so the order of
    the modes does not decide whether a mode's copies pay."""
    from foresight.cluster.membership import Cluster

    c = Cluster(etcd)
    c._call(lambda e: e.delete(c.key("replicas", ".placement")))


def run_mode(cluster: Cluster, args: argparse.Namespace, layout: str, mode: str, src: Path, shards: list[str],
             hot_hints: list, sizes: dict, work: Path, seq: list[int], seed: int) -> dict:
    """One storm of one mode on a fresh placement of the checkpoint (``seed``: the same nodes for every mode of a
    round); its copies released after."""
    etcd = cluster.etcd.endpoint
    hot = [h.path for h in hot_hints]
    seq[0] += 1
    name = f"{JOB}/{layout}-{mode}-{seq[0]}"
    copies = min(5, args.nodes) if mode == "uniform" else 3
    place_default(cluster, src, name, replicas=copies, seed=seed)
    forget_placements(etcd)
    placement = detector = share_root = None
    cold = dict(cold_bytes=args.ranks * sizes["shard_kib"] * 1024, cold_reads=args.ranks)  # the shards
    if mode == "hints":
        placement = make_placement(etcd, name, hot_hints, **cold)
    elif mode == "foresight":
        placement = make_placement(etcd, name, hot_hints, ranks_per_host=args.ranks_per_host, **cold)
    elif mode == "reactive":
        placement = make_placement(etcd, name, [])
        detector = Detector(placement, {h.path: h for h in hot_hints}, args.safe_readers, args.detect_s)
    if mode in ("host_cache", "foresight"):
        share_root = work / f"shares-{layout}-{mode}-{seq[0]}"
        share_root.mkdir()
    pids = [os.getpid(), cluster.etcd.proc.pid, *(p.pid for p in cluster.procs)]
    before = cpu_sample(pids)
    r = storm(etcd, name, args, shards, hot, share_root=share_root,
              placement=None if mode == "reactive" else placement, detector=detector)
    after = cpu_sample(pids)
    r.update(machine_busy=(after[0] - before[0]) / max(1e-9, after[1] - before[1]), cpu_s=after[2] - before[2])
    if detector is not None:
        detector.join()  # the hint may land after a short storm: counted all the same
        r.update(detected_after_reads=detector.fired_after_reads, place_s=placement.place_s,
                 copy_bytes=(placement.plan or {}).get("copy_bytes", 0),
                 new_replicas=(placement.plan or {}).get("new_replicas", 0), placement_error=placement.error,
                 files=plan_files(placement), place_steps=(placement.placed or {}).get("steps_s"))
    if mode == "uniform":  # the extra copies were made when the checkpoint was written, off the restore's clock
        r.update(copy_bytes=(copies - 3) * sum(os.path.getsize(src / f) for f in os.listdir(src)),
                 new_replicas=(copies - 3) * len(os.listdir(src)))
    if placement is not None and placement.plan is not None:
        release(cluster, name)
    if share_root is not None:
        shutil.rmtree(share_root, ignore_errors=True)
    return r


def floor_of(args: argparse.Namespace, mode: str, r: dict, hot_sizes: dict[str, int], shard_bytes: int) -> dict:
    """The mode's floor (:func:`storm_floors.mode_floor`) with the copies it had: the plan's for hinted modes."""
    from foresight.cluster.throttle import parse_amounts

    b, q = parse_amounts(args.limit)
    base = min(5, args.nodes) if mode == "uniform" else 3
    copies = {f: base for f in hot_sizes}
    for f in r.get("files") or []:
        copies[f["path"]] = f["replicas"]
    # copies made on the restore's clock are node bytes too; uniform's were made at the save
    copy_bytes = 0 if mode == "uniform" else r["copy_bytes"]
    return mode_floor(nodes=args.nodes, node_bytes_per_s=b, node_requests_per_s=q or None, ranks=args.ranks,
                      ranks_per_host=args.ranks_per_host, hot=hot_sizes, shard_bytes=shard_bytes,
                      shared=mode in ("host_cache", "foresight"), copies=copies, copy_bytes=copy_bytes)


def run_layout(cluster: Cluster, args: argparse.Namespace, layout: str, work: Path, seq: list[int]) -> dict:
    """``args.repeats`` rounds of every mode (each round in a rotated order, so load drift on the machine does not
    fall on one mode); per mode the median round's figures, every round's total, and the floor."""
    from foresight.replication.hints import derive_dcp_hints

    sizes = {k: max(1, int(v * args.scale)) for k, v in LAYOUTS[layout].items()}
    src, shards = write_checkpoint(work / f"ckpt-{layout}", args.ranks, sizes["replicated_kib"], sizes["shard_kib"])
    hot_hints = derive_dcp_hints(str(src), args.ranks)  # .metadata and the data file; shards are not in it
    hosts = math.ceil(args.ranks / args.ranks_per_host)
    hot = [h.path for h in hot_hints]
    hot_sizes = {h.path: h.size for h in hot_hints}
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for rep in range(args.repeats):
        k = rep % len(args.modes)
        for mode in args.modes[k:] + args.modes[:k]:
            r = run_mode(cluster, args, layout, mode, src, shards, hot_hints, sizes, work, seq, seed=rep + 1)
            runs[mode].append(r)
            print(f"  {layout} round {rep + 1}/{args.repeats} {mode:>10}: {r['total_s']:.2f} s, "
                  f"{r['bytes_per_host'] / 1024:.0f} KiB/host from the nodes, +{r['copy_bytes'] / 1024:.0f} KiB "
                  f"copied, machine busy {100 * r['machine_busy']:.0f}%", flush=True)
    results: dict[str, dict] = {}
    for mode in args.modes:
        totals = [r["total_s"] for r in runs[mode]]
        med = sorted(runs[mode], key=lambda r: r["total_s"])[(len(totals) - 1) // 2]  # the median round
        r = dict(med, total_s=statistics.median(totals), rounds_total_s=totals,
                 spread_s=[min(totals), max(totals)])
        f = floor_of(args, mode, med, hot_sizes, sizes["shard_kib"] * 1024)
        cpu_floor = statistics.median(x["cpu_s"] for x in runs[mode]) / (os.cpu_count() or 1)
        r.update(floor=f, over_floor=r["total_s"] / f["floor_s"], cpu_floor_s=cpu_floor,
                 bound=f"CPU ({cpu_floor:.2f} s)" if cpu_floor >= f["floor_s"] else f["bound"])
        results[mode] = r
    d = results["default"]["total_s"]
    for r in results.values():
        r["reduction"] = 1 - r["total_s"] / d
    vs = {}
    if "foresight" in results:
        for m in results:
            if m == "foresight":
                continue
            ratios = [f["total_s"] / o["total_s"] for f, o in zip(runs["foresight"], runs[m])]  # same round
            vs[m] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}
    best_other = min((m for m in results if m not in ("default", "foresight")),
                     key=lambda m: results[m]["total_s"], default=None)
    return {"sizes": sizes, "hot": hot, "hot_bytes": sum(h.size for h in hot_hints), "hosts": hosts,
            "ckpt_bytes": sum(os.path.getsize(src / f) for f in os.listdir(src)),
            "shard_bytes": sizes["shard_kib"] * 1024, "modes": results, "best_alternative": best_other,
            "foresight_vs": vs,
            "foresight_vs_best_alternative": (results["foresight"]["total_s"] / results[best_other]["total_s"]
                                              if best_other and "foresight" in results else None)}


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="restart-storm-", dir=args.dir))
    cluster = None
    try:
        t = time.perf_counter()
        cluster = Cluster(work, args.nodes, args.limit, args.safe_readers)
        cluster.wait_ready()
        print(f"restart_storm: {args.nodes} nodes, {args.ranks} ranks ({args.ranks_per_host} per host), limit "
              f"{args.limit}/node, safe readers {args.safe_readers}; set-up {time.perf_counter() - t:.1f} s",
              flush=True)
        seq = [0]
        layouts = {layout: run_layout(cluster, args, layout, work, seq) for layout in args.layouts}
        node_stats = cluster.stats()
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    from foresight.cluster.throttle import parse_amounts

    b, q = parse_amounts(args.limit)
    return {"config": {k: getattr(args, k) for k in ("nodes", "ranks", "ranks_per_host", "limit", "threads",
                                                       "safe_readers", "refresh_s", "scale", "layouts", "modes",
                                                       "preset", "repeats")},
            "bed": bed_line(args.nodes, b, q or None),
            "layouts": layouts,
            "node_stats": {n: {k: s[k] for k in ("reads", "bytes", "copies_made", "reclaimed")}
                           for n, s in node_stats.items()}}


# -- output ----------------------------------------------------------------------------------------------------
def report(res: dict) -> list[dict]:
    cfg = res["config"]
    tables = []
    for layout, lr in res["layouts"].items():
        rows, floors = [], []
        for mode, r in lr["modes"].items():
            lo, hi = r.get("spread_s", [r["total_s"]] * 2)
            vs = lr.get("foresight_vs", {}).get(mode)
            rows.append([LABELS[mode], f"{r['total_s']:.2f}", f"{lo:.2f}-{hi:.2f}", f"{100 * r['reduction']:.1f}%",
                         "-" if vs is None else f"{vs['median']:.2f} ({vs['min']:.2f}-{vs['max']:.2f})",
                         f"{r['slowest_rank_s']:.2f}", f"{r['median_rank_s']:.2f}",
                         f"{r['bytes_per_host'] / 1024:.0f}", f"{r['hot_reads_per_host']:.1f}",
                         f"{r['copy_bytes'] / 1024:.0f}", f"{r['host_local_bytes'] / 1024:.0f}",
                         "-" if r["place_s"] is None else f"{r['place_s']:.2f}", r["retries"]])
            f = r["floor"]
            floors.append([LABELS[mode], f"{f['node_bytes'] / 2**20:.1f}", f"{f['hot_bytes'] / 2**20:.1f}",
                           f"{f['cold_bytes'] / 2**20:.1f}", f"{f['copy_bytes'] / 2**20:.2f}", f["node_reads"],
                           f"{f['floor_s']:.2f}", f["bound"], f"{r['cpu_s']:.1f}", f"{r['cpu_floor_s']:.2f}",
                           f"{100 * r['machine_busy']:.0f}%", f"{r['total_s']:.2f}", f"{r['over_floor']:.2f}",
                           r["bound"]])
        head = (f"{layout}: {cfg['ranks']} ranks ({cfg['ranks_per_host']} per host), hot "
                f"{lr['hot_bytes'] // 1024} KiB + {lr['shard_bytes'] // 1024} KiB per rank, "
                f"{cfg['nodes']} nodes at {cfg['limit']} (bytes/s:requests/s) each")
        tables.append({"title": f"{head}; medians of {cfg.get('repeats', 1)} rounds",
                       "header": ["mode", "total s", "range s", "vs default", "foresight / it (range)",
                                  "slowest rank s", "median rank s", "KiB/host from nodes", "hot reads/host",
                                  "extra KiB copied", "host-local KiB", "place s", "retries"],
                       "rows": rows})
        tables.append({"title": f"{layout}: the floor of each mode ({res.get('bed', '')})",
                       "header": ["mode", "MiB from nodes", "hot MiB", "shard MiB", "copies MiB", "reads",
                                  "floor s", "floor set by", "bed CPU-s", "CPU floor s", "machine busy",
                                  "measured s", "x floor", "bound as run"],
                       "rows": floors})
    return tables


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(res["layouts"])
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        modes = res["layouts"][layout]["modes"]
        names = list(modes)
        ax.bar(range(len(names)), [modes[m]["total_s"] for m in names],
               color=["tab:gray" if m == "default" else "tab:green" if m == "foresight" else "tab:blue"
                      for m in names])
        for i, m in enumerate(names):
            ax.text(i, modes[m]["total_s"], f"+{modes[m]['copy_bytes'] / 1048576:.1f} MiB", ha="center",
                    va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([LABELS[m] for m in names], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("total loading time, s (placement included)")
        ax.set_title(f"{layout}: {res['config']['ranks']} ranks; labels: extra bytes copied", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="4 nodes, 64 ranks: checks the bench works")
    ap.add_argument("--quick", action="store_true", help="8 nodes, 512 ranks")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--layouts", default=None, help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES} (default first)")
    ap.add_argument("--scale", type=float, default=None, help="multiplies the layouts' file sizes")
    ap.add_argument("--limit", default=None, help="per-node service limit BYTES[K|M|G]:REQUESTS per second")
    ap.add_argument("--threads", type=int, default=None, help="reader threads (ranks in flight at once)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of every mode (medians reported)")
    ap.add_argument("--safe-readers", type=int, default=None,
                    help=f"readers one copy serves well (default: {REAL_SAFE_READERS} at {REAL_RANKS} ranks, scaled)")
    ap.add_argument("--refresh-s", type=float, default=0.25, help="how often readers re-read the copy list")
    ap.add_argument("--detect-s", type=float, default=0.5,
                    help="reactive mode: how long the storage side watches the load before it replicates")
    ap.add_argument("--dir", default=None, help="scratch directory (default: the system's temp directory)")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON and PNG go")
    args = ap.parse_args(argv)
    args.preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.safe_readers is None:
        args.safe_readers = max(1, round(REAL_SAFE_READERS * args.ranks / REAL_RANKS))
    args.layouts = [x for x in str(args.layouts).split(",") if x]
    args.modes = [x for x in str(args.modes).split(",") if x]
    bad = sorted(set(args.layouts) - set(LAYOUTS)) + sorted(set(args.modes) - set(MODES))
    if bad or "default" not in args.modes:
        ap.error(f"unknown layouts/modes {bad}, or no default mode to compare with")
    res = run(args)
    for t in report(res):
        print()
        print_table([dict(zip(t["header"], r)) for r in t["rows"]], t["header"], t["title"])
    print()
    for layout, lr in res["layouts"].items():
        f = lr["modes"].get("foresight")
        if f is not None:
            print(f"{layout}: foresight loading-time reduction {100 * f['reduction']:.1f}% vs the default (paper: "
                  f"40.8%, target >= 50%); {lr['foresight_vs_best_alternative']:.2f}x the best alternative "
                  f"({lr['best_alternative']}); per round against each: " + ", ".join(
                      f"{m} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" for m, v in lr["foresight_vs"].items()))
    failures = sum(r["verify_failures"] for lr in res["layouts"].values() for r in lr["modes"].values())
    print(f"verify failures {failures}")
    suffix = "" if args.preset == "full" else f"_{args.preset}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"title": "Restart storm: six ways to serve a synchronized restore's hot checkpoint files",
               "machine": machine(), **res, "report": report(res),
               "notes": [f"medians of {res['config']['repeats']} rounds (each round every mode once, in a rotated "
                         "order; the same base placement for every mode of a round); range = fastest-slowest round; "
                         "foresight / it = foresight's total over the mode's in the same round",
                         "floor = the least time the bed allows the mode (bench/storm_floors.py): its node bytes "
                         "over all nodes' bandwidth, its reads over their request rate, or a hot file's reads over "
                         "its copies, whichever is largest; bed CPU-s = CPU the bench process, its nodes and etcd "
                         "used during the storm (median round); CPU floor = that over the machine's cores; bound "
                         "as run = CPU when the CPU floor is above the bytes' floor; machine busy = all cores' busy "
                         "share during the storm, other tenants included",
                         "total = the storm start (the hint sent at the same moment, the ranks not held for it) "
                         "to the last rank done, placement included; slowest rank = its "
                         "first read to its last; each node behind a token-bucket service limit; KiB/host = bytes "
                         "the nodes served / hosts; hot reads/host = hot-file fetches from the nodes per host"]}
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
