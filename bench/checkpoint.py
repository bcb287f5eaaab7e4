"""Checkpoint bench: training-blocking time, total time and restore time, side by side in one run.

Compares, on the same state dicts (a few large tensors plus thousands of small ones) and the same disk:
``torch.save`` (+fsync) / ``torch.load``; ``dcp.save`` / ``dcp.load`` and ``dcp.async_save`` with PyTorch's ``FileSystemWriter``/``FileSystemReader``
as an expert runs them in a training loop (one writer and one ``DefaultStager`` reused across saves, the staged
state dict cached, pinned and asynchronous staging where CUDA exists, ``thread_count`` swept: each count is a row);
``dcp.save`` through foresight's storage writer/reader; and ``foresight.checkpoint`` (``Checkpointer.save`` /
``.load(into=...)``). Anchors: fio's sequential O_DIRECT write and read at foresight's own transfer size and
parallelism (8 MiB, 4 jobs) and the best of a small sweep (block size x jobs x queue depth), medians.

Blocking = time until the call returns control to training; total = until the checkpoint is durable
(fsynced and committed); write = total - blocking for asynchronous methods and total for blocking ones, i.e. the
same span, to the durable commit, for every method. The first save (which allocates staging memory and pages it
in) is reported apart from the steady state (the median of the later saves). Restores are measured with a cold
page cache (``drop_caches``) and restore into existing tensors (what resuming training does).

Usage::

    python bench/checkpoint.py                 # 1 GiB and 4 GiB, 3 runs each (several minutes)
    python bench/checkpoint.py --smoke         # a few seconds; what tests/test_bench_checkpoint_smoke.py runs
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import foresight.checkpoint as fc
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SMALL_TENSORS = 4000
SMALL_BYTES = 31 * 1024  # 4,000 x 31 KiB ~ 121 MiB of small tensors, as in the 0.87 GiB mix
LARGE_BYTES = 96 * MiB


def make_state(total: int, n_small: int) -> dict[str, torch.Tensor]:
    """``n_small`` small tensors (mixed fp32/bf16) plus ~96 MiB fp32 tensors making up ``total`` bytes."""
    g = torch.Generator().manual_seed(0)
    small_each = SMALL_BYTES if total >= 256 * MiB else max(1024, total // (8 * max(n_small, 1)))
    state: dict[str, torch.Tensor] = {}
    for i in range(n_small):
        if i % 2:
            state[f"layers.{i}.norm"] = torch.randn(small_each // 2, generator=g).to(torch.bfloat16)
        else:
            state[f"layers.{i}.bias"] = torch.randn(small_each // 4, generator=g)
    rest = total - n_small * small_each
    n_large = max(1, round(rest / LARGE_BYTES))
    for i in range(n_large):
        t = torch.empty(rest // n_large // 4)
        t.normal_(generator=g)
        state[f"large.{i}"] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_caches(enabled: bool) -> None:
    os.sync()
    if enabled:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            pass


def fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


def copy_into(target: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in target.items():
            t.copy_(loaded[k])


# -- methods: each returns {"blocking": s, "total": s, "write_s": s} for a save, {"restore": s} for a load --

def torch_save(state, d):
    path = os.path.join(d, "model.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    t = time.perf_counter() - t0
    return {"blocking": t, "total": t, "write_s": t}


def torch_load(state, d):
    t0 = time.perf_counter()
    loaded = torch.load(os.path.join(d, "model.pt"), map_location="cpu", weights_only=True)
    copy_into(state, loaded)
    return {"restore": time.perf_counter() - t0}


def dcp_load(state, d):
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(d, "dcp")), no_dist=True)
    return {"restore": time.perf_counter() - t0}


class DcpAsync:
    """``dcp.async_save`` as a training loop runs it: one FileSystemWriter (staged state dict cached) and one
    DefaultStager reused across saves; pinned, asynchronous, non-blocking staging only where CUDA exists."""

    def __init__(self, threads: int) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.threads = threads
        cuda = torch.cuda.is_available()
        self.options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda,
                                      use_non_blocking_copy=cuda)
        self.stager = DefaultStager(self.options)
        self.writer = None

    def save(self, state, d):
        path = os.path.join(d, "dcp")
        if self.writer is None:
            self.writer = dcp.FileSystemWriter(path, thread_count=self.threads, cache_staged_state_dict=True)
        t0 = time.perf_counter()
        res = dcp.async_save(state, storage_writer=self.writer, checkpoint_id=path, async_stager=self.stager,
                             no_dist=True)
        t1 = time.perf_counter()
        fut = getattr(res, "upload_completion", res)  # AsyncSaveResponse with async staging, else a Future
        fut.result()
        t2 = time.perf_counter()
        return {"blocking": t1 - t0, "total": t2 - t0, "write_s": t2 - t1}

    def close(self) -> None:
        self.stager.close()


class DcpSave:
    """``dcp.save`` with one FileSystemWriter of ``threads`` threads reused across saves."""

    def __init__(self, threads: int) -> None:
        self.threads, self.writer = threads, None

    def save(self, state, d):
        path = os.path.join(d, "dcp")
        if self.writer is None:
            self.writer = dcp.FileSystemWriter(path, thread_count=self.threads)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=self.writer, checkpoint_id=path, no_dist=True)
        t = time.perf_counter() - t0
        return {"blocking": t, "total": t, "write_s": t}


_fs_writer: dict[str, Any] = {}


def fs_dcp_save(state, d):
    # one writer reused across saves, as a training loop would: its packing buffer is allocated once
    writer = _fs_writer.setdefault("w", fc.ForesightStorageWriter(os.path.join(d, "dcp")))
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer, checkpoint_id=os.path.join(d, "dcp"), no_dist=True)
    t = time.perf_counter() - t0
    return {"blocking": t, "total": t, "write_s": t}


def fs_dcp_load(state, d):
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=fc.ForesightStorageReader(os.path.join(d, "dcp")), no_dist=True)
    return {"restore": time.perf_counter() - t0}


class ForesightMethod:
    """foresight.checkpoint with a staging pool sized once, before the timed saves."""

    def __init__(self, nbytes: int, n_tensors: int) -> None:
        self.nbytes = nbytes + (n_tensors + 16) * 4096  # room for alignment padding
        self.ck: fc.Checkpointer | None = None
        self.step = 0
        self.pool_seconds = 0.0

    def open(self, d: str) -> None:
        if self.ck is None:
            t0 = time.perf_counter()
            self.ck = fc.Checkpointer(os.path.join(d, "fs"), keep=1, staging_bytes=self.nbytes)
            self.pool_seconds = time.perf_counter() - t0

    def save(self, state, d):
        self.open(d)
        self.step += 1
        t0 = time.perf_counter()
        h = self.ck.save(state, self.step)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        return {"blocking": t1 - t0, "total": t2 - t0, "write_s": t2 - t1}

    def load(self, state, d):
        t0 = time.perf_counter()
        self.ck.load(self.step, into=state)
        return {"restore": time.perf_counter() - t0}

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
            self.ck = None


# -- fio anchors -----------------------------------------------------------------------------------

FIO_OWN = {"bs": "8m", "numjobs": 4, "iodepth": 1}  # foresight's checkpoint I/O: 8 MiB chunks, 4 I/O threads


def fio_configs(smoke: bool) -> list[dict]:
    if smoke:
        return [FIO_OWN]
    sweep = [{"bs": bs, "numjobs": j, "iodepth": qd} for bs in ("1m", "8m") for j in (1, 4) for qd in (1, 16)]
    return sweep if FIO_OWN in sweep else [FIO_OWN] + sweep


def fio(d: str, nbytes: int, drop: bool, runs: int, smoke: bool) -> dict[str, Any] | None:
    """Sequential O_DIRECT write (to the durable end: end_fsync) and read of ``nbytes`` split over the jobs, per
    configuration, medians of ``runs``; the best write and the best read are the anchors."""
    if shutil.which("fio") is None:
        return None
    rows = []
    for cfg in fio_configs(smoke):
        per_job = f"{max(nbytes // cfg['numjobs'] // MiB, 16)}m"
        common = ["fio", "--name=seq", f"--directory={d}", f"--bs={cfg['bs']}", "--direct=1", f"--size={per_job}",
                  "--ioengine=io_uring", f"--iodepth={cfg['iodepth']}", f"--numjobs={cfg['numjobs']}",
                  "--group_reporting", "--output-format=json"]

        def bw(rw: str, extra: list[str]) -> float:
            out = subprocess.run(common + [f"--rw={rw}"] + extra, capture_output=True, text=True,
                                 check=True).stdout
            job = json.loads(out[out.index("{"):])["jobs"][0]
            return job["write" if rw == "write" else "read"]["bw_bytes"]

        w, r = [], []
        try:
            for _ in range(runs):
                w.append(bw("write", ["--end_fsync=1"]))
                drop_caches(drop)
                r.append(bw("read", []))
        finally:
            for name in os.listdir(d):
                if name.startswith("seq."):
                    os.remove(os.path.join(d, name))
        rows.append({**cfg, "write_Bps": statistics.median(w), "read_Bps": statistics.median(r),
                     "own": cfg == FIO_OWN})
    best_w = max(rows, key=lambda x: x["write_Bps"])
    best_r = max(rows, key=lambda x: x["read_Bps"])
    own = next(x for x in rows if x["own"])
    return {"write_Bps": best_w["write_Bps"], "read_Bps": best_r["read_Bps"], "best_write": best_w,
            "best_read": best_r, "own_config": own, "sweep": rows}


# -- driver ----------------------------------------------------------------------------------------

def run_size(total: int, n_small: int, runs: int, d: str, drop: bool, log: Callable[[str], None],
             dcp_threads: list[int], smoke: bool) -> dict[str, Any]:
    state = make_state(total, n_small)
    nbytes = state_bytes(state)
    n_tensors = len(state)
    log(f"state: {len(state)} tensors, {nbytes / GiB:.2f} GiB")
    fsm = ForesightMethod(nbytes, len(state))
    methods = {"torch.save": (torch_save, torch_load)}
    closers = []
    for n in dcp_threads:
        methods[f"dcp.save t{n}"] = (DcpSave(n).save, dcp_load)
        anchor = DcpAsync(n)
        closers.append(anchor.close)
        methods[f"dcp.async_save t{n}"] = (anchor.save, dcp_load)
    methods["dcp.save+foresight writer"] = (fs_dcp_save, fs_dcp_load)
    methods["foresight"] = (fsm.save, fsm.load)
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    # methods one after another (all runs of one, then the next), so that at most one method's buffers
    # (staging pool, packing buffer, staged copy) coexist with the state dict: peak ~2-3x the state size
    for name, (save, load) in methods.items():
        for r in range(runs):
            work = os.path.join(d, name.replace(" ", "_").replace("+", "_"))
            os.makedirs(work, exist_ok=True)
            gc.collect()
            res = save(state, work)
            drop_caches(drop)
            res.update(load(state, work))
            for k, v in res.items():
                samples[name].setdefault(k, []).append(v)
            if name != "foresight" and r == runs - 1:  # writers are reused across saves, as in training
                shutil.rmtree(work, ignore_errors=True)
            log(f"  run {r + 1}/{runs} {name:28s} " + " ".join(f"{k}={v:.3f}s" for k, v in res.items()))
        if name == "foresight":
            fsm.close()
        _fs_writer.clear()
        gc.collect()
    for close in closers:
        close()
    shutil.rmtree(os.path.join(d, "foresight"), ignore_errors=True)
    del state
    gc.collect()
    anchors = fio(d, nbytes, drop, runs, smoke)
    result = {"bytes": nbytes, "tensors": n_tensors, "runs": runs, "fio": anchors,
              "foresight_pool_alloc_s": fsm.pool_seconds, "methods": {}}
    for name, s in samples.items():
        steady = {k: v[1:] or v for k, v in s.items()}  # the first save allocates and pages in: reported apart
        med = {k: statistics.median(v) for k, v in steady.items()}
        med["first_blocking"], med["first_total"] = s["blocking"][0], s["total"][0]
        med["write_GBps"] = nbytes / med["write_s"] / 1e9
        med["restore_GBps"] = nbytes / med["restore"] / 1e9
        result["methods"][name] = {"median": med, "samples": s}
    ts = result["methods"]["torch.save"]["median"]["blocking"]
    for name, m in result["methods"].items():
        m["median"]["blocking_vs_torch_save"] = m["median"]["blocking"] / ts
    asyncs = {n: m for n, m in result["methods"].items() if n.startswith("dcp.async_save")}
    result["best_dcp_async"] = min(asyncs, key=lambda n: asyncs[n]["median"]["total"])
    syncs = {n: m for n, m in result["methods"].items() if n.startswith("dcp.save t")}
    result["best_dcp_save"] = min(syncs, key=lambda n: syncs[n]["median"]["total"])
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    hdr = (f"{'size':>8} {'method':36s} {'1st blk s':>9} {'1st tot s':>9} {'blocking s':>10} {'total s':>8} "
           f"{'block/ts':>8} {'write GB/s':>10} {'restore s':>9} {'read GB/s':>9}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for res in results:
        size = f"{res['bytes'] / GiB:.2f}G"
        for name, m in res["methods"].items():
            md = m["median"]
            best = " *" if name in (res.get("best_dcp_async"), res.get("best_dcp_save")) else ""
            lines.append(f"{size:>8} {name + best:36s} {md['first_blocking']:9.3f} {md['first_total']:9.3f} "
                         f"{md['blocking']:10.3f} {md['total']:8.3f} "
                         f"{md['blocking_vs_torch_save']:8.3f} {md['write_GBps']:10.2f} {md['restore']:9.3f} "
                         f"{md['restore_GBps']:9.2f}")
        if res["fio"]:
            pad = f"{'':>9} {'':>9} {'':>10} {'':>8} {'':>8}"
            for label, cfg in (("fio best write", res["fio"]["best_write"]), ("fio best read", res["fio"]["best_read"]),
                               ("fio at foresight's config", res["fio"]["own_config"])):
                tag = f"{label} {cfg['bs']} j{cfg['numjobs']} qd{cfg['iodepth']}"
                lines.append(f"{size:>8} {tag:36s} {pad} {cfg['write_Bps'] / 1e9:10.2f} {'':>9} "
                             f"{cfg['read_Bps'] / 1e9:9.2f}")
    lines.append("(steady state = median of the saves after the first; * = the best thread count of that anchor)")
    return "\n".join(lines)


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for res in results:
        m = res["methods"]
        f, ts, da = m["foresight"]["median"], m["torch.save"]["median"], m[res["best_dcp_async"]]["median"]
        size = f"{res['bytes'] / GiB:.2f} GiB"
        out.append(f"{size}: blocking {f['blocking']:.3f}s = {f['blocking'] / ts['blocking']:.1%} of torch.save "
                   f"(target <= 5%): {'MET' if f['blocking'] <= 0.05 * ts['blocking'] else 'MISSED'}; "
                   f"vs {res['best_dcp_async']} {da['blocking']:.3f}s: {'MET' if f['blocking'] < da['blocking'] else 'MISSED'}")
        if res["fio"]:
            wr = f["write_GBps"] * 1e9 / res["fio"]["write_Bps"]
            rr = f["restore_GBps"] * 1e9 / res["fio"]["read_Bps"]
            out.append(f"{size}: background write {f['write_GBps']:.2f} GB/s = {wr:.2f}x fio (target >= 0.8): "
                       f"{'MET' if wr >= 0.8 else 'MISSED'}; restore {f['restore_GBps']:.2f} GB/s = {rr:.2f}x fio "
                       f"read (target >= 0.8): {'MET' if rr >= 0.8 else 'MISSED'}")
    return out


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = list(res["methods"])
        x = range(len(names))
        w = 0.27
        for j, (key, label) in enumerate([("blocking", "training-blocking"), ("total", "total (durable)"),
                                          ("restore", "restore (cold cache)")]):
            ax.bar([i + (j - 1) * w for i in x], [res["methods"][n]["median"][key] for n in names], w, label=label)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_yscale("log")
        smallest = min(res["methods"][n]["median"][k] for n in names for k in ("blocking", "total", "restore"))
        ax.set_ylim(bottom=smallest / 2)  # log-scale bars start at the axis floor: keep the shortest visible
        ax.set_ylabel("seconds (median, log scale)")
        ax.set_title(f"{res['bytes'] / GiB:.2f} GiB state dict")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4", help="state dict sizes in GiB, comma-separated (default 1,4)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", type=int, default=SMALL_TENSORS, help="number of small tensors")
    ap.add_argument("--dir", default="/var/tmp/foresight-bench-checkpoint",
                    help="scratch directory on the disk under test (removed afterwards)")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON and PNG go (default: common.RESULTS)")
    ap.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before restores")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, two runs: checks the bench still works")
    ap.add_argument("--dcp-threads", default="1,2,4,8", help="FileSystemWriter thread counts to sweep")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.smoke:
        sizes, runs, n_small = [32 * MiB], 2, 200
    else:
        sizes, runs, n_small = [int(float(s) * GiB) for s in args.sizes.split(",")], args.runs, args.small
    drop = not args.no_drop_caches and not args.smoke and os.geteuid() == 0
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    machine = {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
               "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
               "dir": args.dir, "drop_caches": drop, "foresight_io": fc.Checkpointer.io_backend()}
    log = lambda s: print(s, flush=True)
    log(f"machine: {machine}")
    results = []
    try:
        for total in sizes:
            results.append(run_size(total, n_small, runs, args.dir, drop, log,
                                    [1, 2] if args.smoke else [int(t) for t in args.dcp_threads.split(",")],
                                    args.smoke))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    text = table(results)
    print()
    print(text)
    print()
    for v in verdicts(results):
        print(v)
    tag = "smoke" if args.smoke else "full"
    out_json = os.path.join(args.out, f"checkpoint_{tag}.json")
    with open(out_json, "w") as f:
        json.dump({"machine": machine, "results": results, "table": text, "verdicts": verdicts(results)}, f,
                  indent=1)
    plot(results, os.path.join(args.out, f"checkpoint_{tag}.png"))
    print(f"\nwrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
