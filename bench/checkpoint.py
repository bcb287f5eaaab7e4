"""Checkpoint bench: training-blocking time, total time and restore time, side by side in one run.

Compares, on the same state dicts (a few large tensors plus thousands of small ones) and the same disk:
``torch.save`` (+fsync) / ``torch.load``; ``dcp.save`` / ``dcp.load`` and ``dcp.async_save`` with the
default ``FileSystemWriter``/``FileSystemReader``; ``dcp.save`` through foresight's storage writer/reader;
and ``foresight.checkpoint`` (``Checkpointer.save`` / ``.load(into=...)``). Anchors: fio's sequential
O_DIRECT write and read bandwidth (1 MiB blocks, io_uring QD16) on the same directory.

Blocking = time until the call returns control to training; total = until the checkpoint is durable
(fsynced and committed). Restores are measured with a cold page cache (``drop_caches``) and restore into
existing tensors (what resuming training does). Each figure is the median of ``--runs`` runs.

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


def dcp_save(state, d):
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(d, "dcp")), no_dist=True)
    t = time.perf_counter() - t0
    return {"blocking": t, "total": t, "write_s": t}


def dcp_load(state, d):
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(d, "dcp")), no_dist=True)
    return {"restore": time.perf_counter() - t0}


def dcp_async_save(state, d):
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(os.path.join(d, "dcp")), no_dist=True)
    t1 = time.perf_counter()
    fut.result()
    t2 = time.perf_counter()
    return {"blocking": t1 - t0, "total": t2 - t0, "write_s": t2 - t1}


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
        return {"blocking": t1 - t0, "total": t2 - t0, "write_s": h.timings["write"]}

    def load(self, state, d):
        t0 = time.perf_counter()
        self.ck.load(self.step, into=state)
        return {"restore": time.perf_counter() - t0}

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
            self.ck = None


# -- fio anchors -----------------------------------------------------------------------------------

def fio(d: str, nbytes: int, drop: bool) -> dict[str, float] | None:
    if shutil.which("fio") is None:
        return None
    path = os.path.join(d, "fio.dat")
    size = f"{max(nbytes // MiB, 16)}m"
    common = ["fio", "--name=seq", f"--filename={path}", "--bs=1m", "--direct=1", f"--size={size}",
              "--ioengine=io_uring", "--iodepth=16", "--output-format=json"]

    def bw(rw: str, extra: list[str]) -> float:
        out = subprocess.run(common + [f"--rw={rw}"] + extra, capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return job["write" if rw == "write" else "read"]["bw_bytes"]

    try:
        w = bw("write", ["--end_fsync=1"])
        drop_caches(drop)
        r = bw("read", [])
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"write_Bps": w, "read_Bps": r}


# -- driver ----------------------------------------------------------------------------------------

def run_size(total: int, n_small: int, runs: int, d: str, drop: bool, log: Callable[[str], None]) -> dict[str, Any]:
    state = make_state(total, n_small)
    nbytes = state_bytes(state)
    n_tensors = len(state)
    log(f"state: {len(state)} tensors, {nbytes / GiB:.2f} GiB")
    fsm = ForesightMethod(nbytes, len(state))
    methods = {
        "torch.save": (torch_save, torch_load),
        "dcp.save": (dcp_save, dcp_load),
        "dcp.async_save": (dcp_async_save, dcp_load),
        "dcp.save+foresight writer": (fs_dcp_save, fs_dcp_load),
        "foresight": (fsm.save, fsm.load),
    }
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
            if name != "foresight":
                shutil.rmtree(work, ignore_errors=True)
            log(f"  run {r + 1}/{runs} {name:28s} " + " ".join(f"{k}={v:.3f}s" for k, v in res.items()))
        if name == "foresight":
            fsm.close()
        _fs_writer.clear()
        gc.collect()
    shutil.rmtree(os.path.join(d, "foresight"), ignore_errors=True)
    del state
    gc.collect()
    anchors = fio(d, nbytes, drop)
    result = {"bytes": nbytes, "tensors": n_tensors, "runs": runs, "fio": anchors,
              "foresight_pool_alloc_s": fsm.pool_seconds, "methods": {}}
    for name, s in samples.items():
        med = {k: statistics.median(v) for k, v in s.items()}
        med["write_GBps"] = nbytes / med["write_s"] / 1e9
        med["restore_GBps"] = nbytes / med["restore"] / 1e9
        result["methods"][name] = {"median": med, "samples": s}
    ts = result["methods"]["torch.save"]["median"]["blocking"]
    for name, m in result["methods"].items():
        m["median"]["blocking_vs_torch_save"] = m["median"]["blocking"] / ts
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    hdr = (f"{'size':>8} {'method':28s} {'blocking s':>10} {'total s':>8} {'block/ts':>8} {'write GB/s':>10} "
           f"{'restore s':>9} {'read GB/s':>9}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for res in results:
        size = f"{res['bytes'] / GiB:.2f}G"
        for name, m in res["methods"].items():
            md = m["median"]
            lines.append(f"{size:>8} {name:28s} {md['blocking']:10.3f} {md['total']:8.3f} "
                         f"{md['blocking_vs_torch_save']:8.3f} {md['write_GBps']:10.2f} {md['restore']:9.3f} "
                         f"{md['restore_GBps']:9.2f}")
        if res["fio"]:
            lines.append(f"{size:>8} {'fio seq O_DIRECT (anchor)':28s} {'':>10} {'':>8} {'':>8} "
                         f"{res['fio']['write_Bps'] / 1e9:10.2f} {'':>9} {res['fio']['read_Bps'] / 1e9:9.2f}")
    return "\n".join(lines)


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for res in results:
        m = res["methods"]
        f, ts, da = m["foresight"]["median"], m["torch.save"]["median"], m["dcp.async_save"]["median"]
        size = f"{res['bytes'] / GiB:.2f} GiB"
        out.append(f"{size}: blocking {f['blocking']:.3f}s = {f['blocking'] / ts['blocking']:.1%} of torch.save "
                   f"(target <= 5%): {'MET' if f['blocking'] <= 0.05 * ts['blocking'] else 'MISSED'}; "
                   f"vs dcp.async_save {da['blocking']:.3f}s: {'MET' if f['blocking'] < da['blocking'] else 'MISSED'}")
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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before restores")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one run: checks the bench still works")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.smoke:
        sizes, runs, n_small = [32 * MiB], 1, 200
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
            results.append(run_size(total, n_small, runs, args.dir, drop, log))
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
