"""GPU handoff: batches view the pinned arena (no host copy between read and transfer) and copy from it fast.

Where a CUDA device is present this one script

1. (``--build``) builds the native extensions in place, (``--test``) runs the arena, loader and GPU tests;
2. packs a small token dataset and builds a plan;
3. runs :class:`foresight.Loader` with ``device="cpu"`` and checks that the batch's ``tokens`` tensor lies inside
   one arena slot (``data_ptr`` within ``[arena.address(slot), + slot_bytes)``) and is pinned: the bytes the
   engine read are the bytes the GPU copies, with no host copy in between;
4. measures host-to-device GB/s of that batch (``.to("cuda", non_blocking=True)`` + synchronize, median of
   ``--runs``) against the same bytes in pageable memory, for the batch and for a whole arena slot;
5. runs the Loader with ``device="cuda"`` for a few steps, checks the rows equal the CPU loader's, and reports
   its stats (per-stage time, stall, bytes, I/Os).

Without CUDA it prints ``gpu_handoff: skipped (no CUDA device)``, writes a JSON saying so and exits 0;
``--cpu-check`` still runs the arena containment check of step 3 on the CPU (the arena is then not pinned).

Usage::

    python bench/gpu_handoff.py                    # measure (GPU machine)
    python bench/gpu_handoff.py --build --test     # build, test and measure in one go
    python bench/gpu_handoff.py --smoke            # tiny dataset, few runs
    bash bench/gpu_device.sh                       # all of it on a GPU machine without registries
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_table, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _import_foresight() -> None:
    """Use the installed package, or the source tree's python/ when it is not installed."""
    try:
        import foresight  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO / "python"))


def build() -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=REPO, check=True)


def run_tests() -> int:
    tests = ["tests/test_arena.py", "tests/test_loader.py", "tests/test_gpu.py", "tests/test_checkpoint_internals.py"]
    path = [str(REPO / "python"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", *tests], cwd=REPO, env=env)


def make_token_data(root: Path, *, tokens: int, batch: int, seq_len: int, steps: int):
    """A uint16 token dataset of random documents and a global plan over it."""
    from foresight.format import DatasetWriter, open_dataset
    from foresight.plan import build_plan

    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 4096, size=max(1, tokens // 2000))
    data = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.uint16)
    path = root / "tokens"
    with DatasetWriter(str(path), align=4096, token_dtype="uint16", fsync=False) as w:
        w.add_many(data, lengths, modality="tokens")
    ds = open_dataset(str(path))
    plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=batch, seq_len=seq_len, num_steps=steps)
    return ds, plan


def arena_containment(loader, tensor) -> dict:
    """Which arena slot holds ``tensor``'s storage, and whether all of it lies inside that slot."""
    arena = loader._arena  # the loader's own arena: what its reads landed in
    ptr = tensor.data_ptr()
    nbytes = tensor.numel() * tensor.element_size()
    slot = next((i for i in range(arena.slots)
                 if arena.address(i) <= ptr < arena.address(i) + arena.slot_bytes), None)
    inside = slot is not None and ptr + nbytes <= arena.address(slot) + arena.slot_bytes
    return {
        "tensor_ptr": hex(ptr), "tensor_bytes": nbytes, "slot": slot,
        "slot_start": hex(arena.address(slot)) if slot is not None else None,
        "slot_bytes": arena.slot_bytes, "offset_in_slot": ptr - arena.address(slot) if slot is not None else None,
        "inside_slot": bool(inside), "arena_pinned": bool(arena.pinned), "tensor_is_pinned": _is_pinned(tensor),
    }


def _is_pinned(tensor) -> bool | None:
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:  # no CUDA runtime to ask
        return None


def h2d_gbps(src, runs: int) -> tuple[float, list[float]]:
    """Median host-to-device GB/s of ``src.to("cuda", non_blocking=True)`` + synchronize."""
    import torch

    for _ in range(3):  # warm-up: allocator, context, first-touch of the mapping
        src.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    nbytes = src.numel() * src.element_size()
    values = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst = src.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        values.append(nbytes / (time.perf_counter() - t0) / 1e9)
        del dst
    return statistics.median(values), values


def measure(ds, plan, runs: int, cuda_steps: int) -> dict:
    import torch

    from foresight.loader import Loader

    out: dict = {}
    with Loader(plan, datasets=ds, device="cpu", prefetch=2, end_step=min(plan.num_steps, 2)) as loader:
        steps = iter(loader)  # kept alive: the batch is valid until the next one is asked for
        batch = next(steps)
        tokens = batch["tokens"]
        out["containment"] = arena_containment(loader, tokens)
        slot = out["containment"]["slot"]
        rows = []
        if torch.cuda.is_available():
            whole = loader._arena.tensor(slot)
            for what, pinned_src in (("batch tokens", tokens), ("arena slot", whole)):
                pageable = pinned_src.clone()  # same bytes, ordinary (pageable) memory
                assert not pageable.is_pinned()
                for kind, src in (("arena (pinned)", pinned_src), ("pageable copy", pageable)):
                    gbps, values = h2d_gbps(src, runs)
                    rows.append({"what": what, "source": kind, "mib": src.numel() * src.element_size() / 2**20,
                                 "h2d_gb_per_s": gbps, "all": values})
            pinned = {r["what"]: r["h2d_gb_per_s"] for r in rows if r["source"].startswith("arena")}
            for r in rows:
                r["x_pageable"] = None
            for r in rows:
                if r["source"] == "pageable copy":
                    r["x_pageable"] = 1.0
                    base = r["h2d_gb_per_s"]
                    for q in rows:
                        if q["what"] == r["what"] and q["source"].startswith("arena"):
                            q["x_pageable"] = pinned[q["what"]] / base
        out["h2d"] = rows
        reference = tokens.numpy().copy()
        first_step = batch.step
    if torch.cuda.is_available():
        steps = min(plan.num_steps, cuda_steps)
        with Loader(plan, datasets=ds, device="cuda", prefetch=2, end_step=steps) as loader:
            t0 = time.perf_counter()
            n = 0
            for b in loader:
                if b.step == first_step:
                    got = b["tokens"].cpu().numpy()
                    out["cuda_rows_match_cpu"] = bool(np.array_equal(got, reference))
                    out["cuda_device"] = str(b["input_ids"].device)
                n += 1
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            stats = loader.stats.as_dict()
        tokens_per_step = plan.global_batch_size * plan.seq_len
        out["cuda_loader"] = {"steps": n, "wall_s": wall, "steps_per_s": n / wall,
                              "tokens_per_s": n * tokens_per_step / wall, "stats": stats}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny dataset, few runs")
    ap.add_argument("--runs", type=int, default=20, help="H2D copies per measurement (median)")
    ap.add_argument("--build", action="store_true", help="build the native extensions first")
    ap.add_argument("--test", action="store_true", help="run the arena and loader tests first")
    ap.add_argument("--cpu-check", action="store_true", help="without CUDA, still check the arena containment")
    args = ap.parse_args(argv)
    name = "gpu_handoff_smoke" if args.smoke else "gpu_handoff"

    if args.build:
        build()
    _import_foresight()
    import torch

    info = machine()
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu_check:
        print("gpu_handoff: skipped (no CUDA device)")
        write_results(name, {"machine": info, "skipped": True, "reason": "no CUDA device"})
        return 0
    tests_rc = run_tests() if args.test else None

    if args.smoke:
        tokens, batch, seq_len, steps, runs, cuda_steps = 300_000, 8, 1024, 6, 3, 4
    else:
        tokens, batch, seq_len, steps, runs, cuda_steps = 40_000_000, 256, 8192, 16, args.runs, 16
    tmp = tempfile.mkdtemp(prefix="foresight-gpu-handoff-")
    try:
        ds, plan = make_token_data(Path(tmp), tokens=tokens, batch=batch, seq_len=seq_len, steps=steps)
        out = measure(ds, plan, runs, cuda_steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    c = out["containment"]
    print(f"gpu_handoff: {info.get('gpu', 'no CUDA device (cpu check only)')}")
    print(f"  batch tokens: {c['tensor_bytes']} B at {c['tensor_ptr']} = slot {c['slot']} + {c['offset_in_slot']} "
          f"(slot of {c['slot_bytes']} B at {c['slot_start']}): inside={c['inside_slot']}, "
          f"arena pinned={c['arena_pinned']}, tensor pinned={c['tensor_is_pinned']}")
    if out.get("h2d"):
        print()
        print_table(out["h2d"], ["what", "source", "mib", "h2d_gb_per_s", "x_pageable"],
                    title=f"host-to-device (median of {runs})")
    if out.get("cuda_loader"):
        cl = out["cuda_loader"]
        print(f"\nLoader(device='cuda'): {cl['steps']} steps, {cl['steps_per_s']:.1f} steps/s, "
              f"{cl['tokens_per_s'] / 1e6:.1f} M tokens/s, rows match cpu: {out.get('cuda_rows_match_cpu')}")
        s = cl["stats"]
        print("  " + "  ".join(f"{k}={s[k] * 1e3:.1f}ms" for k in
                               ("plan_s", "coalesce_s", "submit_s", "io_wait_s", "collate_s", "h2d_s", "stall_s")))
        print(f"  ios={s['ios']} bytes_read={s['bytes_read']} amplification={s['amplification']:.3f} "
              f"backend={s['backend']}")
    if not has_cuda:
        print("gpu_handoff: skipped (no CUDA device); arena containment checked on the CPU only")
    payload = {"machine": info, "skipped": not has_cuda, "smoke": args.smoke, "tests_rc": tests_rc,
               "dataset_tokens": tokens, "batch": batch, "seq_len": seq_len, **out}
    path = write_results(name, payload)
    print(f"wrote {path}")
    ok = c["inside_slot"] and (not has_cuda or (c["tensor_is_pinned"] and out.get("cuda_rows_match_cpu")))
    return 0 if ok and not tests_rc else 1


if __name__ == "__main__":
    sys.exit(main())
