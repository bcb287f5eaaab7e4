"""Remote checkpoint merge: an evaluation site 100 ms away merges a training job's distributed checkpoint.

The paper's setting (§3): a companion evaluation in another datacenter merges the job's DCP checkpoint into
safetensors per modality; most tensors are tiny (> 60% under 16 KiB) while most bytes sit in a few large ones,
so reading tensor by tensor over the WAN pays one round trip per tensor. Two sites run here as real processes
(replication nodes over Arrow Flight, etcd), joined by foresight's delaying TCP proxy (this kernel has no netem)
with a configurable RTT and bandwidth cap per direction. A 2-rank gloo job saves a paper-shaped checkpoint
through foresight's DCP writer with ``Replication(every=100, site="eval-b")``. Then, at the evaluation site:

- ``baseline``: merge reading each tensor chunk remotely as the merge needs it (DCP over a remote filesystem);
- ``coalesced remote``: the same merge, all extents of a file in one coalesced remote read (no replica);
- ``foresight``: merge from the local replica made during the save (resolved through etcd);
- ``bulk copy``: the committed directory copied after the commit over a link like the replication's (one TCP
  stream, as tar over ssh would, and ``--bulk-streams`` parallel ones), then the same merge from the copy;
- ``foresight, merging as units arrive``: the evaluation site merges each unit once it is verified and durable
  (``Replication(merge=...)``), for saves at several simulated write speeds (``--write-mbps``: saves shorter and
  longer than the transfer), beside the replica-then-merge and coalesced-remote figures of the same run.

Reported: merge latency and its reduction vs the baseline (paper: -76.1%; target here >= 90%), commit ->
replica-ready time, end-to-end commit -> merged, bytes over the link, round trips; and an unpredicted urgent
evaluation issued while a bulk replication is in flight, with a FIFO sender and with the priority lane.

    python bench/remote_merge.py            # the full run (minutes: the baseline pays ~0.1 s per tensor)
    python bench/remote_merge.py --smoke    # small checkpoint; what tests/test_bench_remote_merge_smoke.py runs
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import RESULTS, evict_file, machine, print_table  # noqa: E402

NAME = "lm/step-00000100"


def paper_shaped(n_small: int, n_large: int, large_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Most tensors < 16 KiB by count (norms, biases, small projections), most bytes in large ones."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    state: dict[str, torch.Tensor] = {}
    for i in range(n_small):
        group = "vision" if i % 3 == 0 else "text"
        n = int(rng.integers(64, 8192))  # 128 B .. 16 KiB in bf16
        state[f"{group}.layers.{i // 8}.small{i % 8}"] = torch.randn(n, generator=g).to(torch.bfloat16)
    rows = 256
    for i in range(n_large):
        group = "vision" if i % 3 == 0 else "text"
        cols = max(1, large_bytes // (rows * 2))
        state[f"{group}.layers.{i}.w"] = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    return state


def _rank(rank: int, init: str, path: str, node: str, sizes: tuple[int, int, int], out: str, step: int = 100,
          merge: dict[str, Any] | None = None, write_mbps: float = 0.0, unit: int | None = None,
          job: str = "lm") -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from foresight.replication.policy import Replication, ReplicatingStorageWriter

    from foresight.distributed import run_then_end

    def save() -> None:
        mesh = init_device_mesh("cpu", (2,))
        state = paper_shaped(*sizes)
        # large tensors sharded across the ranks (concatenated by the merge); small ones replicated (stored once)
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() == 2 else v for k, v in state.items()}
        rep = Replication(every=100, site="eval-b", node=node, job=job, merge=merge, unit_bytes=unit)
        writer_class = paced_writer(ReplicatingStorageWriter, write_mbps) if write_mbps else ReplicatingStorageWriter
        committed: dict[str, float] = {}
        tell_node = rep.committed

        def stamp_commit(step_: int, path_: str) -> None:
            # the commit is the moment the .metadata is in place, just before the node is told (telling it waits on
            # the node, and dcp.save returns only after a collective: either can outlast the site's publish)
            committed["at"] = time.time()
            tell_node(step_, path_)

        rep.committed = stamp_commit
        t0 = time.time()
        dcp.save(state, storage_writer=writer_class(path, replicate=rep, step=step))
        if rank == 0:  # the coordinator: the rank that ran finish
            with open(out, "w") as f:
                json.dump({"save_started": t0, "committed": committed["at"]}, f)
        rep.close()

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    run_then_end(save)  # the DTensors and mesh are freed before gloo ends (foresight.distributed)


def paced_writer(base: type, mbps: float) -> type:
    """``base`` (a ReplicatingStorageWriter) whose data file lands at ``mbps`` MB/s per rank: each piece is
    reported (and its units released to the sender) no earlier than the simulated disk would have written it,
    and the save commits only after the last one: saves shorter and longer than the transfer, on one machine."""

    class Paced(base):
        def _write_file(self, fio: Any, fd: int, view: memoryview, path: str) -> None:
            real, t0 = fio.write_reporting, time.perf_counter()

            def paced(fd: int, view: memoryview, ends: Any, on_written: Any, *, path: str | None = None) -> None:
                def report(end: int) -> None:
                    time.sleep(max(0.0, t0 + end / (mbps * 1e6) - time.perf_counter()))
                    on_written(end)

                real(fd, view, ends, report, path=path)

            fio.write_reporting = paced
            super()._write_file(fio, fd, view, path)

    return Paced


def arrival_run(work: str, tr: Any, ev: Any, sizes: tuple[int, int, int], step: int, write_mbps: float,
                link_mbit: float, unit: int, job: str = "lm") -> dict[str, Any]:
    """A save at ``write_mbps`` MB/s per rank (0: as fast as the disk) whose evaluation site merges the units as
    they arrive, beside merging its replica once it is ready. Returns the row (seconds from the source commit)."""
    import torch.multiprocessing as tmp_mp

    name = f"{job}/step-{step:08d}"
    src = os.path.join(tr.root, job, f"step-{step:08d}")
    stamp = os.path.join(work, f"save-{job}-{step}.json")
    groups = {"vision.": "vision", "text.": "text"}
    tmp_mp.spawn(_rank, args=(os.path.join(work, f"init-{job}-{step}"), src, tr.url, sizes, stamp, step,
                              {"groups": groups}, write_mbps, unit, job), nprocs=2, join=True)
    saved = json.load(open(stamp))
    info = tr.call("replicate.wait", {"name": name, "timeout": 3600})
    st = ev.call("replica.merged", {"name": name, "timeout": 3600})
    for f in os.listdir(info["path"]):
        evict_file(os.path.join(info["path"], f))
    from foresight.replication.source import LocalSource

    t_merge, after = timed_merge(LocalSource(info["path"]), os.path.join(work, f"out_after_{job}_{step}"))
    state = paper_shaped(*sizes)
    checked = check_merged(st["paths"], state) == check_merged(after, state)
    del state
    save_s = saved["committed"] - saved["save_started"]
    transfer_s = info["bytes_sent"] * 8 / (link_mbit * 1e6)
    ready = info["ready_at"] - saved["committed"]
    return {"write_MBps_per_rank": write_mbps or "disk", "save_s": save_s, "transfer_s_at_link_rate": transfer_s,
            "save_longer_than_transfer": save_s >= transfer_s,
            "MiB_left_at_commit": info["bytes_left_at_commit"] / 2**20, "commit_to_ready_s": ready,
            "merge_after_s": t_merge, "commit_to_merged_replica_then_merge_s": max(0.0, ready) + t_merge,
            "commit_to_merged_arrival_s": st["stats"]["published_at"] - saved["committed"],
            "filled_at_commit_MiB": st["stats"]["bytes_filled_at_commit"] / 2**20,
            "relayouts": st["stats"]["relayouts"], "outputs_match_saved_state": checked,
            "committed_at": saved["committed"]}


def concurrent(calls: list[Any]) -> list[Any]:
    """Run the zero-argument ``calls`` at once (one thread each), returning their results in order; the first
    error is raised after all have ended."""
    import threading

    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # re-raised below, after every call ended
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def jobs_run(work: str, tr: Any, ev: Any, sizes: tuple[int, int, int], n: int, link_mbit: float, unit: int,
             rtt_ms: float, streams: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``n`` jobs save (as fast as the disk) and replicate at once over the one shared link (the bed's token
    bucket carries every connection of ``to_eval``), each merged as its units arrive; beside them the best
    alternative on the same kind of link: after the commits, ``n`` bulk copies at once (``streams`` TCP streams
    each) through one shared-link proxy, each followed by its merge. Commit -> merged per job, and each job's save
    (call -> commit; as fast as the disk, not instantaneous) beside the transfer of all jobs' bytes at the link
    rate."""
    from foresight.replication.source import LocalSource
    from foresight.testing.wan import WanLink

    rows = concurrent([lambda k=k: arrival_run(work, tr, ev, sizes, 100 * (50 + k), 0.0, link_mbit, unit,
                                               job=f"job{n}x{k}") for k in range(n)])
    srcs = [os.path.join(tr.root, f"job{n}x{k}", f"step-{100 * (50 + k):08d}") for k in range(n)]
    sink = DirSink(os.path.join(work, f"jobs{n}-bulk"))
    dests = [os.path.join(sink.dir, f"job{k}") for k in range(n)]
    try:  # one pipe: every job's streams cross the same proxy (its token bucket), into one directory per job
        with WanLink(("127.0.0.1", sink.port), rtt_ms=rtt_ms, mbit=link_mbit) as link:
            copies = concurrent([lambda k=k: bulk_copy(srcs[k], link.port, streams, prefix=f"job{k}")
                                 for k in range(n)])
    finally:
        sink.close()
    bulk = []
    for k in range(n):
        for f in os.listdir(dests[k]):
            evict_file(os.path.join(dests[k], f))
        merge_s, written = timed_merge(LocalSource(dests[k]), os.path.join(work, f"out_jobs{n}_bulk_{k}"))
        check_merged(written, state)
        bulk.append(copies[k] + merge_s)
    arrival = [r["commit_to_merged_arrival_s"] for r in rows]
    transfer_all = sum(r["transfer_s_at_link_rate"] for r in rows)  # the jobs share the one link
    return {"jobs": n, "bulk_streams_per_job": streams,
            "save_s": [r["save_s"] for r in rows], "transfer_s_at_link_rate": transfer_all,
            "save_longer_than_transfer": min(r["save_s"] for r in rows) >= transfer_all,
            "commit_to_merged_arrival_s": arrival, "commit_to_merged_bulk_copy_s": bulk,
            "arrival_max_s": max(arrival), "bulk_copy_max_s": max(bulk),
            "arrival_vs_bulk_copy": max(arrival) / max(bulk),
            "MiB_left_at_commit": [r["MiB_left_at_commit"] for r in rows],
            "outputs_match_saved_state": all(r["outputs_match_saved_state"] for r in rows)}


class DirSink:
    """The evaluation site's end of a plain bulk copy: each TCP connection carries pieces (``<name length u16>
    <name> <offset u64> <length u64> <bytes>``) written into ``directory``; at its end the files it touched are
    synced and one byte acknowledges them (what a practitioner's tar/stream of the directory does, minus the tar)."""

    def __init__(self, directory: str) -> None:
        from foresight.testing.wan import TcpReceiver

        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self._rx = TcpReceiver(self._receive)
        self.port = self._rx.port

    def _receive(self, conn: Any, n: int) -> None:
        fds: dict[str, int] = {}
        f = conn.makefile("rb", buffering=1 << 20)
        try:
            while head := f.read(2):
                name = f.read(int.from_bytes(head, "little")).decode()
                off, length = (int.from_bytes(f.read(8), "little") for _ in range(2))
                fd = fds.get(name)
                if fd is None:  # "<file>" or "<job>/<file>" (concurrent jobs' copies); never outside self.dir
                    path = os.path.join(self.dir, *[os.path.basename(p) for p in name.split("/")])
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    fd = fds[name] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                pos = off
                while pos < off + length:
                    chunk = f.read(min(1 << 20, off + length - pos))
                    if not chunk:
                        raise RuntimeError(f"bulk copy cut short in {name}")
                    os.pwrite(fd, chunk, pos)
                    pos += len(chunk)
            for fd in fds.values():
                os.fdatasync(fd)
            conn.sendall(b"k")
        finally:
            for fd in fds.values():
                os.close(fd)
            f.close()
            conn.close()

    def close(self) -> None:
        self._rx.close()


def bulk_copy(src: str, port: int, streams: int, prefix: str = "") -> float:
    """Seconds to copy every file of ``src`` through ``port`` in ``streams`` parallel TCP streams (the bytes cut
    into equal slices), until each stream's receiver acknowledged its synced files; ``prefix``: the receiver's
    subdirectory (one per job when several copy at once)."""
    import socket
    import threading

    files = sorted((n, os.path.getsize(os.path.join(src, n))) for n in os.listdir(src))
    total = sum(n for _, n in files)
    cuts = [total * i // streams for i in range(streams + 1)]
    pieces: list[list[tuple[str, int, int]]] = [[] for _ in range(streams)]
    at = 0
    for name, size in files:  # slice k gets the bytes [cuts[k], cuts[k + 1]) of the concatenated files
        for k in range(streams):
            lo, hi = max(cuts[k], at), min(cuts[k + 1], at + size)
            if hi > lo or (size == 0 and k == 0):
                pieces[k].append((name, lo - at, hi - lo))
        at += size

    def one(part: list[tuple[str, int, int]]) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for name, off, n in part:
                raw = (f"{prefix}/{name}" if prefix else name).encode()
                s.sendall(len(raw).to_bytes(2, "little") + raw + off.to_bytes(8, "little") + n.to_bytes(8, "little"))
                with open(os.path.join(src, name), "rb") as f:
                    if n:
                        s.sendfile(f, off, n)
            s.shutdown(socket.SHUT_WR)
            if s.recv(1) != b"k":
                raise RuntimeError("bulk copy: the receiver did not acknowledge")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(p,)) for p in pieces if p]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def bulk_runs(work: str, src: str, rtt_ms: float, mbit: float, streams: list[int],
              state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Commit -> merged for a plain bulk copy of the committed directory (1 stream, like tar over ssh, and N
    parallel streams) through a link like the replication's, then the same merge from the copy."""
    from foresight.replication.source import LocalSource
    from foresight.testing.wan import WanLink

    rows = []
    for n in streams:
        dest = os.path.join(work, f"bulk-{n}")
        sink = DirSink(dest)
        try:
            with WanLink(("127.0.0.1", sink.port), rtt_ms=rtt_ms, mbit=mbit) as link:
                copy_s = bulk_copy(src, link.port, n)
        finally:
            sink.close()
        for f in os.listdir(dest):
            evict_file(os.path.join(dest, f))
        merge_s, written = timed_merge(LocalSource(dest), os.path.join(work, f"out_bulk_{n}"))
        rows.append({"streams": n, "copy_s": copy_s, "merge_s": merge_s, "commit_to_merged_s": copy_s + merge_s,
                     "tensors_checked": check_merged(written, state)})
    return rows


def check_merged(written: dict[str, list[str]], state: dict[str, torch.Tensor]) -> int:
    """Every tensor the job saved is in the merged output once, with its dtype, shape and bytes; returns the count.
    Raises ``SystemExit`` naming the file and tensor otherwise (merges are judged against the saved state, not
    against each other: two merges that agree on a wrong answer do not pass)."""
    from safetensors.torch import load_file

    seen: dict[str, str] = {}
    for paths in written.values():
        for p in paths:
            for k, v in load_file(p).items():
                if k in seen:
                    raise SystemExit(f"merged output has tensor {k!r} twice ({seen[k]} and {p})")
                seen[k] = p
                want = state.get(k)
                if want is None:
                    raise SystemExit(f"merged output {p} has tensor {k!r}, which the job never saved")
                if v.dtype != want.dtype or v.shape != want.shape:
                    raise SystemExit(f"merged tensor {k!r} in {p} is {v.dtype} {tuple(v.shape)}, saved "
                                     f"{want.dtype} {tuple(want.shape)}")
                if not torch.equal(v.view(torch.uint8), want.contiguous().view(torch.uint8)):
                    bad = (v.view(torch.uint8) != want.contiguous().view(torch.uint8)).reshape(-1).nonzero()
                    raise SystemExit(f"merged tensor {k!r} in {p} differs from the saved state (first differing "
                                     f"byte {int(bad[0])} of {want.numel() * want.element_size()})")
    missing = sorted(set(state) - set(seen))
    if missing:
        raise SystemExit(f"merged output lacks {len(missing)} saved tensors, e.g. {missing[:3]}")
    return len(seen)


def timed_merge(source: Any, out: str, **kw: Any) -> tuple[float, dict[str, list[str]]]:
    from foresight.replication.merge import merge_checkpoint

    t0 = time.perf_counter()
    written = merge_checkpoint(source, out, groups={"vision.": "vision", "text.": "text"}, **kw)
    return time.perf_counter() - t0, written


def flight_rtt(url: str, n: int = 5) -> float:
    from pyarrow import flight

    from foresight.replication.flight_calls import call

    c = flight.connect(url)
    call(url, "replication.ping", client=c)  # connection set-up apart
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        call(url, "replication.ping", client=c)
        samples.append((time.perf_counter() - t0) * 1e3)
    c.close()
    return statistics.median(samples)


def urgent_run(mode: str, work: str, etcd: str, link_url: str, bulk_dir: str, urgent_dir: str, unit: int,
               rtt_link: Any) -> dict[str, Any]:
    """A bulk replication is under way; an unpredicted urgent evaluation asks for another checkpoint."""
    from foresight.replication.scheduler import priority_of
    from foresight.testing.sites import SiteProcess

    with SiteProcess("train-a", os.path.join(work, "train"), etcd=etcd, routes={"eval-b": link_url},
                     unit_bytes=unit, fifo=(mode == "fifo")) as tr:
        bulk_name, urgent_name = f"bulk/run-{mode}", f"lm/urgent-{mode}"
        t_bulk = time.time()
        tr.call("replicate.start", {"name": bulk_name, "src": bulk_dir, "site": "eval-b",
                                    "priority": priority_of(model_bytes=70 << 30)})
        tr.call("replicate.commit", {"name": bulk_name, "path": bulk_dir})
        while not any(e[0] == bulk_name for e in tr.call("replicate.log")["sent"]):
            time.sleep(0.01)  # bulk is on the wire
        t_req = time.time()
        tr.call("replicate.start", {"name": urgent_name, "src": urgent_dir, "site": "eval-b",
                                    "priority": priority_of(model_bytes=7 << 30, severity=1.0)})
        tr.call("replicate.commit", {"name": urgent_name, "path": urgent_dir})
        u = tr.call("replicate.wait", {"name": urgent_name, "timeout": 3600})
        b = tr.call("replicate.wait", {"name": bulk_name, "timeout": 3600})
    return {"lane": mode, "urgent_ready_s": u["ready_at"] - t_req, "bulk_ready_s": b["ready_at"] - t_bulk,
            "urgent_bytes": u["bytes_sent"], "bulk_bytes": b["bytes_sent"]}


def unit_sweep(tr: Any, work: str, sizes_mib: list[float], total_mib: int) -> list[dict[str, Any]]:
    """Replication throughput over the link per transfer-unit size (how ``units.UNIT_BYTES`` was chosen)."""
    import torch.distributed.checkpoint as dcp

    from foresight.checkpoint import ForesightStorageWriter

    src = os.path.join(tr.root, "sweep", "step-00000001")
    big = {f"w{i}": torch.randn((4 << 20) // 4) for i in range(max(1, total_mib // 4))}
    dcp.save(big, storage_writer=ForesightStorageWriter(src), no_dist=True)
    del big
    rows = []
    for mib in sizes_mib:
        name = f"sweep/unit-{int(mib * 1024)}k"
        t0 = time.time()
        tr.call("replicate.start", {"name": name, "src": src, "site": "eval-b", "priority": 1.0,
                                    "unit_bytes": int(mib * (1 << 20))})
        tr.call("replicate.commit", {"name": name, "path": src})
        info = tr.call("replicate.wait", {"name": name, "timeout": 3600})
        secs = info["ready_at"] - t0
        rows.append({"unit_mib": mib, "units": info["units"], "seconds": secs,
                     "MB_per_s": info["bytes_sent"] / secs / 1e6})
    return rows


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 20's targets, each case with its measured value, its bound and whether it holds: commit -> merged
    <= 0.5x the best alternative when the save lasts at least as long as the transfer, <= 1.05x when the save is
    as fast as the disk (one job, and each concurrent-jobs run against its bulk copies; a run whose saves, timed,
    lasted at least as long as all jobs' transfer gets the 0.5x target), and merge latency >= 90% below the
    per-tensor baseline."""
    out = []
    for r in res.get("arrival", []):
        if r["save_longer_than_transfer"]:
            what, bound = "commit -> merged vs best alternative, save >= transfer", 0.5
        elif r["write_MBps_per_rank"] == "disk":
            what, bound = "commit -> merged vs best alternative, instantaneous save", 1.05
        else:
            continue  # a paced save shorter than the transfer: the issue sets no target for it
        speed = "as fast as the disk" if r["write_MBps_per_rank"] == "disk" else f"{r['write_MBps_per_rank']} MB/s/rank"
        out.append({"target": what, "case": f"1 job, save {speed}: {r['save_s']:.2f} s, transfer at link rate "
                                            f"{r['transfer_s_at_link_rate']:.2f} s",
                    "value": r["arrival_vs_best_alternative"], "bound": f"<= {bound}",
                    "met": r["arrival_vs_best_alternative"] <= bound})
    for j in res.get("jobs", []):  # saves as fast as the disk: the 0.5x target when they outlast the transfer
        saves = ", ".join(f"{x:.2f}" for x in j["save_s"]) if "save_s" in j else "not recorded"
        longer = bool(j.get("save_longer_than_transfer"))
        bound = 0.5 if longer else 1.05
        out.append({"target": "commit -> merged vs best alternative, " +
                              ("save >= transfer" if longer else "instantaneous save"),
                    "case": f"{j['jobs']} concurrent job(s) on one link vs bulk copies ({j['bulk_streams_per_job']} "
                            f"streams each); saves as fast as the disk: {saves} s, all jobs' transfer at link rate "
                            f"{j.get('transfer_s_at_link_rate', float('nan')):.2f} s",
                    "value": j["arrival_vs_bulk_copy"], "bound": f"<= {bound}",
                    "met": j["arrival_vs_bulk_copy"] <= bound})
    red = res["merge"]["reduction"]
    out.append({"target": "merge latency vs the per-tensor baseline", "case": "1 job, replica merged locally",
                "value": red, "bound": ">= 0.90 lower (paper 0.761)", "met": red >= 0.9})
    return out


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    m = res["merge"]
    labels = ["baseline\n(per tensor, remote)", "coalesced\nremote", "foresight\n(local replica)"]
    vals = [m["baseline"]["seconds"], m["coalesced_remote"]["seconds"], m["foresight"]["seconds"]]
    a.bar(labels, vals, color=["#999", "#69c", "#2a7"])
    a.set_ylabel("merge latency (s)")
    a.set_title(f"merge at the eval site, RTT {res['wan']['rtt_ms_measured']:.0f} ms "
                f"(-{100 * m['reduction']:.1f}%)")
    u = res["urgent"]
    b.bar([f"{r['lane']}" for r in u], [r["urgent_ready_s"] for r in u], color=["#999", "#2a7"])
    b.set_ylabel("urgent replica ready after request (s)")
    b.set_title("urgent evaluation during bulk replication")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small checkpoint, one run: checks the bench still works")
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--mbit", type=float, default=1000.0, help="link cap per direction (Mbit/s)")
    ap.add_argument("--small", type=int, default=1500, help="tensors under 16 KiB")
    ap.add_argument("--large", type=int, default=48, help="large tensors (split across the 2 ranks)")
    ap.add_argument("--large-mib", type=float, default=8.0)
    ap.add_argument("--bulk-mib", type=int, default=1024, help="the bulk checkpoint in flight in the urgent run")
    ap.add_argument("--unit-mib", type=int, default=32)
    ap.add_argument("--unit-sweep", default="1,4,16,32,64", help="unit sizes (MiB) to time; empty: skip")
    ap.add_argument("--sweep-mib", type=int, default=512, help="checkpoint size for the unit sweep")
    ap.add_argument("--bulk-streams", type=int, default=2,
                    help="parallel TCP streams of the bulk-copy alternative (beside one stream)")
    ap.add_argument("--write-mbps", default="0,40",
                    help="simulated write speeds (MB/s per rank; 0: the disk's) of the saves merged as they arrive")
    ap.add_argument("--jobs", default="1,2",
                    help="concurrent jobs saving and replicating over the one shared link (a list); empty: skip")
    ap.add_argument("--dir", default="/var/tmp/foresight-bench-remote-merge")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON and PNG go (default: common.RESULTS)")
    a = ap.parse_args()
    if a.smoke:
        a.small, a.large, a.large_mib, a.bulk_mib, a.unit_mib, a.mbit = 60, 6, 0.5, 24, 1, 200.0
        a.write_mbps = "0,2"  # ~1.6 MiB per rank: 2 MB/s saves for ~0.8 s, longer than the ~0.13 s transfer
        a.unit_sweep = ""
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as tmp_mp

    from foresight.checkpoint import ForesightStorageWriter
    from foresight.replication.resolver import Resolver
    from foresight.replication.source import RemoteSource
    from foresight.testing.etcd import EtcdProcess
    from foresight.testing.sites import SiteProcess
    from foresight.testing.wan import WanLink, measure_rtt

    work = a.dir
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    unit = a.unit_mib << 20
    sizes = (a.small, a.large, int(a.large_mib * (1 << 20)))
    res: dict[str, Any] = {"machine": machine(), "smoke": a.smoke}
    try:
        with EtcdProcess(os.path.join(work, "etcd")) as etcd, \
                SiteProcess("eval-b", os.path.join(work, "eval"), etcd=etcd.endpoint, unit_bytes=unit) as ev, \
                WanLink(("127.0.0.1", ev.port), rtt_ms=a.rtt_ms, mbit=a.mbit) as to_eval, \
                SiteProcess("train-a", os.path.join(work, "train"), etcd=etcd.endpoint, routes={"eval-b": to_eval.url},
                            unit_bytes=unit) as tr, \
                WanLink(("127.0.0.1", tr.port), rtt_ms=a.rtt_ms, mbit=a.mbit) as to_train:
            echo = measure_rtt(rtt_ms=a.rtt_ms, mbit=a.mbit)
            res["wan"] = {"kind": "delaying TCP proxy on loopback (no netem in this kernel)", "rtt_ms": a.rtt_ms,
                          "mbit_per_direction": a.mbit, "rtt_ms_measured": echo["median_ms"],
                          "flight_ping_ms_over_link": flight_rtt(to_train.url),
                          "flight_ping_ms_direct": flight_rtt(tr.url)}
            if a.unit_sweep:
                res["unit_sweep"] = unit_sweep(tr, work, [float(x) for x in a.unit_sweep.split(",")], a.sweep_mib)
                print_table(res["unit_sweep"], ["unit_mib", "units", "seconds", "MB_per_s"],
                            "replication throughput by transfer unit size")
            state = paper_shaped(*sizes)
            nb = np.array([v.numel() * v.element_size() for v in state.values()])
            res["checkpoint"] = {"tensors": len(nb), "under_16KiB": float((nb < 16384).mean()),
                                 "bytes": int(nb.sum()), "bytes_in_large": float(nb[nb >= 16384].sum() / nb.sum()),
                                 "ranks": 2}
            del state
            src = os.path.join(tr.root, "lm", "step-00000100")
            stamp = os.path.join(work, "save.json")
            tmp_mp.spawn(_rank, args=(os.path.join(work, "init"), src, tr.url, sizes, stamp), nprocs=2, join=True)
            saved = json.load(open(stamp))
            info = tr.call("replicate.wait", {"name": NAME, "timeout": 3600})
            res["replication"] = {"units": info["units"], "bytes": info["bytes_sent"],
                                  "node_start_to_ready_s": info["ready_at"] - info["started"],
                                  "node_commit_to_ready_s": info["ready_at"] - info["committed_at"],
                                  "commit_to_ready_s": info["ready_at"] - saved["committed"],
                                  "save_start_to_ready_s": info["ready_at"] - saved["save_started"]}
            for f in os.listdir(info["path"]):
                evict_file(os.path.join(info["path"], f))  # the eval site reads its replica from disk
            merged = {}
            with Resolver(etcd.endpoint, site="eval-b") as resolver, resolver.open(NAME) as (loc, source):
                assert loc.local, loc
                t_f, merged["foresight"] = timed_merge(source, os.path.join(work, "out_foresight"))
            base_src = RemoteSource(to_train.url, NAME)
            t_b, merged["baseline"] = timed_merge(base_src, os.path.join(work, "out_baseline"), per_extent=True)
            coal_src = RemoteSource(to_train.url, NAME)
            t_c, merged["coalesced"] = timed_merge(coal_src, os.path.join(work, "out_coalesced"))
            state = paper_shaped(*sizes)  # what the ranks saved (same seed): each merge is checked against it
            checked = {k: check_merged(v, state) for k, v in merged.items()}
            res["bulk"] = bulk_runs(work, src, a.rtt_ms, a.mbit, sorted({1, a.bulk_streams}), state)
            del state
            res["merge"] = {
                "baseline": {"seconds": t_b, "round_trips": base_src.requests, "bytes_over_link": base_src.bytes},
                "coalesced_remote": {"seconds": t_c, "round_trips": coal_src.requests, "bytes_over_link": coal_src.bytes},
                "foresight": {"seconds": t_f, "round_trips_at_merge": 0,
                              "bytes_over_link": res["replication"]["bytes"]},
                "reduction": 1 - t_f / t_b,
                "end_to_end_baseline_s": t_b,
                "end_to_end_foresight_s": max(0.0, res["replication"]["commit_to_ready_s"]) + t_f,
                "outputs_match_saved_state": True,  # check_merged raised otherwise
                "tensors_checked": checked,
            }
            res["merge"]["end_to_end_reduction"] = 1 - res["merge"]["end_to_end_foresight_s"] / t_b
            bulk_dir = os.path.join(work, "train", "bulk", "step-00000001")
            big = {f"w{i}": torch.randn((4 << 20) // 4) for i in range(max(1, a.bulk_mib // 4))}
            dcp.save(big, storage_writer=ForesightStorageWriter(bulk_dir), no_dist=True)
            del big
            base_src.close()
            coal_src.close()
            res["arrival"] = [arrival_run(work, tr, ev, sizes, 100 * (i + 2), float(mbps), a.mbit, unit)
                              for i, mbps in enumerate(a.write_mbps.split(",")) if mbps != ""]
            for r in res["arrival"]:
                r["commit_to_merged_coalesced_remote_s"] = t_c
                r["commit_to_merged_bulk_copy_s"] = min(b["commit_to_merged_s"] for b in res["bulk"])
                r["arrival_vs_best_alternative"] = r["commit_to_merged_arrival_s"] / min(
                    t_c, r["commit_to_merged_bulk_copy_s"])
            state = paper_shaped(*sizes)
            res["jobs"] = [jobs_run(work, tr, ev, sizes, int(n), a.mbit, unit, a.rtt_ms, a.bulk_streams, state)
                           for n in a.jobs.split(",") if n != ""]
            del state
            tr.stop()  # the urgent runs bring their own training-site sender (FIFO, then priority lane)
            res["urgent"] = [urgent_run(mode, work, etcd.endpoint, to_eval.url, bulk_dir, src, unit, None)
                             for mode in ("fifo", "priority")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = res["merge"]
    mib = 2**20
    rows = [{"method": "baseline (per tensor, remote)", "merge_s": m["baseline"]["seconds"],
             "round_trips": m["baseline"]["round_trips"], "MiB_over_link": m["baseline"]["bytes_over_link"] / mib,
             "commit_to_merged_s": m["end_to_end_baseline_s"]},
            {"method": "coalesced remote", "merge_s": m["coalesced_remote"]["seconds"],
             "round_trips": m["coalesced_remote"]["round_trips"],
             "MiB_over_link": m["coalesced_remote"]["bytes_over_link"] / mib,
             "commit_to_merged_s": m["coalesced_remote"]["seconds"]},
            {"method": "foresight (replica)", "merge_s": m["foresight"]["seconds"], "round_trips": 0,
             "MiB_over_link": m["foresight"]["bytes_over_link"] / mib, "commit_to_merged_s": m["end_to_end_foresight_s"]}]
    w = res["wan"]
    print_table(rows, ["method", "merge_s", "round_trips", "MiB_over_link", "commit_to_merged_s"],
                f"remote merge: {res['checkpoint']['tensors']} tensors ({100 * res['checkpoint']['under_16KiB']:.0f}% "
                f"< 16 KiB), {res['checkpoint']['bytes'] / 2**20:.1f} MiB, 2 ranks; link {w['kind']}, RTT "
                f"{w['rtt_ms_measured']:.1f} ms measured ({w['rtt_ms']:.0f} set), {w['mbit_per_direction']:.0f} Mbit/s")
    print(f"merge latency reduction: {100 * m['reduction']:.1f}%  (commit -> merged: "
          f"{100 * m['end_to_end_reduction']:.1f}%)  commit -> replica ready: "
          f"{res['replication']['commit_to_ready_s']:.2f} s, {res['replication']['bytes'] / 2**20:.1f} MiB in "
          f"{res['replication']['units']} units")
    print_table(res["bulk"], ["streams", "copy_s", "merge_s", "commit_to_merged_s"],
                "bulk copy of the committed directory over the same link, then the merge")
    print_table(res["arrival"], ["write_MBps_per_rank", "save_s", "transfer_s_at_link_rate", "MiB_left_at_commit",
                                 "commit_to_ready_s", "commit_to_merged_replica_then_merge_s",
                                 "commit_to_merged_coalesced_remote_s", "commit_to_merged_bulk_copy_s",
                                 "commit_to_merged_arrival_s",
                                 "arrival_vs_best_alternative"],
                "commit -> merged: foresight merging as units arrive vs the replica then a merge; best alternative: "
                "coalesced remote reads or a bulk copy then the merge")
    print_table(res["jobs"], ["jobs", "bulk_streams_per_job", "save_s", "transfer_s_at_link_rate", "arrival_max_s",
                              "bulk_copy_max_s", "arrival_vs_bulk_copy"],
                "concurrent jobs on the one link: slowest job's commit -> merged, merging on arrival vs a bulk copy "
                "after the commit (N streams per job) then the merge")
    res["targets"] = targets(res)
    print_table(res["targets"], ["target", "case", "value", "bound", "met"], "issue 20 targets")
    print_table(res["urgent"], ["lane", "urgent_ready_s", "bulk_ready_s", "urgent_bytes", "bulk_bytes"],
                "urgent evaluation during bulk replication")
    os.makedirs(a.out, exist_ok=True)
    name = "remote_merge_smoke" if a.smoke else "remote_merge"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    plot(res, os.path.join(a.out, f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
