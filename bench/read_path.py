"""The read path side by side: foresight's Loader against a torch DataLoader, np.memmap and fio, cold and warm.

One command runs everything over a random plan on a >= 4 GiB dataset per sample size (4 KiB, 16 KiB, 64 KiB,
1 MiB; bytes modality, fixed-size samples, one shard file so every method reads the same file):

* ``fs-uring`` / ``fs-uring-nocoal`` / ``fs-pread``: :class:`foresight.Loader` with io_uring and coalescing on,
  io_uring with coalescing off (``max_gap=-1``), and the pread thread-pool backend; each over the global plan and
  over a block-local plan (``shuffle="block"``, ``-block`` suffix), where neighbouring samples share a step and
  coalescing pays (``ios/sample`` shows it). The Loader's ``prefetch`` (steps in flight: the arena holds
  ``prefetch + 2`` slots) is swept like an anchor's knobs, per size and cache state (:data:`PREFETCH_SWEEP`), and
  every ``fs-*`` row runs at the best one (its ``config`` says which).
* anchors (``bench/read_anchors.py``), each in the configuration an expert would pick, chosen per size and cache
  state by a sweep printed beside the results: ``torch-dl`` is ``torch.utils.data.DataLoader`` over a map-style
  dataset that preads samples (workers 2-16, per-sample or batched ``__getitems__``, prefetch factor, pin_memory
  with CUDA, O_DIRECT into aligned buffers when cold); ``memmap`` indexes ``np.memmap`` per sample as Megatron-LM's
  dataset does (``MADV_RANDOM`` when cold); ``fio`` is the best of fio's io_uring random read over numjobs x iodepth
  x submission mode (fixedbufs, registerfiles; batched submit/complete, SQPOLL, hipri where it works): the disk's
  limit. ``-block`` anchors read the block-local plan's order, and ``-block`` rows are compared with them only.

Cold runs drop the page cache first and open with O_DIRECT where the method can; warm runs read the file once just
before (buffered everywhere). Each figure is the median of ``--runs`` runs (the spread is printed), timed in steady
state from the first batch to the last (start-up such as worker forks is excluded, which favours the anchors);
CPU-seconds count the process and its worker processes (fio reports its own). A sweep of the coalescing options
(``max_gap`` x ``max_transfer``) on the block-local 16 KiB plan, O_DIRECT, picks the defaults.

Usage::

    python bench/read_path.py                    # full: 4 x 4 GiB datasets cached in /tmp/foresight-bench (~1 h)
    python bench/read_path.py --smoke            # a few MiB, one run of each, seconds
    python bench/read_path.py --sizes 16K --runs 5
    python bench/read_path.py --sizes 16K --modes warm --methods fs-uring,fio --no-sweep   # one case against fio
    python bench/read_path.py --clean            # delete the cached datasets
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import read_anchors as anchors  # noqa: E402
from common import (  # noqa: E402,F401
    RESULTS, cpu_seconds, drop_page_cache, evict_file, have, machine, print_table, warm_file, write_results,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = {"4K": 4 * KiB, "16K": 16 * KiB, "64K": 64 * KiB, "1M": 1 * MiB}
DEFAULT_DATA_DIR = "/tmp/foresight-bench"
QUEUE_DEPTH = 128  # the Loader's default; fio runs at the same depth
PREFETCH = 2  # the Loader's default
# Steps in flight, swept: fewer slots keep the arena's destination lines cached, more hide a slow step
PREFETCH_SWEEP = (1, 2, 4)
SWEEP_GAPS = (0, 16 * KiB, 64 * KiB, 256 * KiB)
SWEEP_TRANSFERS = (256 * KiB, 1 * MiB, 4 * MiB)
# Large samples: does a transfer limit that grows with the sample (the loader's max_transfer=None) pay?
LARGE_SWEEP_TRANSFERS = (4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB)


# -- data ---------------------------------------------------------------------------------------------------------


def ensure_dataset(root: Path, size: int, total_bytes: int, *, quiet: bool = False):
    """A bytes dataset of fixed-size random samples in one shard file, written once and reused."""
    from foresight.format import DatasetWriter, open_dataset

    n = total_bytes // size
    path = root / f"bytes-{size // KiB}K-{total_bytes // MiB}M"
    if (path / "manifest.json").exists():
        ds = open_dataset(str(path))
        if ds.num_samples == n and len(ds.shard_paths) == 1:
            return ds
        shutil.rmtree(path)
    t0 = time.perf_counter()
    rng = np.random.default_rng(size)
    per_chunk = max(1, (256 * MiB) // size)
    with DatasetWriter(str(path), align=4096, shard_bytes=n * size + MiB, fsync=False, overwrite=True,
                       extra={"bench": "read_path", "sample_bytes": size}) as w:
        done = 0
        while done < n:
            k = min(per_chunk, n - done)
            data = np.frombuffer(rng.bytes(k * size), dtype=np.uint8)
            w.add_many(data, np.full(k, size, np.int64), modality="bytes")
            done += k
    os.sync()
    if not quiet:
        print(f"  wrote {path} ({n} samples x {size} B) in {time.perf_counter() - t0:.1f} s", flush=True)
    return open_dataset(str(path))


@dataclass
class Case:
    """One dataset and its plans: what every method of one sample size reads."""

    label: str
    size: int
    ds: object
    path: str  # the one shard file
    batch: int
    steps: int
    plans: dict  # "global" / "block" -> Plan

    def order(self, shuffle: str) -> np.ndarray:
        """Sample ids of the timed steps in plan order."""
        plan = self.plans[shuffle]
        return np.asarray(plan.piece_sample[: self.steps * self.batch], dtype=np.int64)


def batch_for(size: int) -> int:
    """Items per step: about 8 MiB per step, 32..512 samples (a training batch of that many samples)."""
    return int(min(512, max(32, (8 * MiB) // size)))


def make_case(label: str, size: int, ds, run_bytes: int, batch: int | None = None) -> Case:
    from foresight.plan import build_plan

    batch = batch or batch_for(size)
    steps = max(4, -(-run_bytes // (batch * size)))
    plans = {
        "global": build_plan([(ds, 1.0)], seed=1, global_batch_size=batch, num_steps=steps, shuffle="global"),
        "block": build_plan([(ds, 1.0)], seed=1, global_batch_size=batch, num_steps=steps, shuffle="block",
                            block_size=batch),
    }
    return Case(label, size, ds, ds.shard_paths[0], batch, steps, plans)


# -- measuring ----------------------------------------------------------------------------------------------------


class Meter:
    """Wall time and CPU time (this process, its threads and its live worker processes) of a timed span.
    ``exclude``: pids of child processes that are not the measured work (a server, a network proxy), with their
    own children."""

    def __init__(self, exclude: tuple[int, ...] | list[int] = ()) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._exclude = set(exclude)

    def _children_cpu(self) -> dict[int, float]:
        out = {}
        skip = set(self._exclude)
        for pid in self._exclude:
            try:
                skip.update(c.pid for c in self._psutil.Process(pid).children(recursive=True))
            except self._psutil.Error:
                pass
        for child in self._me.children(recursive=True):
            if child.pid in skip:
                continue
            try:
                t = child.cpu_times()
                out[child.pid] = t.user + t.system
            except self._psutil.Error:
                pass
        return out

    def start(self) -> None:
        self._kids0 = self._children_cpu()
        self._cpu0 = cpu_seconds()
        self._t0 = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        wall = time.perf_counter() - self._t0
        # this process's CPU before the children scan below: the scan (psutil reads every /proc/<pid>/stat, a few
        # ms on a busy host) is the meter's own work, not the measured span's
        cpu = cpu_seconds() - self._cpu0
        kids1 = self._children_cpu()
        # cpu_seconds() counts reaped children whole (a DataLoader joins its workers when it runs out), so
        # take off what those had used before the span started; live children count by their delta.
        cpu += sum(v - self._kids0.get(pid, 0.0) for pid, v in kids1.items())
        cpu -= sum(v for pid, v in self._kids0.items() if pid not in kids1)
        return wall, cpu


def result(samples: int, nbytes: int, wall: float, cpu: float, **extra) -> dict:
    return {
        "samples": samples,
        "bytes": nbytes,
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "mb_per_s": nbytes / wall / 1e6 if wall > 0 else 0.0,
        "cpu_s_per_gb": cpu / (nbytes / 1e9) if nbytes else 0.0,
        **extra,
    }


def run_foresight(case: Case, cold: bool, *, shuffle: str = "global", backend: str = "uring",
                  max_gap: int | None = None, max_transfer: int | None = None, prefetch: int = PREFETCH) -> dict:
    from foresight.loader import DEFAULT_MAX_GAP, Loader

    loader = Loader(
        case.plans[shuffle], datasets=case.ds, backend=backend, direct=cold, queue_depth=QUEUE_DEPTH, prefetch=prefetch,
        max_gap=DEFAULT_MAX_GAP if max_gap is None else max_gap,
        max_transfer=max_transfer,
        end_step=case.steps,
    )
    meter = Meter()
    try:
        it = iter(loader)
        first = next(it)
        assert len(first["lengths"]) == case.batch
        meter.start()
        samples = 0
        for batch in it:
            samples += len(batch["lengths"])
        wall, cpu = meter.stop()
        stats = loader.stats.as_dict()
        io = loader._engine.stats  # the knobs the engine runs with, printed beside fio's
        engine_config = (f"{io['backend']} queue_depth={io['queue_depth']} io_threads={io['threads']} "
                         f"prefetch={prefetch} max_gap={loader.max_gap}")
    finally:
        loader.close()
    return result(samples, samples * case.size, wall, cpu, backend=stats["backend"],
                  ios_per_sample=stats["ios"] / max(1, stats["samples"]), amplification=stats["amplification"],
                  max_transfer=loader.max_transfer, config=engine_config,
                  stages_s={k: stats[k] for k in ("plan_s", "coalesce_s", "submit_s", "io_wait_s", "collate_s",
                                                   "h2d_s", "stall_s")})


# -- tokens: the Loader over a compact plan beside its materialized form ------------------------------------------

TOKEN_SEQ, TOKEN_BATCH = 2048, 64


def ensure_token_dataset(root: Path, total_bytes: int):
    """A uint16 token dataset of documents of 1..4095 tokens (mean 2,048), written once and reused."""
    from foresight.format import DatasetWriter, open_dataset

    path = root / f"tokens-{total_bytes // MiB}M"
    if (path / "manifest.json").exists():
        return open_dataset(str(path))
    rng = np.random.default_rng(2048)
    lengths = rng.integers(1, 4096, max(1, total_bytes // 4096))
    with DatasetWriter(str(path), token_dtype="uint16", fsync=False, overwrite=True) as w:
        for lo in range(0, len(lengths), 1 << 15):
            part = lengths[lo : lo + (1 << 15)]
            w.add_many(rng.integers(0, 65535, int(part.sum()), dtype=np.uint16), part, modality="tokens")
    os.sync()
    return open_dataset(str(path))


def token_plans(ds, run_bytes: int) -> dict:
    """``compact``: a compact plan; ``materialized``: the same items and pieces stored as arrays (format 1), so the
    two rows differ only in how the loader gets a step's pieces."""
    from foresight.plan import Plan, build_plan

    steps = max(4, run_bytes // (TOKEN_BATCH * TOKEN_SEQ * 2))
    compact = build_plan([(ds, 1.0)], seed=1, global_batch_size=TOKEN_BATCH, seq_len=TOKEN_SEQ, num_steps=steps,
                         compact=True)
    p = compact.pieces(0, compact.num_items)
    arrays = {"item_ptr": p.item_ptr, "piece_dataset": p.dataset, "piece_sample": p.sample,
              "piece_offset": p.offset, "piece_length": p.length}
    materialized = Plan(inputs=compact.inputs, summary=dict(compact.summary, num_pieces=len(p.sample)), arrays=arrays)
    return {"compact": compact, "materialized": materialized}


def run_tokens(ds, plan, cold: bool) -> dict:
    """Steady-state tokens per second of one Loader pass (from the first batch to the last)."""
    from foresight.loader import Loader

    meter = Meter()
    with Loader(plan, datasets=[ds], direct=cold, queue_depth=QUEUE_DEPTH, prefetch=PREFETCH) as loader:
        it = iter(loader)
        next(it)
        meter.start()
        rows = sum(int(batch["tokens"].shape[0]) for batch in it)
        wall, cpu = meter.stop()
    tokens = rows * TOKEN_SEQ
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall,
            "cpu_s_per_gtoken": cpu / (tokens / 1e9)}


def token_rows(root: Path, dataset_bytes: int, run_bytes: int, runs: int, modes: list[str],
               cache: "CacheControl") -> list[dict]:
    """Per mode, both plan kinds ``runs`` times, interleaved; medians and the compact / materialized ratio."""
    ds = ensure_token_dataset(root, dataset_bytes)
    plans = token_plans(ds, run_bytes)
    rows = []
    for mode in modes:
        got: dict[str, list[dict]] = {k: [] for k in plans}
        for _ in range(runs):
            for kind, plan in plans.items():
                for path in ds.shard_paths:
                    cache.prepare(path, mode == "cold")
                got[kind].append(run_tokens(ds, plan, mode == "cold"))
        for kind, results in got.items():
            rows.append({"mode": mode, "plan": kind, "runs": len(results),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                         "cpu_s_per_gtoken": statistics.median(r["cpu_s_per_gtoken"] for r in results),
                         "tokens_per_run": results[0]["tokens"]})
        mat = next(r for r in rows if r["mode"] == mode and r["plan"] == "materialized")
        for r in rows:
            if r["mode"] == mode:
                r["x_materialized"] = r["tokens_per_s"] / mat["tokens_per_s"]
    return rows


METHODS = ("fs-uring", "fs-uring-nocoal", "fs-pread", "fs-uring-block", "fs-uring-nocoal-block", "fs-pread-block",
           "torch-dl", "torch-dl-block", "memmap", "memmap-block", "fio")


def methods(fio: bool, dl_cfg: dict | None, fio_cfg: dict | None, only: set[str] | None = None,
            fs_cfg: dict | None = None) -> dict:
    """Name -> runner(case, cold). Anchors run in the configuration their sweep picked, the Loader's rows at the
    ``prefetch`` its sweep picked (``fs_cfg``; None: the default); ``-block`` rows (ours and the anchors') read the
    block-local plan's order, the others the global plan's. ``only``: these names alone."""
    pf = (fs_cfg or {}).get("prefetch", PREFETCH)
    m = {
        "fs-uring": lambda c, cold: run_foresight(c, cold, prefetch=pf),
        "fs-uring-nocoal": lambda c, cold: run_foresight(c, cold, max_gap=-1, prefetch=pf),
        "fs-pread": lambda c, cold: run_foresight(c, cold, backend="pread", prefetch=pf),
        "fs-uring-block": lambda c, cold: run_foresight(c, cold, shuffle="block", prefetch=pf),
        "fs-uring-nocoal-block": lambda c, cold: run_foresight(c, cold, shuffle="block", max_gap=-1, prefetch=pf),
        "fs-pread-block": lambda c, cold: run_foresight(c, cold, shuffle="block", backend="pread", prefetch=pf),
        "torch-dl": lambda c, cold: anchors.run_dataloader(c, cold, c.order("global"), **dl_cfg),
        "torch-dl-block": lambda c, cold: anchors.run_dataloader(c, cold, c.order("block"), **dl_cfg),
        "memmap": lambda c, cold: anchors.run_memmap(c, cold, c.order("global")),
        "memmap-block": lambda c, cold: anchors.run_memmap(c, cold, c.order("block")),
    }
    if fio and fio_cfg:
        m["fio"] = lambda c, cold: anchors.run_fio(c, cold, **fio_cfg)
    if dl_cfg is None:
        m = {k: v for k, v in m.items() if not k.startswith("torch-dl")}
    return {k: v for k, v in m.items() if only is None or k in only}


def pick_anchors(case: Case, cold: bool, runs: int, cache: "CacheControl", fio: bool, smoke: bool,
                 dataloader: bool = True, loader: bool = True):
    """Sweep the DataLoader's (unless not ``dataloader``), fio's and the Loader's (``prefetch``, unless not
    ``loader``) knobs on the global plan; the best (median MB/s) of each is its configuration (None: not swept).
    Returns ``(dataloader config, fio config, Loader config, sweep rows)``."""
    rows, best = [], {}
    sweeps = [("fs-uring", {"prefetch": p}, lambda c, cold, p=p: run_foresight(c, cold, prefetch=p))
              for p in ((PREFETCH,) if smoke else PREFETCH_SWEEP) if loader]
    sweeps += [("torch-dl", cfg, lambda c, cold, cfg=cfg: anchors.run_dataloader(c, cold, c.order("global"), **cfg))
               for cfg in (anchors.dataloader_configs(cold, smoke=smoke) if dataloader else [])]
    if fio:
        sweeps += [("fio", cfg, lambda c, cold, cfg=cfg: anchors.run_fio(c, cold, **cfg))
                   for cfg in anchors.fio_configs(smoke=smoke)]
    for anchor, cfg, fn in sweeps:
        results = []
        for _ in range(runs):
            cache.prepare(case.path, cold)
            try:
                results.append(fn(case, cold))
            except Exception as e:  # a mode this machine lacks (hipri without poll queues) is reported, not fatal
                results.append({"error": f"{type(e).__name__}: {e}"})
        ok = [r for r in results if "error" not in r]
        row = {**{("submit" if k == "mode" else k): v for k, v in cfg.items()}, "size": case.label,
               "mode": "cold" if cold else "warm", "anchor": anchor,
               "config": ok[0]["config"] if ok else str(cfg), "runs": len(ok),
               "error": next((r["error"] for r in results if "error" in r), None)}
        if ok:
            for key in ("samples_per_s", "mb_per_s", "cpu_s_per_gb"):
                row[key] = statistics.median(r[key] for r in ok)
            if row["mb_per_s"] > best.get(anchor, (None, -1.0))[1]:
                best[anchor] = (cfg, row["mb_per_s"])
        rows.append(row)
    for r in rows:
        if r.get("mb_per_s") and r["anchor"] in best:
            r["x_best"] = r["mb_per_s"] / best[r["anchor"]][1]
    pick = {k: v[0] for k, v in best.items()}
    return pick.get("torch-dl"), pick.get("fio"), pick.get("fs-uring"), rows


# -- running ------------------------------------------------------------------------------------------------------


class CacheControl:
    """Cold: empty the page cache (globally as root in a full run; just this file in --smoke). Warm: read it."""

    def __init__(self, global_drop: bool) -> None:
        self.global_drop = global_drop
        self.global_drop_worked = None

    def prepare(self, path: str, cold: bool) -> None:
        gc.collect()
        if not cold:
            warm_file(path)
        elif self.global_drop:
            self.global_drop_worked = drop_page_cache(path)
        else:
            evict_file(path)


def run_case(case: Case, runs: int, sweep_runs: int, cache: CacheControl, modes: list[str], fio: bool,
             smoke: bool, only: set[str] | None = None) -> tuple[list[dict], list[dict]]:
    """Per mode: sweep the anchors' knobs, then every method ``runs`` times, interleaved so drift hits all alike."""
    raw: dict[tuple[str, str], list[dict]] = {}
    anchor_rows: list[dict] = []
    for mode in modes:
        cold = mode == "cold"
        dl_cfg, fio_cfg, fs_cfg, swept = pick_anchors(
            case, cold, sweep_runs, cache, fio and (only is None or "fio" in only), smoke,
            dataloader=only is None or bool(only & {"torch-dl", "torch-dl-block"}),
            loader=only is None or any(m.startswith("fs-") for m in only))
        anchor_rows += swept
        print(f"  {case.label} {mode}: anchors"
              + (f" DataLoader [{anchors.config_label(dl_cfg)}]" if dl_cfg else "")
              + (f" fio [{fio_cfg}]" if fio_cfg else "")
              + (f"; Loader prefetch={fs_cfg['prefetch']}" if fs_cfg else ""), flush=True)
        runners = methods(fio, dl_cfg, fio_cfg, only, fs_cfg)
        for r in range(runs):
            for name, fn in runners.items():
                cache.prepare(case.path, cold)
                try:
                    res = fn(case, cold)
                except Exception as e:  # one broken method must not hide the others
                    res = {"error": f"{type(e).__name__}: {e}"}
                    print(f"    {case.label} {mode} {name}: {res['error']}", flush=True)
                raw.setdefault((mode, name), []).append(res)
            print(f"  {case.label} {mode} run {r + 1}/{runs} done", flush=True)
    rows = []
    for (mode, name), results in raw.items():
        rows.append(summarize(case, mode, name, results))
    return rows, anchor_rows


def summarize(case: Case, mode: str, name: str, results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    row = {"size": case.label, "mode": mode, "method": name, "batch": case.batch, "runs": len(ok),
           "errors": [r["error"] for r in results if "error" in r]}
    if not ok:
        return row
    for key in ("samples_per_s", "mb_per_s", "cpu_s_per_gb"):
        row[key] = statistics.median(r[key] for r in ok)
        row[key + "_all"] = [r[key] for r in ok]
    row["mb_per_s_spread"] = f"{min(row['mb_per_s_all']):.0f}-{max(row['mb_per_s_all']):.0f}"
    if "config" in ok[0]:
        row["config"] = ok[0]["config"]
    ios = [r["ios_per_sample"] for r in ok if r.get("ios_per_sample") is not None]
    row["ios_per_sample"] = statistics.median(ios) if ios else None
    for key in ("backend", "amplification", "max_transfer"):
        if key in ok[0]:
            row[key] = ok[0][key]
    if "stages_s" in ok[0]:
        row["stages_s"] = ok[len(ok) // 2]["stages_s"]
        row["wall_s"] = ok[len(ok) // 2]["wall_s"]
    return row


def add_ratios(rows: list[dict]) -> None:
    """Ratios of every row to the anchors that read the same order in the same cache state: the best DataLoader
    and memmap of that order (``-block`` rows against ``-block`` anchors), and fio's best (random order only)."""
    anchors_by = {(r["size"], r["mode"], r["method"]): r for r in rows}
    for r in rows:
        for key in [k for k in r if k.startswith("x_")]:
            del r[key]
        if "mb_per_s" not in r:
            continue
        block = r["method"].endswith("-block")
        suffix = "-block" if block else ""
        fio = {} if block else anchors_by.get((r["size"], r["mode"], "fio"), {})
        dl = anchors_by.get((r["size"], r["mode"], "torch-dl" + suffix), {})
        mm = anchors_by.get((r["size"], r["mode"], "memmap" + suffix), {})
        if fio.get("mb_per_s"):
            r["x_fio_bw"] = r["mb_per_s"] / fio["mb_per_s"]
        if dl.get("samples_per_s"):
            r["x_dl_sps"] = r["samples_per_s"] / dl["samples_per_s"]
            r["x_dl_cpu"] = r["cpu_s_per_gb"] / dl["cpu_s_per_gb"] if dl.get("cpu_s_per_gb") else None
        if mm.get("samples_per_s"):
            r["x_memmap_sps"] = r["samples_per_s"] / mm["samples_per_s"]


def sweep(case: Case, runs: int, cache: CacheControl, gaps, transfers, modes=("cold",)) -> list[dict]:
    """Coalescing options on the block-local plan: samples/s and I/Os per sample (cold = O_DIRECT)."""
    raw: dict[tuple[str, int, int], list[dict]] = {}
    for _ in range(runs):
        for mode in modes:
            for gap in gaps:
                for mt in transfers:
                    cache.prepare(case.path, mode == "cold")
                    raw.setdefault((mode, gap, mt), []).append(
                        run_foresight(case, mode == "cold", shuffle="block", max_gap=gap, max_transfer=mt))
    rows = []
    for (mode, gap, mt), res in raw.items():
        rows.append({
            "max_gap": gap, "max_transfer": mt, "size": case.label, "mode": mode, "plan": "block",
            "samples_per_s": statistics.median(r["samples_per_s"] for r in res),
            "mb_per_s": statistics.median(r["mb_per_s"] for r in res),
            "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in res),
            "ios_per_sample": statistics.median(r["ios_per_sample"] for r in res),
            "amplification": res[0]["amplification"],
        })
    for mode in modes:
        best = max((r for r in rows if r["mode"] == mode), key=lambda r: r["mb_per_s"])
        for r in rows:
            if r["mode"] == mode:
                r["x_best"] = r["mb_per_s"] / best["mb_per_s"]
    return rows


# -- verdicts -----------------------------------------------------------------------------------------------------


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each met or missed with the figures behind it (None: not measured this run)."""
    def get(size, mode, method):
        return next((r for r in rows if r["size"] == size and r["mode"] == mode and r["method"] == method
                     and "mb_per_s" in r), None)

    out = []

    def add(name, value, goal, ok_if, detail):
        out.append({"target": name, "value": value, "goal": goal,
                    "met": None if value is None else bool(ok_if(value)), "detail": detail})

    fs, fio = get("16K", "cold", "fs-uring"), get("16K", "cold", "fio")
    add("16K O_DIRECT bandwidth vs fio's best", fs and fio and fs["mb_per_s"] / fio["mb_per_s"], ">= 0.85x",
        lambda v: v >= 0.85, fs and fio and f"{fs['mb_per_s']:.0f} vs {fio['mb_per_s']:.0f} MB/s")
    fs, fio = get("16K", "warm", "fs-uring"), get("16K", "warm", "fio")
    add("16K warm (page cache) bandwidth vs fio's best", fs and fio and fs["mb_per_s"] / fio["mb_per_s"], ">= 1.0x",
        lambda v: v >= 1.0, fs and fio and f"{fs['mb_per_s']:.0f} vs {fio['mb_per_s']:.0f} MB/s "
        f"[{fs.get('config')}] vs [{fio.get('config')}]")
    for mode in ("cold", "warm"):
        fs, dl = get("16K", mode, "fs-uring"), get("16K", mode, "torch-dl")
        add(f"16K {mode} samples/s vs DataLoader", fs and dl and fs["samples_per_s"] / dl["samples_per_s"],
            ">= 4x", lambda v: v >= 4.0,
            fs and dl and f"{fs['samples_per_s']:.0f} vs {dl['samples_per_s']:.0f} samples/s")
        add(f"16K {mode} CPU-s/GB vs DataLoader", fs and dl and fs["cpu_s_per_gb"] / dl["cpu_s_per_gb"],
            "<= 0.333x", lambda v: v <= 1 / 3,
            fs and dl and f"{fs['cpu_s_per_gb']:.2f} vs {dl['cpu_s_per_gb']:.2f} CPU-s/GB")
    fs, dl = get("16K", "cold", "fs-uring-block"), get("16K", "cold", "torch-dl-block")
    add("16K cold block-local samples/s vs DataLoader (same order)",
        fs and dl and fs["samples_per_s"] / dl["samples_per_s"], ">= 4x", lambda v: v >= 4.0,
        fs and dl and f"{fs['samples_per_s']:.0f} vs {dl['samples_per_s']:.0f} samples/s")
    for size in [s for s in SIZES if any(r["size"] == s for r in rows)]:
        r = get(size, "cold", "fs-uring-block")
        add(f"{size} block-local I/Os per sample", r and r["ios_per_sample"], "<= 0.1", lambda v: v <= 0.1,
            r and f"{r['ios_per_sample']:.4f} I/Os per sample"
            + (f" (max_transfer {r['max_transfer'] / MiB:g} MiB)" if r.get("max_transfer") else ""))
    return out


# -- output -------------------------------------------------------------------------------------------------------


def plot(rows: list[dict], sweep_rows: list[dict], large_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("cold", "warm") if any(r["mode"] == m for r in rows)]
    ncols = len(modes) + (1 if sweep_rows else 0) + (1 if large_rows else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5), squeeze=False)
    sizes = [s for s in SIZES if any(r["size"] == s for r in rows)]
    names = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(1, len(names))
    for ax, mode in zip(axes[0], modes):
        for k, name in enumerate(names):
            vals = [next((r.get("mb_per_s", 0) for r in rows if r["size"] == s and r["mode"] == mode
                          and r["method"] == name), 0) for s in sizes]
            ax.bar(np.arange(len(sizes)) + k * width, vals, width, label=name)
        ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, sizes)
        ax.set_yscale("log")
        ax.set_ylabel("MB/s (median)")
        ax.set_title(f"{mode}: " + ("O_DIRECT / empty page cache" if mode == "cold" else "warm page cache"))
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(names), 9), fontsize=8, frameon=False)
    if large_rows:
        ax = axes[0][-1]
        for mode in [m for m in ("cold", "warm") if any(r["mode"] == m for r in large_rows)]:
            pts = sorted((r["max_transfer"], r["mb_per_s"], r["ios_per_sample"]) for r in large_rows
                         if r["mode"] == mode)
            ax.plot([p[0] / MiB for p in pts], [p[1] for p in pts], marker="o", label=mode)
            for x, y, ios in pts:
                ax.annotate(f"{ios:.3g} I/O/s.", (x / MiB, y), fontsize=7, textcoords="offset points",
                            xytext=(0, 5), ha="center")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["max_transfer"] for r in large_rows})
        ax.set_xticks([t / MiB for t in ticks], [f"{t / MiB:g}" for t in ticks])
        ax.set_xlabel("max_transfer (MiB)")
        ax.set_ylabel("MB/s (median)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_title(f"transfer limit: block-local {large_rows[0]['size']}")
    if sweep_rows:
        ax = axes[0][len(modes)]
        gaps = sorted({r["max_gap"] for r in sweep_rows})
        mts = sorted({r["max_transfer"] for r in sweep_rows})
        grid = np.array([[next(r["mb_per_s"] for r in sweep_rows if r["max_gap"] == g and r["max_transfer"] == m)
                          for m in mts] for g in gaps])
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(mts)), [f"{m // KiB}K" for m in mts])
        ax.set_yticks(range(len(gaps)), [f"{g // KiB}K" for g in gaps])
        ax.set_xlabel("max_transfer")
        ax.set_ylabel("max_gap")
        for i in range(len(gaps)):
            for j in range(len(mts)):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_title("coalescing sweep: block-local 16K, O_DIRECT, MB/s")
        fig.colorbar(im, ax=ax)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a few MiB, one run of each method, seconds")
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the datasets are cached")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"sample sizes, from {list(SIZES)}")
    ap.add_argument("--dataset-gib", type=float, default=4.0, help="bytes per dataset (>= 4 GiB for the figures)")
    ap.add_argument("--run-mib", type=int, default=None,
                    help="bytes per run (default: 128 MiB at 4K, 256 at 16K, 512 at 64K, 1024 at 1M)")
    ap.add_argument("--runs", type=int, default=5, help="runs of every method in the main table (>= 3 to publish)")
    ap.add_argument("--anchor-runs", type=int, default=2,
                    help="runs of each anchor configuration in the sweep that picks the anchors")
    ap.add_argument("--modes", default="cold,warm")
    ap.add_argument("--methods", default=None,
                    help=f"only these rows (and only the anchors they need swept), from {list(METHODS)}; e.g. the warm "
                         "16K case against fio: --sizes 16K --modes warm --methods fs-uring,fio --no-sweep")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--clean", action="store_true", help="delete the cached datasets (alone: and exit)")
    ap.add_argument("--from-json", metavar="PATH", help="re-render tables, ratios and PNG from a saved result")
    ap.add_argument("--tokens", action="store_true",
                    help="only the token case: the Loader over a compact plan beside the same plan materialized "
                         "(--dataset-gib of uint16 tokens, --run-mib per run; writes read_path_tokens.json)")
    args = ap.parse_args(argv)
    if args.tokens:
        return main_tokens(args)
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text())
        report(payload, "read_path_smoke" if payload.get("smoke") else "read_path")
        return 0

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad or not sizes:
        ap.error(f"--sizes takes {list(SIZES)}, got {bad or sizes}")
    if any(m not in ("cold", "warm") for m in modes):
        ap.error(f"--modes takes cold,warm; got {modes}")
    only = None if args.methods is None else {m.strip() for m in args.methods.split(",") if m.strip()}
    if only is not None and (not only or only - set(METHODS)):
        ap.error(f"--methods takes {list(METHODS)}; got {sorted(only - set(METHODS)) or args.methods!r}")
    only_clean = args.clean and not any(a for a in (argv if argv is not None else sys.argv[1:])
                                        if a not in ("--clean",) and not a.startswith("--data-dir"))
    if only_clean:
        shutil.rmtree(args.data_dir, ignore_errors=True)
        print(f"removed {args.data_dir}")
        return 0

    tmp = None
    if args.smoke:
        tmp = tempfile.mkdtemp(prefix="foresight-read-path-smoke-")
        root, dataset_bytes, runs = Path(tmp), 8 * MiB, 1
        sizes = ["16K"]
        run_bytes = {s: 2 * MiB for s in sizes}
        sweep_gaps, sweep_transfers = (0, 64 * KiB), (1 * MiB,)
        large_label, large_transfers = "16K", (64 * KiB, 256 * KiB)
    else:
        root, dataset_bytes, runs = Path(args.data_dir), int(args.dataset_gib * GiB), args.runs
        default_run = {"4K": 128 * MiB, "16K": 256 * MiB, "64K": 512 * MiB, "1M": 1024 * MiB}
        run_bytes = {s: (args.run_mib * MiB if args.run_mib else default_run[s]) for s in sizes}
        sweep_gaps, sweep_transfers = SWEEP_GAPS, SWEEP_TRANSFERS
        large_label, large_transfers = "1M", LARGE_SWEEP_TRANSFERS
    fio = have("fio")
    sweep_runs = 1 if args.smoke else args.anchor_runs
    cache = CacheControl(global_drop=not args.smoke)
    info = machine()
    try:
        info["load_avg_start"] = os.getloadavg()
        print(f"read_path: {info['platform']}, {info['cpus']} CPUs, kernel {info['kernel']}, "
              f"load {info['load_avg_start'][0]:.1f}; fio {'found' if fio else 'absent: skipped'}", flush=True)
        t_start = time.perf_counter()
        rows, anchor_rows, sweep_rows, large_rows, cases = [], [], [], [], {}
        for label in sizes:
            size = SIZES[label]
            ds = ensure_dataset(root, size, dataset_bytes, quiet=args.smoke)
            case = make_case(label, size, ds, run_bytes[label], batch=32 if args.smoke else None)
            cases[label] = {"load_avg": os.getloadavg(), "batch": case.batch, "steps": case.steps,
                            "samples_per_run": case.steps * case.batch,
                            "file": case.path, "file_bytes": os.path.getsize(case.path)}
            print(f"{label}: {ds.num_samples} samples, batch {case.batch}, {case.steps} steps per run", flush=True)
            case_rows, case_anchor_rows = run_case(case, runs, sweep_runs, cache, modes, fio, args.smoke, only)
            rows += case_rows
            anchor_rows += case_anchor_rows
            if label == "16K" and not args.no_sweep and "cold" in modes:
                sweep_rows = sweep(case, runs, cache, sweep_gaps, sweep_transfers)
            if label == large_label and not args.no_sweep:
                from foresight.loader import DEFAULT_MAX_GAP

                large_rows = sweep(case, runs, cache, (DEFAULT_MAX_GAP,), large_transfers, modes)
        elapsed = time.perf_counter() - t_start
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        elif args.clean:
            shutil.rmtree(args.data_dir, ignore_errors=True)

    info["load_avg_end"] = os.getloadavg()
    payload = {
        "machine": info, "smoke": args.smoke, "elapsed_s": elapsed, "runs": runs, "queue_depth": QUEUE_DEPTH,
        "prefetch": PREFETCH, "anchor_runs": sweep_runs, "anchor_sweep": anchor_rows, "dataset_bytes": dataset_bytes, "cases": cases,
        "global_cache_drop": cache.global_drop_worked, "rows": rows, "sweep": sweep_rows,
        "sweep_large": large_rows,
    }
    # a partial run (some sizes) keeps its own file, so it never replaces the full run's figures
    part = ([] if sizes == list(SIZES) else sizes) + ([] if set(modes) == {"cold", "warm"} else modes) \
        + ([] if only is None else sorted(only))
    name = "read_path_smoke" if args.smoke else "_".join(["read_path", *part])
    report(payload, name)
    return 0


def main_tokens(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    tmp = tempfile.mkdtemp(prefix="foresight-read-tokens-") if args.smoke else None
    root = Path(tmp) if tmp else Path(args.data_dir)
    dataset_bytes = 8 * MiB if args.smoke else int(args.dataset_gib * GiB)
    run_bytes = 2 * MiB if args.smoke else (args.run_mib or 256) * MiB
    info = machine()
    info["load_avg_start"] = os.getloadavg()
    try:
        rows = token_rows(root, dataset_bytes, run_bytes, 1 if args.smoke else args.runs, modes,
                          CacheControl(global_drop=False))  # cold: evict the dataset's files only (a shared machine)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    info["load_avg_end"] = os.getloadavg()
    print_table(rows, ["mode", "plan", "runs", "tokens_per_s", "cpu_s_per_gtoken", "x_materialized"],
                f"read path, tokens (seq_len {TOKEN_SEQ}, batch {TOKEN_BATCH}, {dataset_bytes // MiB} MiB dataset, "
                f"{run_bytes // MiB} MiB per run): compact plan vs the same plan materialized")
    out = write_results("read_path_tokens_smoke" if args.smoke else "read_path_tokens",
                        {"machine": info, "smoke": args.smoke, "dataset_bytes": dataset_bytes, "run_bytes": run_bytes,
                         "rows": rows})
    print(f"wrote {out}")
    return 0


def report(payload: dict, name: str) -> None:
    """Ratios, targets, tables, JSON and PNG from one run's figures."""
    rows, sweep_rows, runs = payload["rows"], payload["sweep"], payload["runs"]
    add_ratios(rows)
    verdicts = targets(rows)
    best = max(sweep_rows, key=lambda r: r["mb_per_s"]) if sweep_rows else None
    columns = ["size", "mode", "method", "samples_per_s", "mb_per_s", "mb_per_s_spread", "cpu_s_per_gb",
               "ios_per_sample", "x_fio_bw", "x_dl_sps", "x_dl_cpu", "x_memmap_sps", "config"]
    anchor_rows = payload.get("anchor_sweep") or []
    if anchor_rows:
        print()
        print_table(anchor_rows, ["size", "mode", "anchor", "config", "samples_per_s", "mb_per_s", "cpu_s_per_gb",
                                  "x_best", "error"],
                    title=f"knob sweep (medians of {payload.get('anchor_runs')} run(s); the best of each anchor is the "
                          "anchor, the Loader's best prefetch runs its rows)")
    print()
    print_table(rows, columns, title=f"read path (medians of {runs} run(s); x_* = ratio to that anchor)")
    if sweep_rows:
        print()
        print_table(sweep_rows, ["max_gap", "max_transfer", "samples_per_s", "mb_per_s", "cpu_s_per_gb",
                                 "ios_per_sample", "amplification", "x_best"],
                    title="coalescing sweep: block-local 16K plan, O_DIRECT")
        print(f"best: max_gap={best['max_gap']} max_transfer={best['max_transfer']}")
    large_rows = payload.get("sweep_large") or []
    if large_rows:
        print()
        print_table(large_rows, ["size", "mode", "max_transfer", "samples_per_s", "mb_per_s", "cpu_s_per_gb",
                                 "ios_per_sample", "x_best"],
                    title=f"transfer limit for large samples: block-local {large_rows[0]['size']} plan")
    print()
    print_table(verdicts, ["target", "goal", "value", "met", "detail"], title="targets")
    payload.update(best_coalescing=best, targets=verdicts)
    out = write_results(name, payload)
    plot(rows, sweep_rows, large_rows, RESULTS / f"{name}.png")
    print(f"\nwrote {out} and {RESULTS / (name + '.png')} ({payload['elapsed_s']:.0f} s of measuring)")


if __name__ == "__main__":
    sys.exit(main())
