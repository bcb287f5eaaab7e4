"""The compact plan kind: a plan that is a function of the step (``format_version`` 3; 2 still opens).

A compact plan stores its inputs and, per dataset and epoch, the token prefix sums of its document
blocks in their shuffled order (8 bytes per block); any item's pieces are computed on demand from
those, a keyed Feistel bijection (:mod:`foresight.plan.permute`) and the datasets' token counts.

* Blocks: dataset d's n documents are cut into tiles of ``group * S`` consecutive documents (S documents per
  block: ``block_size``, or by default ``ceil(n / max(ceil(n / 256), min(n, 4096)))``, i.e. 256, smaller for
  corpora under a million documents), each tile into ``group`` blocks by stride: block ``t*group + r`` holds
  documents ``t*group*S + r + j*group`` (a shorter last tile of L documents has ``ceil(L / S)`` blocks, strided by
  that count). Documents next to each other in the corpus fall in different blocks
  (placed independently by the block order), while one block's token counts lie within ``group * S`` entries of
  the index (64 blocks per tile by default): a random step reads a few pages of it, not one page per document (:func:`block_layout`;
  format 2 plans are one tile, ``group = nb``, strided over the whole corpus).
* Epoch e of dataset d visits blocks in the order ``perm(k, nb, block_key(seed, d, e))`` for
  k = 0..nb-1, and inside block b its slots in the order ``perm(j, count_b, inner_key(seed, d, e, b))``
  (slot j is the block's j-th document). The epochs, one after another, form the dataset's token stream.
* Dataset d's item k is stream tokens ``[k*seq_len, k*seq_len + seq_len + 1)`` (consecutive items
  overlap by one token, as in the materialized plan); zero-token documents give no pieces.
* Blend: with period R (1 for one dataset, else 65536), the weights are rounded to integer counts
  c_d (largest remainder, each >= 1, summing to R); one period lists the pairs (d, j), j < c_d,
  sorted by ``((2j + 1) / (2 c_d), d)``. Global item i is item ``(i // R) * c_d + rank`` of the
  dataset d at period position ``i % R`` (rank: how many earlier positions went to d).

:class:`CompactPlan` answers ``pieces(start, stop)`` with the same arrays a materialized plan of the
same algorithm would hold, so the loader, ``inspect`` and everything else use it unchanged; its
``item_ptr`` and ``piece_*`` attributes are lazy columns that compute what is sliced. ``pieces`` runs in each
thread's own ``_compact_kernels.Packer``, whose cursors stay where the last call left them: a loader's next step
continues them (no search, no block expanded twice), a rank's next share walks forward to it in the same block.
Its files are checked and opened by :mod:`foresight.plan.compact_store`.

Example::

    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=64, seq_len=2048, num_steps=1000,
                      compact=True)
    plan.save("plan/")
    plan = load_plan("plan/")                 # opens its datasets from sources.json when first used
    p = plan.pieces(*plan.rank_items(step=10, rank=0, world_size=8))
"""
from __future__ import annotations

import ctypes
import math
import mmap
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from foresight._native import load
from foresight.errors import PlanError
from foresight.plan.files import compute_digest
from foresight.plan.locations import describe_sources, open_plan_datasets
from foresight.plan.permute import INNER_ORDER, MASK64, block_key, derive_key
from foresight.plan.plan import FORMAT_NAME, Pieces, Plan

_kernels = load("_compact_kernels")

COMPACT_FORMAT_VERSION = 3
#: Versions this module opens: 2 (blocks strided over the whole corpus, no ``inputs.block_group``) and 3.
COMPACT_FORMAT_VERSIONS = (2, 3)
#: The compact kind's one array: every (dataset, epoch)'s block prefix sums, nb + 1 entries each.
COMPACT_ARRAYS: dict[str, str] = {"block_prefix": "<i8"}
SHUFFLE = "compact"
#: Documents per block by default: 8 bytes of plan per block (about 0.03 bytes per sequence at 2K-token
#: documents and seq_len 8192) and at most this many token counts read to place a random step.
DEFAULT_BLOCK_SIZE = 256
#: ...but at least this many blocks (or one per document) by default: the spread of corpus neighbours is that of
#: one random permutation of the blocks, whose relative standard deviation is about 1.2 / sqrt(num_blocks).
MIN_BLOCKS = 4096
#: Blocks per tile by default (``inputs.block_group``): corpus neighbours up to this far apart fall in different
#: blocks (a run of m similar documents spreads over min(m, 64) blocks), and one block's token counts span 64 * 256
#: entries (32 KiB of a uint16 index: one or two 64 KiB fault-around windows).
DEFAULT_BLOCK_GROUP = 64
#: Items per blend period for mixtures (the weights are kept to 1 / BLEND_PERIOD).
BLEND_PERIOD = 1 << 16
#: Bytes of token counts per chunk while building (whole rows of nb counts, at least one): the more rows a chunk
#: holds, the fewer passes over the block totals (which at 1.8B sequences are 225 MB, far beyond the cache).
_ROWS_BYTES = 256 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_SIZE_CODES = {np.dtype("<u2"): 0, np.dtype("<i4"): 1, np.dtype("<u4"): 2, np.dtype("<i8"): 3}
_ERRORS = {
    -1: "a block's documents do not add up to the tokens the plan recorded for it (the dataset's token counts "
        "changed since the plan was built)",
    -2: "the token stream ran past the plan's epochs (block prefix sums inconsistent with the dataset)",
    -3: "a document has a negative token count",
}


# ---- blending --------------------------------------------------------------------------------------
def blend_period(num_sources: int) -> int:
    return 1 if num_sources == 1 else BLEND_PERIOD


def blend_counts(weights: Sequence[float], period: int) -> np.ndarray:
    """Items per period for each dataset: ``floor(w * R)`` plus one for the largest remainders (lowest
    index first on ties); every dataset must get at least one."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / math.fsum(w.tolist()) * period  # fsum: the correctly rounded sum, the same in any implementation
    counts = np.floor(exact).astype(np.int64)
    rest = exact - counts
    extra = period - int(counts.sum())
    order = sorted(range(len(w)), key=lambda d: (-rest[d], d))
    counts[order[:extra]] += 1
    if int(counts.min()) < 1:
        raise PlanError(f"a weight is below 1/{period} of the total, too small for the compact plan's blend",
                        source=int(np.argmin(counts)), weight=float(w[int(np.argmin(counts))]))
    return counts


def blend_pattern(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One period: ``pattern[q]`` the dataset of position q, ``rank[q]`` its index among that dataset's
    positions. Pairs (d, j) sorted by ``((2j + 1) / (2 c_d), d)``."""
    d = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    key = (2 * j + 1) / (2 * counts[d]).astype(np.float64)
    order = np.lexsort((d, key))
    return d[order].astype(np.uint16), j[order]


def items_per_source(counts: np.ndarray, pattern: np.ndarray, num_items: int) -> np.ndarray:
    period = len(pattern)
    full, rem = divmod(num_items, period)
    return full * counts + np.bincount(pattern[:rem], minlength=len(counts)).astype(np.int64)


# ---- building ---------------------------------------------------------------------------------------
def num_blocks(n: int, block_size: int | None) -> int:
    """Blocks of a format-2 plan's dataset of n documents: ``ceil(n / block_size)``, or by default
    ``max(ceil(n / DEFAULT_BLOCK_SIZE), min(n, MIN_BLOCKS))``."""
    if block_size is not None:
        return -(-n // block_size)
    return max(-(-n // DEFAULT_BLOCK_SIZE), min(n, MIN_BLOCKS))


def block_layout(n: int, block_size: int | None, group: int | None) -> tuple[int, int, int]:
    """``(blocks, group, tile)`` of a dataset of n documents: tiles of ``tile = group * S`` documents
    (``S = block_size``, or by default ``ceil(n / num_blocks(n, None))``), ``group`` blocks per tile (a shorter
    last tile of L documents: ``ceil(L / S)``). ``group=None`` is format 2's layout: one tile of ``n``
    documents strided by ``num_blocks(n, block_size)``.

    >>> block_layout(1000, 10, 4)       # 25 tiles of 40 documents, 4 blocks each
    (100, 4, 40)
    """
    if group is None:
        nb = num_blocks(n, block_size)
        return nb, nb, n
    per_block = block_size if block_size is not None else -(-n // num_blocks(n, None))
    tile = group * per_block
    return int(_kernels.tiled_blocks(n, group, tile)), group, tile


def _token_counts(ds: Any, index: int) -> np.ndarray:
    """The dataset's token counts as a 1-D array the kernel reads in place (uint16/int32/uint32/int64)."""
    sizes = ds.token_counts()
    if not isinstance(sizes, np.ndarray):
        sizes = np.asarray(sizes)
    if sizes.ndim != 1 or sizes.dtype.kind not in "iu" or sizes.shape[0] != int(ds.num_samples):
        raise PlanError("token_counts() must be an integer array with one entry per sample", source=index,
                        shape=sizes.shape, dtype=str(sizes.dtype), num_samples=int(ds.num_samples))
    if sizes.dtype.newbyteorder("<") in _SIZE_CODES and sizes.dtype.byteorder != ">" and sizes.flags.c_contiguous:
        return sizes
    return np.ascontiguousarray(sizes, dtype=np.int64)


def block_totals(sizes: np.ndarray, num_blocks: int, index: int) -> tuple[np.ndarray, int]:
    """Tokens per block of format 2's layout (block b = documents b, b + nb, ...) and the total, reading
    ``sizes`` in chunks of whole rows of nb documents (a memmapped index is streamed, never held): the kernel adds
    each chunk's rows a cache-sized tile of ``totals`` at a time, while the kernel reads ahead the next chunk."""
    return _chunked_totals(sizes, num_blocks, num_blocks, index,
                           lambda address, code, lo, count, totals: _kernels.add_rows(address, code, count, totals))


def tiled_block_totals(sizes: np.ndarray, layout: tuple[int, int, int], index: int) -> tuple[np.ndarray, int]:
    """Tokens per block of the tiled layout ``(blocks, group, tile)`` (:func:`block_layout`) and the total: one
    sequential pass over ``sizes`` in chunks of whole tiles (about 256 MiB; the next chunk read ahead)."""
    nb, group, tile = layout
    if group == nb and tile >= sizes.shape[0]:  # format 2: one tile strided over the corpus
        return block_totals(sizes, nb, index)
    n = sizes.shape[0]
    return _chunked_totals(sizes, nb, tile, index, lambda address, code, lo, count, totals: _kernels.add_tiles(
        address, code, lo, count, n, group, tile, totals))


def _chunked_totals(sizes: np.ndarray, num_blocks: int, unit: int, index: int,
                    add: Callable[[int, int, int, int, np.ndarray], int]) -> tuple[np.ndarray, int]:
    """Tokens per block and the total, in one sequential pass over ``sizes`` in chunks of whole ``unit`` s (rows or
    tiles, about ``_ROWS_BYTES`` each; the next chunk read ahead while this one is added). ``add(address, code,
    lo, count, totals)`` is the kernel adding ``sizes[lo:lo + count]`` into ``totals``; it returns the index in the
    chunk of a negative entry, or -1."""
    n = sizes.shape[0]
    totals = np.zeros(num_blocks, dtype=np.int64)
    code = _SIZE_CODES[sizes.dtype.newbyteorder("<")]
    step = max(1, _ROWS_BYTES // (unit * sizes.itemsize)) * unit
    base = sizes.ctypes.data
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        advise(sizes, hi, min(n, hi + step), mmap.MADV_WILLNEED)  # read from disk while this chunk is added
        bad = add(base + lo * sizes.itemsize, code, lo, hi - lo, totals)
        if bad >= 0:
            raise PlanError("token_counts() has a negative entry", source=index, sample=lo + int(bad))
    return totals, int(totals.sum())


def advise(array: np.ndarray, lo: int, hi: int, advice: int) -> None:
    """``madvise`` the pages of ``array[lo:hi]``: ``MADV_WILLNEED`` reads a memory-mapped file ahead
    (asynchronously), ``MADV_RANDOM`` stops the kernel reading ahead around each fault. Advisory: a refusal (e.g.
    memory that is not a mapping) changes only speed, so its result is not checked."""
    if hi <= lo:
        return
    start = array.ctypes.data + lo * array.itemsize
    aligned = start - start % mmap.PAGESIZE
    _libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(start + (hi - lo) * array.itemsize - aligned),
                  advice)


def build_compact(checked: list[tuple[Any, float]], *, seed: int, global_batch_size: int, seq_len: int,
                  num_steps: int | None, epochs: float | None, block_size: int | None,
                  block_group: int | None = None) -> "CompactPlan":
    """The compact plan of already-checked sources (``build_plan(..., compact=True)`` calls this);
    ``block_group`` blocks per tile (default :data:`DEFAULT_BLOCK_GROUP`)."""
    if seed > MASK64:
        raise PlanError("a compact plan's seed must be below 2**64", seed=seed)
    group = DEFAULT_BLOCK_GROUP if block_group is None else int(block_group)
    if group < 1:
        raise PlanError("block_group (blocks per tile of a compact plan) must be >= 1", block_group=block_group)
    srcs = []
    for i, (ds, _) in enumerate(checked):
        n = int(ds.num_samples)
        sizes = _token_counts(ds, i)
        layout = block_layout(n, block_size, group)
        nb = layout[0]
        totals, total = tiled_block_totals(sizes, layout, i)
        if total < 1:
            raise PlanError("token dataset holds no tokens", source=i)
        srcs.append((n, nb, totals, total))
    period = blend_period(len(checked))
    counts = blend_counts([w for _, w in checked], period)
    pattern, _ = blend_pattern(counts)
    if num_steps is None:
        per_epoch = sum(max(0, (total - 1) // seq_len) for _, _, _, total in srcs)
        num_steps = math.floor(float(epochs) * per_epoch) // global_batch_size
        if num_steps < 1:
            raise PlanError("epochs give less than one step", epochs=epochs, items_per_epoch=per_epoch,
                            global_batch_size=global_batch_size)
    num_items = num_steps * global_batch_size
    items = items_per_source(counts, pattern, num_items)
    epochs_used = [-(-(int(c) * seq_len + 1) // src[3]) if c else 0 for c, src in zip(items, srcs)]
    prefix = block_prefix_of(seed, [src[2] for src in srcs], epochs_used)
    datasets = []
    for d, (n, nb, totals, total) in enumerate(srcs):
        count, used = int(items[d]), epochs_used[d]
        datasets.append({
            "items": count, "share": count / num_items, "epochs_started": used,
            "epochs_covered": (count * seq_len + 1) / total if count else 0.0, "tokens": total, "blocks": nb,
        })
    inputs = {
        "seed": seed, "global_batch_size": global_batch_size, "seq_len": seq_len,
        "num_steps": num_steps if epochs is None else None,
        "epochs": float(epochs) if epochs is not None else None,
        "shuffle": SHUFFLE, "block_size": block_size, "block_group": group, "blend_period": period,
        "sources": [
            {"fingerprint": str(ds.fingerprint), "weight": float(w), "num_samples": int(ds.num_samples),
             "token_dtype": np.dtype(ds.token_dtype).name}
            for ds, w in checked
        ],
    }
    summary = {"kind": "tokens", "num_steps": num_steps, "num_items": num_items, "num_pieces": None,
               "datasets": datasets}
    plan = CompactPlan(inputs=inputs, summary=summary, arrays={"block_prefix": prefix},
                       datasets=[ds for ds, _ in checked])
    plan.source_locations = describe_sources([ds for ds, _ in checked])
    return plan


def block_prefix_of(seed: int, totals: Sequence[np.ndarray], epochs: Sequence[int]) -> np.ndarray:
    """``block_prefix``: for each dataset d (its block totals ``totals[d]``) and epoch ``e < epochs[d]``, the
    prefix sums of its blocks in that epoch's order, each (dataset, epoch) segment filled in place."""
    prefix = np.empty(sum(int(e) * (t.shape[0] + 1) for t, e in zip(totals, epochs)), dtype=np.int64)
    base = 0
    for d, (t, used) in enumerate(zip(totals, epochs)):
        for e in range(int(used)):
            _kernels.block_prefix(t, block_key(seed, d, e), prefix[base : base + t.shape[0] + 1])
            base += t.shape[0] + 1
    return prefix


def derive_block_prefix(inputs: dict[str, Any], summary: dict[str, Any], datasets: Sequence[Any]) -> np.ndarray:
    """A checked compact plan header's ``block_prefix``, computed again from its datasets (what a node does with an
    uploaded plan.json instead of receiving the array): the same block totals and orders as the build. Raises
    :class:`PlanError` when a dataset is not the one the plan names (fingerprint, samples, tokens)."""
    totals = []
    for d, (ds, src, info) in enumerate(zip(datasets, inputs["sources"], summary["datasets"])):
        if str(ds.fingerprint) != src["fingerprint"] or int(ds.num_samples) != src["num_samples"]:
            raise PlanError("dataset is not the one the plan was built over", source=d,
                            expected=src["fingerprint"], given=str(ds.fingerprint))
        layout = block_layout(src["num_samples"], inputs["block_size"], inputs.get("block_group"))
        t, total = tiled_block_totals(_token_counts(ds, d), layout, d)
        if total != info["tokens"]:
            raise PlanError("dataset holds other token counts than the plan was built over", source=d,
                            expected=info["tokens"], given=total)
        totals.append(t)
    return block_prefix_of(inputs["seed"], totals, [info["epochs_started"] for info in summary["datasets"]])


# ---- the plan ---------------------------------------------------------------------------------------
class _LazyColumn:
    """``plan.item_ptr`` / ``plan.piece_*`` of a compact plan: computed from item 0 up to what is sliced.
    Reading a prefix costs a walk of the plan that far; :meth:`CompactPlan.pieces` is the way to read a step."""

    def __init__(self, plan: "CompactPlan", name: str, dtype: str) -> None:
        self._plan, self._name, self.dtype, self.ndim = plan, name, np.dtype(dtype), 1

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        return self._plan.num_items + 1 if self._name == "item_ptr" else self._plan.num_pieces

    def __getitem__(self, key: Any) -> Any:
        n = len(self)
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            i = int(key) + n if key < 0 else int(key)
            if not 0 <= i < n:
                raise IndexError(f"index {key} out of range for {self._name} of length {n}")
            return self[i : i + 1][0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a compact plan's {self._name} takes integers and contiguous slices")
        lo, hi, _ = key.indices(n)
        hi = max(lo, hi)
        if self._name == "item_ptr":
            return self._plan._item_ptr_prefix(hi)[lo:hi]
        return self._plan._pieces_prefix(hi)[self._name][lo:hi]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


class CompactPlan(Plan):
    """A plan computed on demand from its inputs and block prefix sums (see the module docstring).

    Built by ``build_plan(..., compact=True)``, opened by :func:`foresight.plan.load_plan`. It needs its
    datasets' token counts: those it was built from, those given to :meth:`attach`, or else the ones
    ``sources.json`` locates (opened on first use and checked by fingerprint)."""

    array_dtypes = COMPACT_ARRAYS

    def __init__(self, *, inputs: dict[str, Any], summary: dict[str, Any], arrays: dict[str, np.ndarray],
                 digest: str | None = None, path: str | None = None, datasets: Sequence[Any] | None = None,
                 format_version: int = COMPACT_FORMAT_VERSION) -> None:
        self.inputs, self.summary, self.arrays, self.path = inputs, summary, arrays, path
        self.format_version = format_version  # 2: opened from an older plan (no inputs.block_group)
        self._digest = digest
        self._datasets = list(datasets) if datasets is not None else None
        self._kernel_args: tuple | None = None
        self._packers = threading.local()  # each thread's Packer: its cursors continue from its last step
        self._num_pieces: int | None = None
        self._prefix_cache: dict[str, Any] = {"items": 0, "ptr": np.zeros(1, np.int64), "pieces": None}
        for name, dtype in (("item_ptr", "<i8"), ("piece_dataset", "<u2"), ("piece_sample", "<i8"),
                            ("piece_offset", "<i8"), ("piece_length", "<i8")):
            setattr(self, name, _LazyColumn(self, name, dtype))

    @property
    def num_pieces(self) -> int:
        """Pieces of the whole plan: counted by walking it once (cached), as nothing stores them."""
        if self._num_pieces is None:
            total, step = 0, 1 << 20
            for lo in range(0, self.num_items, step):
                ptr = self._count(lo, min(lo + step, self.num_items))
                total += int(ptr[-1])
            self._num_pieces = total
        return self._num_pieces

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = compute_digest(self.header(), self.arrays, COMPACT_ARRAYS)
        return self._digest

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "inputs": self.inputs,
            "summary": self.summary,
            "arrays": {name: {"dtype": dtype, "shape": [int(self.arrays[name].shape[0])]}
                       for name, dtype in COMPACT_ARRAYS.items()},
        }

    def layout(self, d: int) -> tuple[int, int, int]:
        """Dataset d's ``(blocks, group, tile)`` (:func:`block_layout`; format 2 has no ``block_group``)."""
        return block_layout(self.inputs["sources"][d]["num_samples"], self.inputs["block_size"],
                            self.inputs.get("block_group"))

    def attach(self, datasets: Sequence[Any]) -> "CompactPlan":
        """Use ``datasets`` (the plan's sources, in order; checked by fingerprint) for token counts."""
        self.check_sources(datasets)
        self._datasets = list(datasets)
        self._kernel_args = None
        return self

    def pieces(self, start: int, stop: int) -> Pieces:
        """The pieces of items ``[start, stop)``, computed (``item_ptr`` starts at 0)."""
        if not (0 <= start <= stop <= self.num_items):
            raise PlanError(f"item range must lie within [0, {self.num_items}]", start=start, stop=stop)
        try:
            return Pieces(*self._packer().pack(int(start), int(stop)))
        except _kernels.PackError as e:
            raise self._kernel_error(*e.args) from None

    def max_rank_pieces(self, end_step: int, world_size: int) -> int:
        """An upper bound on the pieces of one rank's share of one step, from the block summaries, without walking
        the plan. A share of n items holds k <= n consecutive items of a dataset: ``R = k * seq_len + 1`` tokens of
        its stream, which touch at most ``2 + ceil(R / t_min)`` non-empty blocks (``t_min``: the fewest tokens of a
        non-empty block) of at most S documents each (``ceil(num_samples / blocks)`` in format 2), plus one piece per
        item boundary cutting a document; and never more than ``k * (seq_len + 1)`` (every piece holds a token)."""
        if end_step < 1:
            return 0
        n, seq_len = self.global_batch_size // world_size, self.seq_len
        bound = 0
        for d, (info, src) in enumerate(zip(self.summary["datasets"], self.inputs["sources"])):
            k = min(n, info["items"])
            if k == 0:
                continue
            nb, group, tile = self.layout(d)
            # documents of the largest block: S (= tile / group) when tiled, ceil(n / nb) in format 2's one tile
            docs = -(-src["num_samples"] // nb) if group == nb else min(tile // group, src["num_samples"])
            blocks = 2 + -(-(k * seq_len + 1) // self._min_block_tokens(d))
            bound += min(k * (seq_len + 1), blocks * docs + k)
        return min(n * (seq_len + 1), bound)

    def _min_block_tokens(self, d: int) -> int:
        """Fewest tokens of a non-empty block of dataset d (its first epoch's segment of the prefix sums; cached)."""
        cache = self._prefix_cache.setdefault("min_block_tokens", {})
        if d not in cache:
            infos = self.summary["datasets"]
            base = sum(i["epochs_started"] * (i["blocks"] + 1) for i in infos[:d])
            seg = self.arrays["block_prefix"][base : base + infos[d]["blocks"] + 1]
            cache[d] = max(1, int(_kernels.min_positive_step(seg)))
        return cache[d]

    def leading_piece_lengths(self, limit: int = 1 << 20) -> np.ndarray:
        """Piece lengths of the plan's first items (at most 65,536 of them, and ``limit`` pieces), computed."""
        return self.pieces(0, min(self.num_items, 1 << 16)).length[:limit]

    def __getstate__(self) -> dict[str, Any]:
        # the kernel's arguments hold raw addresses of this process's token-count arrays: rebuilt where unpickled
        state = dict(self.__dict__, _kernel_args=None)
        del state["_packers"]
        state["_prefix_cache"] = {"items": 0, "ptr": np.zeros(1, np.int64), "pieces": None}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _packers=threading.local())

    def memory_bytes(self) -> int:
        """Bytes this plan holds in memory to compute steps, beyond ``block_prefix`` (memory-mapped from its file)
        and the datasets' token counts (their own index): the blend period and per-dataset descriptors."""
        prefix = self.arrays["block_prefix"]
        return sum(a.nbytes for a in self._args()[:-1]
                   if isinstance(a, np.ndarray) and not np.shares_memory(a, prefix))

    # ---- internals ------------------------------------------------------------------------------------
    def _sources(self) -> list:
        if self._datasets is None:
            try:
                self._datasets = open_plan_datasets(self)
            except PlanError as e:
                raise PlanError(f"a compact plan computes its steps from its datasets' token counts, and it cannot "
                                f"open them: {e}; or give them with plan.attach(datasets)") from e
        return self._datasets

    def _args(self) -> tuple:
        if self._kernel_args is None:
            inputs, summary = self.inputs, self.summary
            seed, period = inputs["seed"], inputs["blend_period"]
            counts = blend_counts([s["weight"] for s in inputs["sources"]], period)
            pattern, rank = blend_pattern(counts)
            sizes = [_token_counts(ds, i) for i, ds in enumerate(self._sources())]
            for i, (s, want) in enumerate(zip(sizes, inputs["sources"])):
                if s.shape[0] != want["num_samples"]:
                    raise PlanError("dataset has another number of samples than the plan was built over", source=i,
                                    expected=want["num_samples"], given=s.shape[0])
            ds_info = summary["datasets"]
            epochs = np.array([d["epochs_started"] for d in ds_info], dtype=np.int64)
            n_blocks = np.array([d["blocks"] for d in ds_info], dtype=np.int64)
            layouts = [self.layout(d) for d in range(len(ds_info))]
            prefix_base = np.zeros(len(ds_info), dtype=np.int64)
            np.cumsum((epochs * (n_blocks + 1))[:-1], out=prefix_base[1:])
            key_base = np.zeros(len(ds_info), dtype=np.int64)
            np.cumsum(epochs[:-1], out=key_base[1:])
            bkeys = [block_key(seed, d, e) for d in range(len(ds_info)) for e in range(int(epochs[d]))]
            ikeys = [derive_key(seed, d, e, INNER_ORDER) for d in range(len(ds_info)) for e in range(int(epochs[d]))]
            prefix = np.asarray(self.arrays["block_prefix"])
            self._kernel_args = (
                pattern, rank, counts,
                np.array([s.ctypes.data for s in sizes], dtype=np.uint64),
                np.array([_SIZE_CODES[s.dtype.newbyteorder("<")] for s in sizes], dtype=np.int32),
                np.array([s["num_samples"] for s in inputs["sources"]], dtype=np.int64),
                n_blocks, np.array([g for _, g, _ in layouts], dtype=np.int64),
                np.array([t for _, _, t in layouts], dtype=np.int64),
                np.array([d["tokens"] for d in ds_info], dtype=np.int64), epochs, prefix_base, key_base,
                prefix if prefix.size else np.zeros(1, np.int64),
                np.array(bkeys or [0], dtype=np.uint64), np.array(ikeys or [0], dtype=np.uint64),
                sizes,  # kept alive: the kernel reads them through raw pointers
            )
        return self._kernel_args

    def _count(self, start: int, stop: int) -> np.ndarray:
        """``item_ptr`` of the items ``[start, stop)`` (starting at 0): the pieces counted, none written."""
        args = self._args()
        ptr = np.empty(stop - start + 1, dtype=np.int64)
        empty8, info = np.empty(0, np.int64), np.zeros(4, dtype=np.int64)
        total = _kernels.pack_range(start, stop, self.seq_len, *args[:-1], ptr, np.empty(0, np.uint16), empty8,
                                    empty8, empty8, info)
        if total < 0:
            raise self._kernel_error(total, *(int(x) for x in info))
        return ptr

    def _packer(self) -> Any:
        """This thread's :class:`_compact_kernels.Packer` over the current kernel arguments (made again after
        :meth:`attach`)."""
        args, local = self._args(), self._packers
        if getattr(local, "args", None) is not args:
            local.packer, local.args = _kernels.Packer(self.seq_len, *args[:-1]), args
        return local.packer

    def _kernel_error(self, code: int, d: int, epoch: int, pos: int, block: int) -> PlanError:
        return PlanError(_ERRORS.get(code, f"compact plan kernel error {code}"), path=self.path, dataset=d,
                         epoch=epoch, block_position=pos, block=block,
                         fingerprint=self.inputs["sources"][d]["fingerprint"])

    def _item_ptr_prefix(self, length: int) -> np.ndarray:
        """``item_ptr[:length]`` (walks items up to length - 1, count only, cached)."""
        cache = self._prefix_cache
        while cache["items"] + 1 < length:
            lo = cache["items"]
            hi = min(self.num_items, max(length - 1, lo + (1 << 16)))
            ptr = self._count(lo, hi)
            cache["ptr"] = np.concatenate([cache["ptr"], cache["ptr"][-1] + ptr[1:]])
            cache["items"] = hi
        return cache["ptr"][:length]

    def _pieces_prefix(self, count: int) -> dict[str, np.ndarray]:
        """The first ``count`` pieces of the plan, as the four piece columns."""
        have = self._prefix_cache["pieces"]
        if have is None or have["piece_length"].shape[0] < count:
            ptr = self._item_ptr_prefix(self.num_items + 1) if count > 0 else np.zeros(1, np.int64)
            items = int(np.searchsorted(ptr, count, side="left"))
            p = self.pieces(0, min(items, self.num_items))
            have = {"piece_dataset": p.dataset, "piece_sample": p.sample, "piece_offset": p.offset,
                    "piece_length": p.length}
            self._prefix_cache["pieces"] = have
        return have

    def __repr__(self) -> str:
        return (f"CompactPlan(num_steps={self.num_steps}, global_batch_size={self.global_batch_size}, "
                f"seq_len={self.seq_len}, block_size={self.inputs['block_size']}, path={self.path!r})")


def check_compact_args(kind: str, shuffle: str, block_size: Any) -> int | None:
    """The builder's checks for ``compact=True``; returns the block size (None: the default)."""
    if kind != "tokens":
        raise PlanError("compact plans are for token data; sample plans stay materialized (drop compact=True)")
    if shuffle != "global":
        raise PlanError("a compact plan has its own shuffle: leave shuffle at its default", shuffle=shuffle)
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise PlanError("block_size (documents per block of a compact plan) must be an integer >= 1",
                        block_size=block_size)
    return int(block_size)
