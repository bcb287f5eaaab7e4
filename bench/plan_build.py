"""Plan build time and peak memory: foresight (Cython) vs the same algorithm in plain numpy vs
megatron-core's sample-index builder, for token data with packing and for media (whole-sample) data.

Each case runs in its own subprocess (so peak RSS, from ``ru_maxrss``, is that case's alone) under
a 16 GiB address-space cap. ``build_s`` is the median wall time of the build over ``--repeats``
runs; ``cpu_s`` its CPU time (steadier on a shared 2-core VM); ``mem_gib`` the peak RSS growth
during the build (inputs excluded); ``same_as_numpy`` checks foresight's arrays are byte-identical
to the numpy implementation's.

Rows compare like with like: ``foresight`` (global shuffle) with ``numpy`` and megatron-core (which builds only a
global shuffle), ``foresight-block`` with ``numpy-block`` (block-local shuffle, blocks of 256); ``vs_*`` are the other
builder's time over ours (> 1: ours is faster), and ``does`` says what each builder actually computes.

* tokens: N documents of 1..599 tokens (mean 300), seq_len 2048, one epoch; items are packed
  sequences of seq_len + 1 tokens, each a list of (dataset, sample, offset, length) pieces.
  megatron: ``RandomState.shuffle`` of the document index + ``helpers.build_sample_idx`` (C++),
  what ``GPTDataset`` does (its output is only (doc index, offset) per sequence, no piece list).
* media: N samples of 10 KB..2 MB, one epoch, one piece per item.
  megatron: ``_build_shuffle_index`` (``RandomState.shuffle`` of an arange), its analogue for
  unpacked data.

The compact kind (``foresight-compact``) is also measured by ``bench/plan_compact.py``: mixing statistics
beside the global and block shuffles and megatron-core's GPTDataset order (``--mixing-docs``), and its cost at
10M and 100M sequences (``--compact-sizes``; add 1800000000 for the 15T-token case, whose document lengths are
generated and written in chunks to a memmapped file under ``--scratch`` or /tmp, about 15 GB).

Usage::

    python bench/plan_build.py            # 10M and 100M samples, 3 runs each (about 15 minutes)
    python bench/plan_build.py --smoke    # 100k samples, one run, a few seconds
    python bench/plan_build.py --sections scale --compact-sizes 1800000000
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_table, write_results
from plan_compact import mixing_rows, scale_rows

SEQ_LEN = 2048
BATCH = 512
MEM_CAP = 16 << 30
IMPLS = ("foresight", "numpy", "megatron", "foresight-block", "numpy-block", "foresight-compact")
BLOCK = 256  # block size of the block-local shuffles
# What each builder computes: the rows are not all the same work, so the table says it beside the figure.
DOES = {
    ("tokens", "foresight"): "global shuffle + packing, full piece lists",
    ("tokens", "numpy"): "same algorithm as foresight, plain numpy",
    ("tokens", "megatron"): "global doc shuffle + sample_idx (doc, offset) only, no piece lists",
    ("tokens", "foresight-block"): "block shuffle + packing, full piece lists",
    ("tokens", "numpy-block"): "same block algorithm, plain numpy",
    ("media", "foresight"): "global shuffle, one piece per item",
    ("media", "numpy"): "same algorithm as foresight, plain numpy",
    ("media", "megatron"): "global shuffle index only (_build_shuffle_index)",
    ("media", "foresight-block"): "block shuffle, one piece per item",
    ("media", "numpy-block"): "same block algorithm, plain numpy",
    ("tokens", "foresight-compact"): "compact kind: block prefix sums only, steps computed on demand",
    ("media", "foresight-compact"): "compact kind (token data only)",
}


def make_sizes(kind: str, n: int):
    import numpy as np

    rng = np.random.default_rng(1234)
    if kind == "tokens":
        return rng.integers(1, 600, n, dtype=np.int64)
    return rng.integers(10_000, 2_000_000, n, dtype=np.int64)


def rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def arrays_sha(arrays: dict) -> str:
    import numpy as np

    h = hashlib.sha256()
    for name in ("item_ptr", "piece_dataset", "piece_sample", "piece_offset", "piece_length"):
        a = arrays[name]
        for lo in range(0, a.shape[0], 1 << 22):
            h.update(np.ascontiguousarray(a[lo : lo + (1 << 22)]).data)
    return h.hexdigest()[:16]


def worker(impl: str, kind: str, n: int) -> dict:
    """One measured build in this process; prints a JSON line."""
    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))
    import numpy as np

    sizes = make_sizes(kind, n)
    seq_len = SEQ_LEN if kind == "tokens" else None
    tokens_per_epoch = int(sizes.sum())
    num_items = ((tokens_per_epoch - 1) // SEQ_LEN if kind == "tokens" else n) // BATCH * BATCH
    out: dict = {"impl": impl, "kind": kind, "samples": n, "items": num_items}
    if impl == "foresight-compact":
        from foresight.plan import ArraySource, build_plan

        if kind != "tokens":
            out["error"] = "token data only"
            return out
        src = ArraySource(sizes, tokens=True, fingerprint="bench")
        run = lambda: build_plan([(src, 1.0)], seed=1, global_batch_size=BATCH, seq_len=seq_len, epochs=1,
                                 compact=True).arrays
    elif impl.startswith("foresight"):
        from foresight.plan import ArraySource, build_plan

        src = ArraySource(sizes, tokens=kind == "tokens", fingerprint="bench")
        block = impl == "foresight-block"
        run = lambda: build_plan([(src, 1.0)], seed=1, global_batch_size=BATCH, seq_len=seq_len, epochs=1,
                                 shuffle="block" if block else "global", block_size=BLOCK if block else None).arrays
    elif impl.startswith("numpy"):
        from foresight.testing.plan_reference import reference_arrays

        block = impl == "numpy-block"
        run = lambda: reference_arrays([sizes], weights=[1.0], kind=kind, seed=1, num_items=num_items,
                                       seq_len=seq_len, shuffle="block" if block else "global",
                                       block_size=BLOCK if block else None)
    elif impl == "megatron":
        try:
            import warnings

            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers as mh
            from megatron.core.datasets.gpt_dataset import _build_shuffle_index
        except Exception as e:  # noqa: BLE001  (not installed, or its C++ helpers do not import here
            out["error"] = f"megatron-core unavailable: {type(e).__name__}: {e}"
            return out
        sizes32 = sizes.astype(np.int32)
        del sizes

        def run():
            state = np.random.RandomState(1)
            if kind == "tokens":
                doc_idx = np.arange(n, dtype=np.int32)
                state.shuffle(doc_idx)
                return {"sample_idx": mh.build_sample_idx(sizes32, doc_idx, SEQ_LEN, 1, tokens_per_epoch, True, True)}
            return {"shuffle_idx": _build_shuffle_index(n, n, state)}
    else:
        raise SystemExit(f"unknown impl {impl!r}; choose from {IMPLS}")
    before = rss_now()
    c0, t0 = time.process_time(), time.perf_counter()
    arrays = run()
    out["build_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    out["mem_gib"] = max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / 2**30
    if "piece_sample" in arrays:
        out["pieces"] = int(arrays["piece_sample"].shape[0])
        out["arrays_sha"] = arrays_sha(arrays)
    return out


def run_case(impl: str, kind: str, n: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, kind, str(n)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"impl": impl, "kind": kind, "samples": n, "error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="100k samples, one run")
    ap.add_argument("--sizes", default="10000000,100000000", help="comma-separated sample counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--sections", default="build,mixing,scale", help="which of build, mixing, scale to run")
    ap.add_argument("--mixing-docs", type=int, default=1_000_000, help="documents of the mixing corpus")
    ap.add_argument("--compact-sizes", default="10000000,100000000", help="sequences for the compact scale rows")
    ap.add_argument("--megatron-limit", type=int, default=100_000_000,
                    help="largest size megatron-core's indexes are built at (beyond: sized from dtypes)")
    ap.add_argument("--scratch", default=None, help="directory for the scale rows' generated corpus and plans")
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "KIND", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        impl, kind, n = args.worker
        print(json.dumps(worker(impl, kind, int(n))))
        return 0
    sizes = [100_000] if args.smoke else [int(s) for s in args.sizes.split(",")]
    repeats = 1 if args.smoke else args.repeats
    impls = args.impls.split(",")
    sections = args.sections.split(",")
    rows, raw = [], []
    for n in sizes if "build" in sections else []:
        for kind in ("tokens", "media"):
            for impl in impls:
                runs = [run_case(impl, kind, n) for _ in range(repeats)]
                print(f"  {kind} {n:,} {impl}: " + ", ".join(
                    f"{r['build_s']:.2f}s" if "build_s" in r else r["error"] for r in runs), file=sys.stderr, flush=True)
                raw.extend(runs)
                good = [r for r in runs if "error" not in r]
                row = {"kind": kind, "samples": f"{n:,}", "impl": impl, "does": DOES.get((kind, impl), "")}
                if not good:
                    row["note"] = runs[0]["error"][:70]
                    rows.append(row)
                    continue
                for key in ("build_s", "cpu_s", "mem_gib", "peak_rss_gib"):
                    row[key] = statistics.median(r[key] for r in good)
                row["runs"] = len(good)
                row["items"] = good[0]["items"]
                row["pieces"] = good[0].get("pieces")
                row["sha"] = good[0].get("arrays_sha")
                rows.append(row)
            case = {r["impl"]: r for r in rows if r["kind"] == kind and r["samples"] == f"{n:,}" and "build_s" in r}
            for impl, r in case.items():
                # each foresight row against the numpy build of the same shuffle; megatron beside the global ones
                base = case.get("numpy-block" if impl.endswith("-block") else "numpy")
                if base:
                    r["vs_numpy"] = base["build_s"] / r["build_s"]
                    if impl.startswith("foresight") and r.get("sha"):
                        r["same_as_numpy"] = r["sha"] == base.get("sha")
                if "megatron" in case and not impl.endswith("-block"):
                    r["vs_megatron"] = case["megatron"]["build_s"] / r["build_s"]
    cols = ["kind", "samples", "impl", "build_s", "cpu_s", "vs_numpy", "vs_megatron", "mem_gib", "peak_rss_gib",
            "items", "pieces", "same_as_numpy", "does", "note"]
    print_table(rows, cols, title=f"plan build, {'smoke' if args.smoke else 'full'} (median of {repeats})")
    mixing, scale = [], []
    if "mixing" in sections:
        mixing = mixing_rows(100_000 if args.smoke else args.mixing_docs,
                             ["global", "block", "compact", "compact-16", "compact-256", "compact-4096"]
                             + (["megatron"] if "megatron" in impls else []),
                             steps=40 if args.smoke else 400)
        print_table(mixing, ["impl", "docs", "seqs", "pairs", "distance", "distance_vs_global", "within_5pct", "near",
                             "near_group", "near_uniform", "share_std", "share_maxdev", "note"],
                    title="\nmixing: corpus-adjacent documents' sequence distance / num_seqs (uniform 1/3), "
                          "P(same or adjacent sequence); source 0's sequences per step of 512 at 0.7/0.3")
    if "scale" in sections:
        scale = scale_rows([20_000] if args.smoke else [int(s) for s in args.compact_sizes.split(",")],
                           args.smoke, args.megatron_limit, with_megatron="megatron" in impls,
                           scratch=args.scratch)
        print_table(scale, ["impl", "seqs", "docs", "build_s", "cpu_s", "build_mem_gib", "bytes_per_seq",
                            "file_bytes", "open_s", "open_verify_s", "step_cold_ms_median", "step_cold_ms_p99",
                            "step_cold_majflt", "step_cold_minflt", "step_fresh_ms_median", "step_fresh_ms_p99",
                            "step_fresh_minflt", "step_warm_ms_median", "step_warm_ms_p99", "step_index_pages",
                            "window_seqs_per_s", "window_seqs_per_cpu_s", "generate_s", "note"],
                    title=f"\ncompact plan at scale (seq_len 8192, batch 512, documents 1..4095 tokens; "
                          f"{os.cpu_count()} cores, shared)")
    path = write_results("plan_build_smoke" if args.smoke else "plan_build",
                         {"machine": machine(), "seq_len": SEQ_LEN, "global_batch_size": BATCH, "repeats": repeats,
                          "rows": rows, "runs": raw, "mixing": mixing, "compact_scale": scale})
    print(f"wrote {path}")
    bad = [r for r in rows if r.get("same_as_numpy") is False]
    if bad:
        print("ERROR: foresight and numpy plans differ", file=sys.stderr)
        return 1
    if any(r.get("within_5pct") is False and r["impl"] == "compact" for r in mixing):  # the default block count
        print("ERROR: the compact plan mixes worse than the global shuffle by more than 5%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
