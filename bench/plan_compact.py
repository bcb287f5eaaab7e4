"""The compact plan's figures for ``bench/plan_build.py``: mixing statistics against the global shuffle, the block
shuffle and megatron-core's GPTDataset order, and its cost at pre-training scale.

Mixing (defined in docs/formats.md, "Mixing statistics"), on one corpus of N documents of 1..599 tokens packed
into sequences of 2,048 tokens, one epoch, global batch 1 (so item = sequence):

* ``distance``: for corpus-adjacent documents (i, i+1), the mean of ``|seq(i) - seq(i+1)| / num_seqs``, where
  seq(d) is the first sequence holding a token of d (a uniform shuffle gives 1/3);
* ``near``: the fraction of those pairs with ``|seq(i) - seq(i+1)| <= 1`` (same or adjacent sequences);
* ``near_group``: the same for documents 64 apart (i, i+64), which the compact kind's default tiles put in one block;
* ``share_std`` / ``share_maxdev``: for two sources blended 0.7 / 0.3 at global batch 512, the standard deviation
  and the largest deviation from 0.7 * 512 of source 0's sequences per step.

Scale: document lengths 1..4095 tokens (mean 2,048) from a deterministic generator written in chunks to a uint16
file (memmapped, never held), seq_len 8,192, global batch 512, one epoch. Reported per size: build time (wall, CPU)
and peak anonymous memory growth (the memmapped index's pages apart, as ``build_rss_gib``), the plan's files and
in-memory arrays per sequence, open-to-first-step (load without and with the digest check, attach the index, step
0's pieces), random step lookup, and the rate of materializing a window of 10,000 consecutive steps.

Random steps are timed in fresh processes over the saved plan, three ways, each the median (and p99) of the same
200 random steps: ``cold`` (the index and the plan's files dropped from the page cache first, posix_fadvise
DONTNEED: every page a step reads comes from disk), ``fresh`` (a new process, the page cache holding them: minor
faults) and ``warm`` (the same steps again in that process). Beside the times, counts that do not depend on load:
page faults per step (getrusage, this thread: major in the cold pass, minor in the fresh one) and the index pages a
step reads (the 4 KiB pages spanned by the documents of the blocks its pieces fall in, computed from the layout). megatron-core beside it: its GPTDataset index build
(document shuffle, build_sample_idx, shuffle index) where it fits, else its bytes from its dtypes.

Example::

    python bench/plan_build.py --compact-sizes 10000000 --mixing-docs 1000000
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from common import evict_file

MIX_SEQ, MIX_BATCH, MIX_STEPS = 2048, 512, 400
GROUP_GAP = 64  # near_group: documents this far apart, which the compact kind's default tiles put in one block
SCALE_SEQ, SCALE_BATCH, DOC_MAX = 8192, 512, 4095
GEN_CHUNK = 1 << 26  # documents per generator chunk (128 MiB of uint16)
WINDOW_STEPS = 10_000
RANDOM_STEPS = 200
PAGE = 4096


# ---- mixing -----------------------------------------------------------------------------------------
def _first_sequence(sample: np.ndarray, item_ptr: np.ndarray, n: int) -> np.ndarray:
    """seq(d) for every document (-1 where the epoch never reaches it)."""
    items = np.repeat(np.arange(len(item_ptr) - 1, dtype=np.int64), np.diff(item_ptr))
    first = np.full(n, -1, dtype=np.int64)
    first[sample[::-1]] = items[::-1]  # the last write wins: the earliest item
    return first


def _megatron_first_sequence(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    import warnings

    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers as mh
    from megatron.core.datasets.gpt_dataset import _build_shuffle_index

    n = len(sizes)
    state = np.random.RandomState(1)
    doc_idx = np.arange(n, dtype=np.int32)
    state.shuffle(doc_idx)
    sample_idx = mh.build_sample_idx(sizes.astype(np.int32), doc_idx, MIX_SEQ, 1, int(sizes.sum()), True, True)
    ns = sample_idx.shape[0] - 1
    shuffle = _build_shuffle_index(ns, ns, state)
    position = np.empty(ns, dtype=np.int64)
    position[shuffle] = np.arange(ns)
    starts, offs = sample_idx[:ns, 0].astype(np.int64), sample_idx[:ns, 1]
    p = np.arange(n, dtype=np.int64)
    j = np.searchsorted(starts, p, side="left")
    begins_here = (j < ns) & (starts[np.minimum(j, ns - 1)] == p) & (offs[np.minimum(j, ns - 1)] == 0)
    j = np.where(begins_here, j, j - 1)
    placed = (j >= 0) & (p <= int(sample_idx[ns, 0]))
    first = np.full(n, -1, dtype=np.int64)
    first[doc_idx[p[placed]]] = position[j[placed]]
    first[sizes == 0] = -1
    return first, ns


def _plan_first_sequence(impl: str, sizes: np.ndarray) -> tuple[np.ndarray, int]:
    from foresight.plan import ArraySource, build_plan

    kw = {"compact": True, "block_size": int(impl.split("-")[1]) if "-" in impl else None} \
        if impl.startswith("compact") else ({"shuffle": "block", "block_size": 256} if impl == "block" else {})
    plan = build_plan([(ArraySource(sizes, tokens=True), 1.0)], seed=1, global_batch_size=1, seq_len=MIX_SEQ,
                      epochs=1, **kw)
    p = plan.pieces(0, plan.num_items)
    return _first_sequence(np.asarray(p.sample), np.asarray(p.item_ptr), len(sizes)), plan.num_items


def _share_counts(impl: str, sizes_a: np.ndarray, sizes_b: np.ndarray, steps: int) -> np.ndarray:
    """Source 0's sequences per step, for ``steps`` steps of MIX_BATCH at weights 0.7 / 0.3."""
    size = steps * MIX_BATCH
    if impl == "megatron":
        import warnings

        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers as mh

        index = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        mh.build_blending_indices(index, sample, np.array([0.7, 0.3]), 2, size, False)
        first = index
    else:
        from foresight.plan import ArraySource, build_plan

        kw = {"compact": True} if impl.startswith("compact") else (
            {"shuffle": "block", "block_size": 256} if impl == "block" else {})
        plan = build_plan([(ArraySource(sizes_a, tokens=True), 0.7), (ArraySource(sizes_b, tokens=True), 0.3)],
                          seed=1, global_batch_size=MIX_BATCH, seq_len=MIX_SEQ, num_steps=steps, **kw)
        p = plan.pieces(0, plan.num_items)
        first = np.asarray(p.dataset)[np.asarray(p.item_ptr)[:-1]]
    return (first.reshape(steps, MIX_BATCH) == 0).sum(axis=1)


def mixing_rows(n_docs: int, impls: list[str], steps: int = MIX_STEPS) -> list[dict]:
    rng = np.random.default_rng(1234)
    sizes = rng.integers(1, 600, n_docs, dtype=np.int64)
    sizes_b = rng.integers(1, 600, max(1000, steps * MIX_BATCH * MIX_SEQ // 300 // 2), dtype=np.int64)
    rows = []
    for impl in impls:
        row: dict = {"impl": impl, "docs": n_docs}
        try:
            first, num_seqs = (_megatron_first_sequence(sizes) if impl == "megatron"
                               else _plan_first_sequence(impl, sizes))
            counts = _share_counts(impl, sizes, sizes_b, steps)
        except ImportError as e:
            row["note"] = f"unavailable: {e}"[:70]
            rows.append(row)
            continue
        a, b = first[:-1], first[1:]
        both = (a >= 0) & (b >= 0)
        gap = np.abs(a[both] - b[both])
        ag, bg = first[:-GROUP_GAP], first[GROUP_GAP:]
        both_g = (ag >= 0) & (bg >= 0)
        row.update(seqs=num_seqs, pairs=int(both.sum()), distance=float(gap.mean()) / num_seqs,
                   near=float((gap <= 1).mean()), near_uniform=3.0 / num_seqs,
                   near_group=float((np.abs(ag[both_g] - bg[both_g]) <= 1).mean()),
                   share_std=float(counts.std()), share_maxdev=float(np.abs(counts - 0.7 * MIX_BATCH).max()))
        rows.append(row)
    base = next((r for r in rows if r["impl"] == "global" and "distance" in r), None)
    for r in rows:
        if base and "distance" in r:
            r["distance_vs_global"] = r["distance"] / base["distance"]
            r["within_5pct"] = bool(abs(r["distance_vs_global"] - 1) <= 0.05)
    return rows


# ---- scale ------------------------------------------------------------------------------------------
class MemmapSource:
    """Token counts in a uint16 .npy file, memmapped: a plan source whose index is never held in memory."""

    token_dtype = np.dtype(np.uint16)

    def __init__(self, path: str, n: int) -> None:
        self.path_npy, self.num_samples, self.fingerprint = path, n, f"sha256:bench-generated-{n}"

    def token_counts(self) -> np.ndarray:
        return np.load(self.path_npy, mmap_mode="r")

    def sample_bytes(self) -> np.ndarray:
        raise NotImplementedError("token data")


def write_sizes(path: str, n: int) -> float:
    """Document lengths 1..DOC_MAX from a deterministic generator, chunk by chunk; returns seconds."""
    t0 = time.perf_counter()
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(n,))
    for c, lo in enumerate(range(0, n, GEN_CHUNK)):
        hi = min(n, lo + GEN_CHUNK)
        out[lo:hi] = np.random.default_rng([1234, c]).integers(1, DOC_MAX + 1, hi - lo, dtype=np.uint16)
        out.flush()
    del out
    return time.perf_counter() - t0


class AnonPeak:
    """Peak anonymous memory (RssAnon, sampled every 5 ms) while the block runs: ru_maxrss would also count the
    memmapped index's pages, which are page cache, not the build's memory."""

    def __enter__(self) -> "AnonPeak":
        import threading

        self.peak, self._stop = self.now(), threading.Event()
        self.base = self.peak
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def scale_worker(n_seqs: int, workdir: str, smoke: bool) -> dict:
    """One size: build, save, open, look up, window. Runs in its own process."""
    from foresight.plan import build_plan, load_plan

    n_docs = n_seqs * SCALE_SEQ * 2 // (DOC_MAX + 1) + 4096
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sizes_path = os.path.join(workdir, f"sizes-{n_seqs}.npy")
    out: dict = {"impl": "foresight-compact", "seqs_target": n_seqs, "docs": n_docs}
    with open(os.path.join(workdir, f"generate-{n_seqs}.json")) as f:
        out["generate_s"] = json.load(f)["generate_s"]
    src = MemmapSource(sizes_path, n_docs)
    c0, t0 = time.process_time(), time.perf_counter()
    with AnonPeak() as mem:
        plan = build_plan([(src, 1.0)], seed=1, global_batch_size=SCALE_BATCH, seq_len=SCALE_SEQ, epochs=1,
                          compact=True)
    out["build_s"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    out["build_mem_gib"] = (mem.peak - mem.base) / 2**30
    out["build_rss_gib"] = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / 2**30
    out["seqs"], out["steps"] = plan.num_items, plan.num_steps
    plan_dir = os.path.join(workdir, f"plan-{n_seqs}")
    plan.save(plan_dir, overwrite=True)
    del plan
    files = sum(os.path.getsize(os.path.join(plan_dir, f)) for f in os.listdir(plan_dir))
    for verify in (False, True):
        t0 = time.perf_counter()
        opened = load_plan(plan_dir, verify=verify)
        opened.attach([src])
        first = opened.pieces(*opened.rank_items(0, 0, 1))
        out["open_verify_s" if verify else "open_s"] = time.perf_counter() - t0
    memory = opened.memory_bytes()
    out["file_bytes"], out["memory_bytes"] = files, memory
    out["bytes_per_seq"] = (files + memory) / out["seqs"]
    out["pieces_step0"] = int(first.item_ptr[-1])
    rng = np.random.default_rng(7)
    window = min(opened.num_steps, 200 if smoke else WINDOW_STEPS)
    start = int(rng.integers(0, opened.num_steps - window + 1))
    t0, c0 = time.perf_counter(), time.thread_time()
    for lo in range(start, start + window, 100):
        hi = min(start + window, lo + 100)
        opened.pieces(lo * SCALE_BATCH, hi * SCALE_BATCH)
    out["window_steps"] = window
    out["window_seqs_per_s"] = window * SCALE_BATCH / (time.perf_counter() - t0)
    out["window_seqs_per_cpu_s"] = window * SCALE_BATCH / (time.thread_time() - c0)
    return out


def index_pages(plan, pieces) -> int:
    """4 KiB pages of dataset 0's index (token counts, ``itemsize`` bytes each) that the kernel reads for these
    pieces: those spanned by every document of each block a piece falls in (it reads a block's counts whole)."""
    from foresight.plan.compact import block_layout

    n = plan.inputs["sources"][0]["num_samples"]
    nb, group, tile = block_layout(n, plan.inputs["block_size"], plan.inputs.get("block_group"))
    itemsize = np.dtype(plan.inputs["sources"][0]["token_dtype"]).itemsize
    docs = np.unique(np.asarray(pieces.sample)[np.asarray(pieces.dataset) == 0])
    base = docs // tile * tile
    length = np.minimum(tile, n - base)
    stride = np.where(length >= tile, group, -(-length // max(1, tile // group)))
    first = base + (docs - base) % stride
    count = -(-(length - (first - base)) // stride)
    last = first + (count - 1) * stride
    pages: set[int] = set()
    for f, last_doc, g in zip(first.tolist(), last.tolist(), stride.tolist()):
        if g * itemsize <= PAGE:  # documents packed closer than a page: the whole span
            pages.update(range(f * itemsize // PAGE, last_doc * itemsize // PAGE + 1))
        else:  # strided further than a page: one page per document
            pages.update(((np.arange(f, last_doc + 1, g) * itemsize) // PAGE).tolist())
    return len(pages)


def _timed_steps(plan, steps) -> dict:
    wall, faults_min, faults_maj = [], [], []
    for step in steps:
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        plan.pieces(*plan.rank_items(int(step), 0, 1))
        wall.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        faults_min.append(r1.ru_minflt - r0.ru_minflt)
        faults_maj.append(r1.ru_majflt - r0.ru_majflt)
    return {"ms_median": statistics.median(wall) * 1e3, "ms_p99": float(np.percentile(wall, 99)) * 1e3,
            "minflt": float(np.mean(faults_min)), "majflt": float(np.mean(faults_maj))}


def steps_worker(n_seqs: int, workdir: str, which: str) -> dict:
    """Random steps of the saved plan in this fresh process: ``cold`` after dropping the index and the plan from
    the page cache, or ``fresh`` then ``warm`` (the same steps again) with the page cache as it is."""
    from foresight.plan import load_plan

    n_docs = n_seqs * SCALE_SEQ * 2 // (DOC_MAX + 1) + 4096
    sizes_path = os.path.join(workdir, f"sizes-{n_seqs}.npy")
    plan_dir = os.path.join(workdir, f"plan-{n_seqs}")
    if which == "cold":
        for path in [sizes_path] + [os.path.join(plan_dir, f) for f in os.listdir(plan_dir)]:
            evict_file(path)  # written back, then dropped from the page cache (nothing maps them here)
    plan = load_plan(plan_dir, verify=False)
    plan.attach([MemmapSource(sizes_path, n_docs)])
    steps = np.random.default_rng(7).integers(0, plan.num_steps, RANDOM_STEPS)
    out = {f"step_{which}_{k}": v for k, v in _timed_steps(plan, steps).items()}
    if which == "fresh":
        out.update({f"step_warm_{k}": v for k, v in _timed_steps(plan, steps).items()})
        pages = [index_pages(plan, plan.pieces(*plan.rank_items(int(s), 0, 1))) for s in steps[:50]]
        out["step_index_pages"] = float(np.mean(pages))
        out["step_index_bytes"] = out["step_index_pages"] * PAGE
    return out


def megatron_scale(n_seqs: int, workdir: str, run: bool) -> dict:
    """megatron-core's GPTDataset indexes for the same corpus: built where ``run``, else sized from dtypes."""
    n_docs = n_seqs * SCALE_SEQ * 2 // (DOC_MAX + 1) + 4096
    doc_bytes = 4 if n_docs < 2**31 else 8
    sample_bytes = 8 if n_docs < 2**31 else 16
    shuffle_bytes = 4 if n_seqs < 2**32 else 8
    out: dict = {"impl": "megatron", "seqs_target": n_seqs, "docs": n_docs,
                 "bytes_per_seq": (n_docs * doc_bytes + (n_seqs + 1) * sample_bytes + n_seqs * shuffle_bytes) / n_seqs}
    if not run:
        out["note"] = "not built (does not fit); bytes from its dtypes"
        return out
    try:
        import warnings

        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers as mh
        from megatron.core.datasets.gpt_dataset import _build_shuffle_index
    except Exception as e:  # noqa: BLE001  not installed, or its C++ helpers do not import here
        out["note"] = f"megatron-core unavailable: {type(e).__name__}"
        return out
    sizes = np.load(os.path.join(workdir, f"sizes-{n_seqs}.npy"), mmap_mode="r").astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    c0, t0 = time.process_time(), time.perf_counter()
    state = np.random.RandomState(1)
    doc_idx = np.arange(len(sizes), dtype=np.int32)
    state.shuffle(doc_idx)
    sample_idx = mh.build_sample_idx(sizes, doc_idx, SCALE_SEQ, 1, tokens, True, True)
    shuffle = _build_shuffle_index(sample_idx.shape[0] - 1, sample_idx.shape[0] - 1, state)
    out["build_s"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    out["seqs"] = int(sample_idx.shape[0] - 1)
    out["bytes_per_seq"] = (doc_idx.nbytes + sample_idx.nbytes + shuffle.nbytes) / out["seqs"]
    return out


def scale_rows(sizes: list[int], smoke: bool, megatron_limit: int, *, with_megatron: bool = True,
               scratch: str | None = None) -> list[dict]:
    """Each size in its own subprocess (fresh memory), compact then megatron on the same lengths; the generated
    corpus and the plans go to a temporary directory under ``scratch`` (default: the system's)."""
    workdir = tempfile.mkdtemp(prefix="plan-compact-bench-", dir=scratch)
    rows = []
    try:
        for n in sizes:
            for which in ("generate", "compact", "cold", "fresh") + (("megatron",) if with_megatron else ()):
                cmd = [sys.executable, os.path.abspath(__file__), which, str(n), workdir, "1" if smoke else "0",
                       str(megatron_limit)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
                    rows.append({"impl": which, "seqs_target": n, "note": f"exit {proc.returncode}: {tail[0]}"[:90]})
                elif which in ("cold", "fresh"):  # the compact row's random steps, each pass in a fresh process
                    row = next((r for r in rows if r["impl"] == "foresight-compact" and r["seqs_target"] == n), None)
                    if row is not None:
                        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                elif which != "generate":
                    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"  scale {n:,} {which}: done", file=sys.stderr, flush=True)
            for f in os.listdir(workdir):  # the next size writes its own corpus
                path = os.path.join(workdir, f)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


if __name__ == "__main__":
    which, n, workdir, smoke, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
    if which == "generate":  # its own process, so the build's peak memory is the build's alone
        n_docs = n * SCALE_SEQ * 2 // (DOC_MAX + 1) + 4096
        result = {"generate_s": write_sizes(os.path.join(workdir, f"sizes-{n}.npy"), n_docs)}
        with open(os.path.join(workdir, f"generate-{n}.json"), "w") as f:
            json.dump(result, f)
    elif which == "compact":
        result = scale_worker(n, workdir, smoke)
    elif which in ("cold", "fresh"):
        result = steps_worker(n, workdir, which)
    else:
        result = megatron_scale(n, workdir, n <= limit)
    print(json.dumps(result))
