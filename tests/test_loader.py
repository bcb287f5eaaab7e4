"""The plan-following loader over real shards, real plans and both I/O backends."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from foresight.errors import ChecksumError, IOEngineError, PlanError
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import Loader
from foresight.plan import build_plan
from foresight.source import coalesce_extents
from foresight.source.reads import ALIGN, CACHED_ALIGN

BACKENDS = ["uring", "pread"]


def _token_dataset(path, *, docs=300, seed=0, dtype=np.uint16, align=4096):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, size=docs)
    tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(dtype)
    with DatasetWriter(str(path), align=align, token_dtype=np.dtype(dtype).name) as w:
        w.add_many(tokens, lengths, modality="tokens")
    return open_dataset(str(path)), tokens, lengths


def _bytes_dataset(path, *, n=200, seed=1):
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, size=int(rng.integers(1, 9000)), dtype=np.uint8).tobytes() for _ in range(n)]
    with DatasetWriter(str(path), align=4096) as w:
        for p in payloads:
            w.add(p, modality="bytes")
    return open_dataset(str(path)), payloads


def _expected_rows(ds_list, plan, start, stop):
    """Reference collate: read every piece with plain Python reads."""
    pieces = plan.pieces(start, stop)
    rows = []
    for i in range(stop - start):
        parts = []
        for p in range(pieces.item_ptr[i], pieces.item_ptr[i + 1]):
            ds = ds_list[int(pieces.dataset[p])]
            toks = np.frombuffer(ds.read(int(pieces.sample[p])), dtype=ds.token_dtype)
            parts.append(toks[pieces.offset[p] : pieces.offset[p] + pieces.length[p]])
        rows.append(np.concatenate(parts))
    return np.stack(rows)


@pytest.fixture(scope="module")
def token_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    ds, _, _ = _token_dataset(root / "a")
    plan = build_plan([(ds, 1.0)], seed=7, global_batch_size=8, seq_len=32, num_steps=12)
    return ds, plan


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_gap", [-1, 0, 1 << 16])
def test_token_batches_match_reference(token_setup, backend, max_gap):
    ds, plan = token_setup
    with Loader(ds, plan, backend=backend, max_gap=max_gap, prefetch=3) as loader:
        assert loader.stats.backend == backend
        steps = 0
        for batch in loader:
            start, stop = plan.rank_items(batch.step, 0, 1)
            want = _expected_rows([ds], plan, start, stop)
            assert np.array_equal(batch["tokens"].numpy().astype(np.int64), want.astype(np.int64))
            assert torch.equal(batch["input_ids"], torch.from_numpy(want[:, :-1].astype(np.int64)))
            assert torch.equal(batch["labels"], torch.from_numpy(want[:, 1:].astype(np.int64)))
            cu = batch["cu_seqlens"].numpy()
            assert cu[0] == 0 and cu[-1] == want.shape[0] * plan.seq_len and np.all(np.diff(cu) > 0)
            assert batch["position_ids"].shape == (want.shape[0], plan.seq_len)
            steps += 1
        assert steps == plan.num_steps
        s = loader.stats.as_dict()
        assert s["steps"] == plan.num_steps and s["bytes_read"] >= s["bytes_requested"] > 0
        assert s["ios"] <= s["extents"] or max_gap < 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_byte_samples_are_views_of_the_read(tmp_path, backend):
    ds, payloads = _bytes_dataset(tmp_path / "b")
    plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=10, num_steps=15)
    with Loader(ds, plan, backend=backend, verify=True) as loader:
        for batch in loader:
            data = batch["data"].numpy()
            ids = batch["sample_ids"].numpy()
            for off, n, sid in zip(batch["offsets"].numpy(), batch["lengths"].numpy(), ids):
                assert data[off : off + n].tobytes() == payloads[sid]


def test_exact_resume_at_another_world_size(token_setup):
    ds, plan = token_setup
    with Loader(ds, plan) as full:
        reference = {b.step: b["tokens"].clone() for b in full}
    with Loader(ds, plan, rank=0, world_size=1) as first:
        it = iter(first)
        for _ in range(5):
            next(it)
        state = first.state_dict()
    assert state["next_step"] == 5
    # Resume the remaining steps on 2 ranks: their shares concatenate to the single-rank batches.
    shares = {}
    for rank in range(2):
        with Loader(ds, plan, rank=rank, world_size=2) as loader:
            loader.load_state_dict(state)
            for b in loader:
                shares.setdefault(b.step, {})[rank] = b["tokens"].clone()
    assert sorted(shares) == list(range(5, plan.num_steps))
    for step, parts in shares.items():
        assert torch.equal(torch.cat([parts[0], parts[1]]), reference[step])


def test_state_from_another_plan_is_refused(token_setup, tmp_path):
    ds, plan = token_setup
    with Loader(ds, plan) as loader:
        with pytest.raises(PlanError, match="another plan"):
            loader.load_state_dict({"plan_digest": "x", "next_step": 1})


def test_truncated_shard_names_the_file(tmp_path):
    ds, _ = _bytes_dataset(tmp_path / "t", n=50)
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=50, num_steps=1)
    shard = ds.shard_paths[0]
    os.truncate(shard, os.path.getsize(shard) // 2)
    with Loader(ds, plan) as loader:
        with pytest.raises(IOEngineError) as info:
            list(loader)
    assert "shard-00000.bin" in str(info.value)


def test_corrupt_byte_is_caught_with_verify(tmp_path):
    ds, payloads = _bytes_dataset(tmp_path / "c", n=30)
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=30, num_steps=1)
    ext = ds.lookup(np.array([4]))
    with open(ds.shard_paths[0], "r+b") as f:
        f.seek(int(ext.offset[0]))
        b = f.read(1)
        f.seek(int(ext.offset[0]))
        f.write(bytes([b[0] ^ 0xFF]))
    with Loader(ds, plan, verify=True) as loader:
        with pytest.raises(ChecksumError, match="sample=4"):
            list(loader)


def test_clean_shutdown_mid_iteration(token_setup):
    ds, plan = token_setup
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = set(threading.enumerate())  # by identity: an earlier test's thread may still be exiting
    loader = Loader(ds, plan, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    loader.close()
    assert set(threading.enumerate()) - threads_before == set()
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_error_in_consumer_leaves_nothing_behind(token_setup):
    ds, plan = token_setup
    threads_before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="boom"):
        with Loader(ds, plan) as loader:
            for i, _ in enumerate(loader):
                if i == 1:
                    raise RuntimeError("boom")
    assert set(threading.enumerate()) - threads_before == set()


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory figure (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` (page-aligned) in RAM, by mincore(2)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    pages = -(-nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * page


def _file_cached_bytes(path: str) -> int:
    """Bytes of a file in the page cache (mapping a file faults nothing in; mincore reads residency)."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        try:
            return _resident_bytes(view.ctypes.data, len(view))
        finally:
            del view


def test_memory_is_bounded_and_stated(tmp_path):
    # 48 MiB pass through the loader in 2 MiB steps; its memory is (prefetch + 2) slots of one step, in RAM from
    # the start (pre-touched), and nothing per step grows the process beyond that.
    size, n, batch, steps, prefetch = 128 << 10, 64, 16, 24, 2
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, size=size * n, dtype=np.uint8)
    with DatasetWriter(str(tmp_path / "ds"), align=4096) as w:
        w.add_many(data, np.full(n, size, np.int64), modality="bytes")
    ds = open_dataset(str(tmp_path / "ds"))
    plan = build_plan([(ds, 1.0)], seed=4, global_batch_size=batch, num_steps=steps)

    def check_all(loader: Loader) -> None:
        for batch_ in loader:
            got = batch_["data"].numpy()
            for off, sid in zip(batch_["offsets"].numpy(), batch_["sample_ids"].numpy()):
                assert np.array_equal(got[off : off + size], data[sid * size : (sid + 1) * size])
        assert loader.stats.as_dict()["steps"] == steps and loader.stats.as_dict()["slot_overflows"] == 0

    # first-use costs (imports, code paths) paid before measuring, in steps of one sample, so the allocator does
    # not keep step-sized blocks around that a per-step allocation could reuse unseen
    small = build_plan([(ds, 1.0)], seed=4, global_batch_size=1, num_steps=steps)
    with Loader(ds, small, prefetch=prefetch) as warm:
        check_all(warm)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS, so the peak below is this loader's
    rss_before = _status_bytes("VmRSS")
    with Loader(ds, plan, prefetch=prefetch) as loader:
        arena = loader._arena
        step_bytes = batch * size
        assert arena.slots == prefetch + 2
        assert step_bytes <= arena.slot_bytes < step_bytes * 5 // 4, "a slot holds one step, not more"
        assert arena.nbytes == arena.slots * arena.slot_bytes
        assert f"{arena.nbytes / 2**20:.1f} MiB" in arena.describe()  # stated up front, as held
        assert _resident_bytes(arena.address(0), arena.nbytes) == arena.nbytes  # pre-touched, really there
        check_all(loader)
        growth = _status_bytes("VmHWM") - rss_before
    assert growth <= arena.nbytes + arena.slot_bytes // 2, (
        f"peak RSS grew {growth / 2**20:.1f} MiB for a {arena.nbytes / 2**20:.1f} MiB arena")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["tokens", "bytes"])
def test_direct_reads_are_exact_and_skip_the_page_cache(tmp_path, backend, kind):
    # Loader(direct=True), the path behind every cold figure: each shard fd has O_DIRECT, the batches are the
    # exact bytes, and the shards stay out of the page cache (a buffered read would bring them in).
    if kind == "tokens":
        ds, _, _ = _token_dataset(tmp_path / "d")
        plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=8, seq_len=32, num_steps=10)
    else:
        ds, payloads = _bytes_dataset(tmp_path / "d")
        plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=8, num_steps=10)
    for path in ds.shard_paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and fsynced: clean, so dropped
        finally:
            os.close(fd)
        assert _file_cached_bytes(path) == 0, "could not evict the shard from the page cache"
    got = []
    with Loader(ds, plan, backend=backend, direct=True) as loader:
        shard_fds = [int(fd) for fd in os.listdir("/proc/self/fd")
                     if os.path.realpath(f"/proc/self/fd/{fd}") in {os.path.realpath(p) for p in ds.shard_paths}]
        assert len(shard_fds) == len(ds.shard_paths)
        for fd in shard_fds:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            assert flags & os.O_DIRECT, f"shard fd {fd} is open without O_DIRECT (flags {flags:o})"
        for batch in loader:
            got.append(batch.clone())
    assert len(got) == plan.num_steps
    assert sum(_file_cached_bytes(p) for p in ds.shard_paths) == 0, "O_DIRECT reads went through the page cache"
    for batch in got:
        if kind == "tokens":
            start, stop = plan.rank_items(batch.step, 0, 1)
            want = _expected_rows([ds], plan, start, stop)
            assert np.array_equal(batch["tokens"].numpy(), want)
        else:
            data = batch["data"].numpy()
            for off, length, sid in zip(batch["offsets"].numpy(), batch["lengths"].numpy(),
                                        batch["sample_ids"].numpy()):
                assert data[off : off + length].tobytes() == payloads[sid]


def test_mismatched_dataset_is_refused(token_setup, tmp_path):
    _, plan = token_setup
    other, _, _ = _token_dataset(tmp_path / "other", seed=99)
    with pytest.raises(PlanError, match="does not match"):
        Loader(other, plan)


def test_iterable_dataset_adapter_with_workers(token_setup):
    from foresight.loader.torch_dataset import ForesightIterableDataset

    ds, plan = token_setup
    with Loader(ds, plan) as loader:
        reference = [b["tokens"].clone() for b in loader]
    adapter = ForesightIterableDataset([ds], plan, rank=0, world_size=1)
    got = [b["tokens"] for b in torch.utils.data.DataLoader(adapter, batch_size=None, num_workers=2)]
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixture_of_uint16_and_uint32_datasets(tmp_path, backend):
    narrow, _, _ = _token_dataset(tmp_path / "narrow", docs=150, seed=3, dtype=np.uint16)
    wide, _, _ = _token_dataset(tmp_path / "wide", docs=150, seed=4, dtype=np.uint32)
    plan = build_plan([(narrow, 0.5), (wide, 0.5)], seed=2, global_batch_size=6, seq_len=40, num_steps=8)
    with Loader([narrow, wide], plan, backend=backend) as loader:
        for batch in loader:
            start, stop = plan.rank_items(batch.step, 0, 1)
            want = _expected_rows([narrow, wide], plan, start, stop).astype(np.int64)
            assert batch["tokens"].numpy().dtype == np.uint32
            assert torch.equal(batch["input_ids"], torch.from_numpy(want[:, :-1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_samples_get_a_larger_transfer_limit(tmp_path, backend):
    # 512 KiB samples in block-local steps of 32: the default transfer limit grows to hold 16 of them, so a
    # step is two reads (8 MiB each) where a fixed 4 MiB limit would make it four; the bytes are the same.
    from foresight.io.coalesce import DEFAULT_MAX_TRANSFER, EXTENTS_PER_TRANSFER

    size, n = 512 << 10, 64
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=size * n, dtype=np.uint8)
    with DatasetWriter(str(tmp_path / "big"), align=4096) as w:
        w.add_many(data, np.full(n, size, np.int64), modality="bytes")
    ds = open_dataset(str(tmp_path / "big"))
    plan = build_plan([(ds, 1.0)], seed=2, global_batch_size=32, num_steps=2, shuffle="block", block_size=32)
    ios = {}
    for max_transfer in (None, DEFAULT_MAX_TRANSFER):
        with Loader(ds, plan, backend=backend, max_transfer=max_transfer) as loader:
            for batch in loader:
                got = batch["data"].numpy()
                for off, length, sid in zip(batch["offsets"].numpy(), batch["lengths"].numpy(),
                                            batch["sample_ids"].numpy()):
                    assert length == size
                    assert np.array_equal(got[off : off + length], data[sid * size : (sid + 1) * size])
            ios[max_transfer] = loader.stats.as_dict()["ios"]
            if max_transfer is None:
                assert loader.max_transfer == EXTENTS_PER_TRANSFER * size
    assert ios[None] == 2 * plan.num_steps
    assert ios[DEFAULT_MAX_TRANSFER] == 4 * plan.num_steps


def test_steps_served_by_the_page_cache_read_no_holes(tmp_path):
    """Warm data on io_uring: once every read completed since the last step came from the page cache, steps are
    coalesced without holes (a hole there is a copy, not a saved device read); the bytes are the same. The pread
    backend (no page-cache pass) keeps max_gap and reads the holes."""
    size, n = 16 << 10, 256
    data = np.random.default_rng(5).integers(0, 256, size * n, dtype=np.uint8)
    with DatasetWriter(str(tmp_path / "warm"), align=4096) as w:  # just written: in the page cache
        w.add_many(data, np.full(n, size, np.int64), modality="bytes")
    ds = open_dataset(str(tmp_path / "warm"))
    plan = build_plan([(ds, 1.0)], seed=4, global_batch_size=32, num_steps=8)  # 1 in 8 samples a step: holes
    stats = {}
    for backend in ("uring", "pread"):
        with Loader(plan, datasets=ds, backend=backend) as loader:
            for batch in loader:
                got = batch["data"].numpy()
                for off, sid in zip(batch["offsets"].numpy(), batch["sample_ids"].numpy()):
                    assert np.array_equal(got[off:off + size], data[sid * size:(sid + 1) * size])
            stats[backend] = loader.stats.as_dict()
    if stats["uring"]["backend"] != "uring":
        pytest.skip("io_uring unavailable here")
    assert stats["pread"]["page_cache_steps"] == 0 and stats["pread"]["amplification"] > 1
    assert stats["uring"]["page_cache_steps"] >= 1  # the first steps are coalesced before any read completed
    assert stats["uring"]["bytes_read"] < stats["pread"]["bytes_read"]
    assert stats["uring"]["bytes_requested"] == stats["pread"]["bytes_requested"] == 8 * 32 * size


def _step_read_bytes(ds, plan, step, *, max_gap, max_transfer, align):
    """Bytes the transfers of one token step read, coalesced with these options (the reference for the loader's
    own count)."""
    start, stop = plan.rank_items(step, 0, 1)
    pieces = plan.pieces(start, stop)
    found = ds.lookup(np.asarray(pieces.sample))
    itemsize = ds.token_dtype.itemsize
    offset = np.asarray(found.offset) + np.asarray(pieces.offset) * itemsize
    length = np.asarray(pieces.length) * itemsize
    return coalesce_extents(np.asarray(found.shard), offset, length, max_gap=max_gap, max_transfer=max_transfer,
                            align=align).read_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_cache_steps_copy_no_alignment_pads(tmp_path, backend):
    """Token pieces at odd offsets of an unaligned dataset, warm: once the page cache serves every read (io_uring's
    page-cache pass), a step's transfers are aligned to CACHED_ALIGN (8 bytes), not O_DIRECT's 4 KiB, and hold no
    holes: the loader reads exactly the bytes those transfers cover (counted step by step here), far fewer than 4 KiB
    alignment would copy. Every row is the reference's, and with verify every sample read whole matches its
    recorded xxh3. The pread backend (no pass) keeps 4 KiB alignment for every step."""
    ds, _, _ = _token_dataset(tmp_path / "packed", docs=2000, seed=3, align=0)  # just written: in the page cache
    plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=8, seq_len=256, num_steps=24)
    with Loader(plan, datasets=ds, backend=backend, prefetch=1, max_gap=0) as loader:  # the pads alone differ
        for batch in loader:
            start, stop = plan.rank_items(batch.step, 0, 1)
            assert np.array_equal(batch["tokens"].numpy(), _expected_rows([ds], plan, start, stop))
        stats, max_transfer = loader.stats.as_dict(), loader.max_transfer
    with Loader(plan, datasets=ds, backend=backend, verify=True) as loader:  # whole samples, each hashed
        assert sum(1 for _ in loader) == plan.num_steps
    cold = plan.num_steps - stats["page_cache_steps"]  # the first steps, coalesced before a read completed
    if backend == "uring" and stats["backend"] == "uring":
        assert 1 <= cold <= 3
    else:
        assert cold == plan.num_steps
    steps = range(plan.num_steps)
    as_cold = [_step_read_bytes(ds, plan, s, max_gap=0, max_transfer=max_transfer, align=ALIGN) for s in steps]
    cached = [_step_read_bytes(ds, plan, s, max_gap=0, max_transfer=max_transfer, align=CACHED_ALIGN) for s in steps]
    assert stats["bytes_read"] == sum(as_cold[:cold]) + sum(cached[cold:])
    assert sum(cached) < 0.8 * sum(as_cold)  # this data is where the pads cost: the mechanism is exercised
