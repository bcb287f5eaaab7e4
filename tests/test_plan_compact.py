"""The compact plan kind: equal, item by item, to a plain materialized reference of its algorithm
(tests/compact_reference.py), stored as plan.json + block prefix sums, digest-checked, and refusing bad input."""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compact_reference import draw_corpus, mix, perm, reference_compact
from foresight import _compact_kernels
from foresight.errors import FormatError, PlanError
from foresight.plan import ArraySource, CompactPlan, build_plan, load_plan
from foresight.plan import compact
from foresight.plan.compact import blend_counts, block_layout
from foresight.plan.permute import derive_key, permute, splitmix64

NAMES = ("item_ptr", "piece_dataset", "piece_sample", "piece_offset", "piece_length")


def _sources(sizes, weights):
    return [(ArraySource(np.asarray(s), tokens=True), w) for s, w in zip(sizes, weights)]


def _assert_equal_to_reference(plan, sizes, weights, seed, seq_len, block_size, block_group=64):
    ref = reference_compact(sizes, weights, seed=seed, seq_len=seq_len, num_items=plan.num_items,
                            block_size=block_size, block_group=block_group)
    got = plan.pieces(0, plan.num_items)
    for name, arr in zip(NAMES, got):
        np.testing.assert_array_equal(arr, ref[name], err_msg=name)
    return ref


def test_permutation_spec_python_numpy_and_cython_agree():
    assert splitmix64(0) == mix(0) and derive_key(3, 1, 2, 0) != derive_key(3, 1, 2, 1)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 100, 1000, 4097):
        key = derive_key(9, m)
        x = np.arange(m, dtype=np.uint64)
        fast = _compact_kernels.permute_many(x, m, key)
        spec = permute(x, m, key)
        np.testing.assert_array_equal(fast, spec)
        assert sorted(fast.tolist()) == list(range(m))  # a bijection of [0, m)
        assert [perm(i, m, key) for i in range(m)] == fast.tolist()
    big = np.array([0, 1, 12345, 10**12 - 1], dtype=np.uint64)
    np.testing.assert_array_equal(_compact_kernels.permute_many(big, 10**12, 77), permute(big, 10**12, 77))
    with pytest.raises(ValueError, match="not below"):
        _compact_kernels.permute_many(np.array([5], np.uint64), 5, 1)


def test_small_corpus_matches_reference_and_stream_is_exact():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 50, 300), rng.integers(1, 20, 77)
    plan = build_plan(_sources([a, b], [0.7, 0.3]), seed=5, global_batch_size=4, seq_len=16, num_steps=200,
                      compact=True, block_size=8)
    assert isinstance(plan, CompactPlan) and plan.kind == "tokens"
    ref = _assert_equal_to_reference(plan, [a, b], [0.7, 0.3], 5, 16, 8)
    # several epochs of the small dataset were needed, each a fresh order
    assert plan.summary["datasets"][1]["epochs_started"] >= 3
    assert np.all(np.add.reduceat(ref["piece_length"], ref["item_ptr"][:-1]) == 17)
    # windows anywhere give the same pieces as the whole
    for start, stop in [(0, 1), (5, 9), (123, 456), (799, 800), (300, 300)]:
        p = plan.pieces(start, stop)
        lo, hi = ref["item_ptr"][start], ref["item_ptr"][stop]
        np.testing.assert_array_equal(p.item_ptr, ref["item_ptr"][start : stop + 1] - lo)
        np.testing.assert_array_equal(p.sample, ref["piece_sample"][lo:hi])
        np.testing.assert_array_equal(p.offset, ref["piece_offset"][lo:hi])
    # lazy columns, as the loader reads them
    assert plan.num_pieces == len(ref["piece_sample"]) == len(plan.piece_length)
    np.testing.assert_array_equal(np.asarray(plan.item_ptr[:11]), ref["item_ptr"][:11])
    np.testing.assert_array_equal(np.asarray(plan.piece_length[:40]), ref["piece_length"][:40])
    assert plan.item_ptr[-1] == plan.num_pieces


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_sources=st.integers(1, 3),
    block_size=st.one_of(st.none(), st.integers(1, 40)),
    seq_len=st.integers(1, 40),
    seed=st.integers(0, 2**64 - 1),
    batch=st.sampled_from([1, 2, 4, 6, 8]),
    steps=st.integers(1, 30),
    group=st.sampled_from([1, 2, 3, 16, 1000]),
)
def test_hypothesis_equals_reference(data, num_sources, block_size, seq_len, seed, batch, steps, group):
    sizes, weights = draw_corpus(data, num_sources)
    with mock.patch.object(compact, "DEFAULT_BLOCK_GROUP", group):
        plan = build_plan(_sources(sizes, weights), seed=seed, global_batch_size=batch, seq_len=seq_len,
                          num_steps=steps, compact=True, block_size=block_size)
    assert plan.inputs["block_group"] == group
    ref = _assert_equal_to_reference(plan, sizes, weights, seed, seq_len, block_size, group)
    # every world size sees the same global sequence: the rank shares concatenate to the step
    world = data.draw(st.sampled_from([w for w in (1, 2, 3, 4, 6, 8) if batch % w == 0]))
    step = data.draw(st.integers(0, steps - 1))
    parts = [plan.pieces(*plan.rank_items(step, r, world)) for r in range(world)]
    lo, hi = ref["item_ptr"][step * batch], ref["item_ptr"][(step + 1) * batch]
    np.testing.assert_array_equal(np.concatenate([p.sample for p in parts]), ref["piece_sample"][lo:hi])
    np.testing.assert_array_equal(np.concatenate([p.length for p in parts]), ref["piece_length"][lo:hi])


@pytest.mark.parametrize("block_size", [513, 1000, 5000])
def test_blocks_larger_than_the_kernels_buffer(block_size):
    # blocks of more than 512 documents are walked document by document instead of expanded at once
    rng = np.random.default_rng(block_size)
    a, b = rng.integers(0, 30, 2100), rng.integers(1, 9, 700)
    plan = build_plan(_sources([a, b], [0.5, 0.5]), seed=2, global_batch_size=4, seq_len=64, num_steps=120,
                      compact=True, block_size=block_size)
    ref = _assert_equal_to_reference(plan, [a, b], [0.5, 0.5], 2, 64, block_size)
    step = plan.pieces(*plan.step_items(77))  # placed from scratch, mid-block
    lo, hi = ref["item_ptr"][77 * 4], ref["item_ptr"][78 * 4]
    np.testing.assert_array_equal(step.sample, ref["piece_sample"][lo:hi])


def test_blend_shares_and_epochs_argument():
    rng = np.random.default_rng(1)
    sizes = [rng.integers(1, 30, 500), rng.integers(1, 30, 300), rng.integers(1, 30, 200)]
    plan = build_plan(_sources(sizes, [5, 3, 2]), seed=1, global_batch_size=10, seq_len=8, num_steps=300,
                      compact=True)
    shares = [d["share"] for d in plan.summary["datasets"]]
    assert np.allclose(shares, [0.5, 0.3, 0.2], atol=1e-3)
    p = plan.pieces(0, plan.num_items)
    first = np.asarray(p.dataset)[p.item_ptr[:-1]]
    per_step = np.stack([np.bincount(first[s * 10 : (s + 1) * 10], minlength=3) for s in range(300)])
    assert (per_step.min(axis=0) >= [4, 2, 1]).all() and (per_step.max(axis=0) <= [6, 4, 3]).all()  # within one
    assert blend_counts([5, 3, 2], 65536).sum() == 65536
    assert [d["blocks"] for d in plan.summary["datasets"]] == [500, 300, 200]  # default: one per document here
    one = build_plan(_sources(sizes[:1], [1.0]), seed=1, global_batch_size=10, seq_len=8, epochs=2.0, compact=True)
    total = int(sizes[0].sum())
    assert one.num_steps == (2 * ((total - 1) // 8)) // 10 and one.inputs["epochs"] == 2.0
    assert one.summary["datasets"][0]["epochs_started"] == 2


def test_save_load_digest_and_datasets(tmp_path):
    rng = np.random.default_rng(2)
    src = ArraySource(rng.integers(0, 40, 500), tokens=True)
    plan = build_plan([(src, 1.0)], seed=3, global_batch_size=4, seq_len=32, num_steps=40, compact=True,
                      block_size=16)
    out = str(tmp_path / "plan")
    plan.save(out)
    assert sorted(os.listdir(out)) == ["block_prefix.npy", "plan.json"]
    doc = json.loads(open(os.path.join(out, "plan.json")).read())
    assert doc["format_version"] == 3 and doc["inputs"]["block_group"] == 64 and doc["digest"] == plan.digest and doc["summary"]["num_pieces"] is None
    loaded = load_plan(out)
    assert isinstance(loaded, CompactPlan) and loaded.digest == plan.digest
    with pytest.raises(PlanError, match="attach"):  # built from in-memory sizes: no sources.json to find them by
        loaded.pieces(0, 1)
    loaded.attach([src])
    a, b = loaded.pieces(0, loaded.num_items), plan.pieces(0, plan.num_items)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # the same inputs give the same digest; another seed or block size another
    again = build_plan([(src, 1.0)], seed=3, global_batch_size=4, seq_len=32, num_steps=40, compact=True,
                       block_size=16)
    assert again.digest == plan.digest
    for kw in ({"seed": 4, "block_size": 16}, {"seed": 3, "block_size": 8}):
        other = build_plan([(src, 1.0)], global_batch_size=4, seq_len=32, num_steps=40, compact=True, **kw)
        assert other.digest != plan.digest
    with pytest.raises(PlanError, match="does not match"):
        loaded.attach([ArraySource(rng.integers(0, 40, 500), tokens=True)])


def test_pickled_plan_rebuilds_its_kernel_arguments():
    import pickle

    src = ArraySource(np.arange(1, 300), tokens=True)
    plan = build_plan([(src, 1.0)], seed=3, global_batch_size=4, seq_len=32, num_steps=20, compact=True)
    want = plan.pieces(0, plan.num_items)
    copy = pickle.loads(pickle.dumps(plan))
    assert copy._kernel_args is None  # raw addresses never cross a process boundary
    for x, y in zip(copy.pieces(0, copy.num_items), want):
        np.testing.assert_array_equal(x, y)


def test_corrupt_files_are_refused(tmp_path):
    src = ArraySource(np.arange(1, 200), tokens=True)
    out = str(tmp_path / "plan")
    build_plan([(src, 1.0)], seed=3, global_batch_size=4, seq_len=32, num_steps=40, compact=True,
               block_size=16).save(out)
    prefix = os.path.join(out, "block_prefix.npy")
    arr = np.load(prefix)
    edited = arr.copy()
    edited[3], edited[4] = edited[4], edited[3]  # decreasing, same ends
    np.save(prefix, edited)
    with pytest.raises(FormatError, match="must not decrease"):
        load_plan(out)
    edited = arr.copy()
    edited[3] += 1
    np.save(prefix, edited)
    with pytest.raises(PlanError, match="digest"):
        load_plan(out)
    np.save(prefix, arr)
    doc = json.loads(open(os.path.join(out, "plan.json")).read())
    doc["summary"]["datasets"][0]["blocks"] += 1
    open(os.path.join(out, "plan.json"), "w").write(json.dumps(doc))
    with pytest.raises(FormatError, match="format_version 3.*blocks"):
        load_plan(out)
    doc["summary"]["datasets"][0]["blocks"] -= 1
    for bad in (0, 1 << 60):
        doc["inputs"]["block_group"] = bad
        open(os.path.join(out, "plan.json"), "w").write(json.dumps(doc))
        with pytest.raises(FormatError, match="block_group"):
            load_plan(out)
    doc["format_version"] = 4
    open(os.path.join(out, "plan.json"), "w").write(json.dumps(doc))
    with pytest.raises(FormatError, match="format_version 4") as e:
        load_plan(out)
    assert e.value.context["path"].endswith("plan.json")


V2_PLAN = os.path.join(os.path.dirname(__file__), "data", "compact_v2_plan")


def test_format_2_plans_still_open_and_give_their_steps(tmp_path):
    # written by the format-2 code (one tile strided over the corpus); its pieces hashed there
    sizes = np.random.default_rng(11).integers(0, 50, 700)
    plan = load_plan(V2_PLAN)
    assert plan.format_version == 2 and "block_group" not in plan.inputs
    assert plan.digest == "sha256:500da422d90e1ca8fd1656b607098311e67a5d3c48b3f08863ad051374756ffc"
    plan.attach([ArraySource(sizes, tokens=True, fingerprint="sha256:v2-fixture")])
    p = plan.pieces(0, plan.num_items)
    got = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in (p.sample, p.offset, p.length)))
    assert got.hexdigest() == "4aa2f1cb30d248d9174862ca5d8a5dfad6dd67cd68766cbf5afb8a591cdfaee6"
    _assert_equal_to_reference(plan, [sizes], [1.0], 9, 24, 8, block_group=None)
    assert plan.header()["format_version"] == 2  # saved again as it was: same digest
    plan.save(str(tmp_path / "again"))
    assert load_plan(str(tmp_path / "again")).digest == plan.digest


def test_changed_token_counts_are_caught_when_walked(tmp_path):
    sizes = np.arange(1, 200)
    plan = build_plan([(ArraySource(sizes, tokens=True), 1.0)], seed=3, global_batch_size=4, seq_len=32,
                      num_steps=40, compact=True, block_size=16)
    changed = sizes.copy()
    changed[:] = 1
    plan._datasets = [ArraySource(changed, tokens=True)]  # as if the index had been rewritten under the plan
    with pytest.raises(PlanError, match="do not add up|ran past"):
        plan.pieces(0, plan.num_items)


def test_bad_arguments():
    src = ArraySource(np.arange(1, 50), tokens=True)
    media = ArraySource(np.arange(1, 50), tokens=False)
    kw = dict(seed=1, global_batch_size=2, num_steps=5, compact=True)
    with pytest.raises(PlanError, match="token data"):
        build_plan([(media, 1.0)], **kw)
    with pytest.raises(PlanError, match="own shuffle"):
        build_plan([(src, 1.0)], seq_len=8, shuffle="block", block_size=4, **kw)
    with pytest.raises(PlanError, match="block_size"):
        build_plan([(src, 1.0)], seq_len=8, block_size=0, **kw)
    with pytest.raises(PlanError, match="2\\*\\*64"):
        build_plan([(src, 1.0)], seq_len=8, **dict(kw, seed=2**64))
    with pytest.raises(PlanError, match="too small"):
        build_plan([(src, 1.0), (src, 1e-6)], seq_len=8, **kw)
    with pytest.raises(PlanError, match="no tokens"):
        build_plan([(ArraySource(np.zeros(5, np.int64), tokens=True), 1.0)], seq_len=8, **kw)
    with pytest.raises(PlanError, match="negative"):
        build_plan([(ArraySource(np.array([3, -1, 4]), tokens=True), 1.0)], seq_len=8, **kw)


def test_default_block_count():
    from foresight.plan.compact import num_blocks

    assert [num_blocks(n, None) for n in (1, 100, 4096, 10**6, 2 * 10**6)] == [1, 100, 4096, 4096, 7813]
    assert num_blocks(1000, 256) == 4 and num_blocks(1, 256) == 1
    # tiles of group * S documents, group blocks each (a short last tile: ceil(L / S) blocks of about S)
    assert block_layout(1000, 10, 4) == (100, 4, 40)
    assert block_layout(1003, 10, 4) == (101, 4, 40)
    assert block_layout(1035, 10, 4) == (104, 4, 40)  # 25 full tiles, then 35 documents in 4 blocks
    assert block_layout(2 * 10**6, None, 16) == (488 * 16 + 5, 16, 16 * 256)
    assert block_layout(100, None, 16) == (100, 16, 16)
    assert block_layout(10**6, None, None) == (4096, 4096, 10**6)  # format 2: one tile strided by nb


def test_memmapped_uint16_counts_are_read_in_place(tmp_path):
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 3000, 5000).astype(np.uint16)
    mm = np.lib.format.open_memmap(str(tmp_path / "sizes.npy"), mode="w+", dtype=np.uint16, shape=sizes.shape)
    mm[:] = sizes
    mm.flush()

    class Memmapped(ArraySource):
        def token_counts(self):
            return np.load(str(tmp_path / "sizes.npy"), mmap_mode="r")

    src = Memmapped(sizes.astype(np.int64), tokens=True)
    plan = build_plan([(src, 1.0)], seed=8, global_batch_size=8, seq_len=512, num_steps=50, compact=True,
                      block_size=32)
    assert plan._args()[-1][0].dtype == np.uint16  # no int64 copy of the index
    _assert_equal_to_reference(plan, [sizes.astype(np.int64)], [1.0], 8, 512, 32)


def test_cli_compact_and_inspect(tmp_path):
    fmt = pytest.importorskip("foresight.format")
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 90, 300)
    fmt.write_megatron_dataset(str(tmp_path / "corpus"), [rng.integers(0, 60000, int(k), dtype=np.uint16)
                                                          for k in lengths], np.uint16)
    out = str(tmp_path / "plan")
    run = lambda *a: subprocess.run([sys.executable, "-m", "foresight", *a], capture_output=True, text=True)
    res = run("plan", str(tmp_path / "corpus"), "--seed", "5", "--global-batch-size", "4", "--seq-len", "32",
              "--steps", "20", "--compact", "--block-size", "8", "--out", out)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["inputs"]["shuffle"] == "compact" and report["inputs"]["block_size"] == 8
    res = run("inspect", out, "--step", "3", "--rank", "1", "--world-size", "2")
    assert res.returncode == 0, res.stderr
    step = json.loads(res.stdout)
    assert [i["item"] for i in step["items"]] == [14, 15]
    plan = load_plan(out)
    p = plan.pieces(14, 16)
    sample, length = step["pieces"].index("sample"), step["pieces"].index("length")  # pieces are rows
    assert [pc[sample] for pc in step["items"][0]["pieces"]] == p.sample[: p.item_ptr[1]].tolist()
    assert all(sum(pc[length] for pc in i["pieces"]) == 33 for i in step["items"])


@pytest.mark.parametrize("dtype", ["<u2", "<i4", "<u4", "<i8"])
@pytest.mark.parametrize("n,nb", [(1, 1), (100, 7), (50_000, 20_000), (70_001, 33_000), (40_000, 40_000)])
def test_block_totals_match_numpy(dtype, n, nb, monkeypatch):
    from foresight.plan import compact

    monkeypatch.setattr(compact, "_ROWS_BYTES", 3 * nb * np.dtype(dtype).itemsize)  # chunks of three rows
    sizes = np.random.default_rng(n).integers(0, 5000, n).astype(dtype)
    totals, total = compact.block_totals(sizes, nb, 0)
    want = np.bincount(np.arange(n) % nb, weights=sizes.astype(np.float64), minlength=nb).astype(np.int64)
    assert np.array_equal(totals, want) and total == int(sizes.sum(dtype=np.int64))
    if np.dtype(dtype).kind == "i" and n > 1:
        sizes[n - 2] = -1
        with pytest.raises(PlanError, match="negative") as e:
            compact.block_totals(sizes, nb, 3)
        assert e.value.context["sample"] == n - 2 and e.value.context["source"] == 3


@pytest.mark.parametrize("dtype", ["<u2", "<i8"])
@pytest.mark.parametrize("n,block_size,group", [(1, None, 16), (100, 7, 3), (50_000, 256, 16), (70_001, 5, 1000),
                                                 (40_000, 1, 16), (40_013, 3, 7)])
def test_tiled_block_totals_match_numpy(dtype, n, block_size, group, monkeypatch):
    layout = block_layout(n, block_size, group)
    monkeypatch.setattr(compact, "_ROWS_BYTES", 3 * layout[2] * np.dtype(dtype).itemsize)  # chunks of three tiles
    sizes = np.random.default_rng(n).integers(0, 5000, n).astype(dtype)
    totals, total = compact.tiled_block_totals(sizes, layout, 0)
    from compact_reference import blocks

    want = [int(sizes[docs].sum()) for docs in blocks(n, block_size, group)]
    assert totals.tolist() == want and total == int(sizes.sum(dtype=np.int64))
    if np.dtype(dtype).kind == "i" and n > 1:
        sizes[n - 2] = -1
        with pytest.raises(PlanError, match="negative") as e:
            compact.tiled_block_totals(sizes, layout, 3)
        assert e.value.context["sample"] == n - 2


def _present_pages(arr: np.ndarray) -> int:
    """Pages of ``arr``'s mapping present in this process's page table (/proc/self/pagemap, bit 63)."""
    first = arr.ctypes.data // mmap.PAGESIZE
    last = (arr.ctypes.data + arr.nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype="<u8")
    return int((entries >> np.uint64(63)).sum())


class _MemfdArray:
    """An array in a memfd (shmem: small pages), mapped afresh by :meth:`fresh`, so every page a reader touches
    is a fault that maps only its fault-around window (a file on disk may sit in 2 MiB folios, mapped whole)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.dtype, self.nbytes = arr.dtype, arr.nbytes
        self.fd = os.memfd_create("compact-pages")
        os.write(self.fd, np.ascontiguousarray(arr).tobytes())

    def fresh(self) -> np.ndarray:
        return np.frombuffer(mmap.mmap(self.fd, self.nbytes, prot=mmap.PROT_READ), dtype=self.dtype)


def _pages_per_step(plan, sizes: np.ndarray, steps) -> tuple[list[int], list[int]]:
    """Pages of the index and of block_prefix each step maps, each step on fresh mappings."""
    index, prefix = _MemfdArray(sizes), _MemfdArray(np.asarray(plan.arrays["block_prefix"]))
    index_pages, prefix_pages = [], []
    try:
        for step in steps:
            mine = CompactPlan(inputs=plan.inputs, summary=plan.summary, arrays={"block_prefix": prefix.fresh()})
            src = ArraySource(sizes, tokens=True, fingerprint="sha256:pages")
            src.token_counts = index.fresh
            mine.attach([src])
            mapped = mine._args()[-1][0], mine.arrays["block_prefix"]
            before = [_present_pages(a) for a in mapped]
            mine.pieces(*mine.step_items(int(step)))
            index_pages.append(_present_pages(mapped[0]) - before[0])
            prefix_pages.append(_present_pages(mapped[1]) - before[1])
    finally:
        os.close(index.fd), os.close(prefix.fd)
    return index_pages, prefix_pages


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap") or not hasattr(os, "memfd_create"),
                    reason="needs /proc/self/pagemap and memfd")
def test_a_random_step_maps_few_pages_of_the_index_and_block_prefix():
    window = 16  # pages the kernel maps around a fault (fault_around_bytes, 64 KiB by default)
    n = 4 << 20  # an 8 MiB uint16 index
    sizes = np.random.default_rng(4).integers(1, 200, n).astype(np.uint16)
    src = ArraySource(sizes, tokens=True, fingerprint="sha256:pages")
    steps = np.random.default_rng(5).integers(0, 200, 8)
    # blocks of 256 documents: a step of 256 x 512 tokens reads ~1,300 documents, in ~6 blocks. Tiled (64 blocks per
    # tile by default), each block's documents lie in 16,384 index entries (32 KiB); strided over the corpus (format
    # 2's layout, group = nb) they are 32 KiB apart, over the whole index
    pages = {}
    for group in (compact.DEFAULT_BLOCK_GROUP, 1 << 40):
        with mock.patch.object(compact, "DEFAULT_BLOCK_GROUP", group):
            plan = build_plan([(src, 1.0)], seed=2, global_batch_size=256, seq_len=512, num_steps=200, compact=True)
        pages[group] = _pages_per_step(plan, sizes, steps)[0]
    tiled, strided = max(pages[compact.DEFAULT_BLOCK_GROUP]), min(pages[1 << 40])
    assert compact.DEFAULT_BLOCK_GROUP == 64
    assert tiled <= 2 * 8 * window, pages  # at most 8 blocks, each in at most 2 windows
    assert strided >= 5 * tiled, pages
    # one document per block (4M blocks, a 32 MiB block_prefix): the step's ~330 blocks are 2.6 KiB of consecutive
    # prefix sums, found by interpolation (a binary search over 32 MiB would map ~10 windows more)
    plan = build_plan([(src, 1.0)], seed=2, global_batch_size=64, seq_len=512, num_steps=1000, compact=True,
                      block_size=1)
    prefix_pages = _pages_per_step(plan, sizes, steps)[1]
    assert max(prefix_pages) <= 3 * window, prefix_pages


def test_first_decrease():
    assert _compact_kernels.first_decrease(np.array([0, 1, 1, 5], np.int64)) == -1
    assert _compact_kernels.first_decrease(np.array([0, 3, 2, 1], np.int64)) == 2
    assert _compact_kernels.first_decrease(np.zeros(0, np.int64)) == -1
