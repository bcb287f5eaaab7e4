"""Shared bench helpers: machine description, medians, result files, cache control.

Result files (JSON, PNG) go to ``RESULTS``: ``bench/results`` unless ``FORESIGHT_BENCH_RESULTS`` names another
directory, so a run (the smoke tests, ``run_all.py``) can collect its own files from a fresh directory instead of
reading whatever an earlier run left in the checkout.

Example::

    from common import machine, median_of, write_results
    t = median_of(lambda: work(), runs=5)
    write_results("read_path", {"machine": machine(), "rows": rows})

    FORESIGHT_BENCH_RESULTS=/tmp/run1 python bench/decode.py --smoke   # -> /tmp/run1/decode_smoke.json
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

RESULTS_ENV = "FORESIGHT_BENCH_RESULTS"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"
RESULTS = Path(os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS).resolve()


def machine() -> dict:
    """What the figures were measured on (they are relative on a 2-core VM; absolute ones need real hardware)."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        model = next(l for l in open("/proc/cpuinfo") if l.startswith("model name"))
        info["cpu_model"] = model.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def median_of(fn: Callable[[], float], runs: int) -> tuple[float, list[float]]:
    """Median and all values of ``fn()`` over ``runs`` runs (fn returns the figure it measured)."""
    values = [fn() for _ in range(runs)]
    return statistics.median(values), values


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_page_cache(path: str | None = None) -> bool:
    """Drop the page cache (root), or at least this file's pages (posix_fadvise); True if the global drop worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        if path:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return False


def evict_file(path: str) -> None:
    """Drop one file's clean pages from the page cache (posix_fadvise); no root, no effect on other files.

    Pages still mapped by a live mmap stay cached: unmap before evicting.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_file(path: str) -> None:
    """Read a file once so the next run finds it in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children so far."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def have(cmd: str) -> bool:
    return subprocess.call(["which", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    if title:
        print(title)
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)
