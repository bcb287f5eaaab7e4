"""The CUDA handoff: pinned arena, non-blocking copies, slots recycled only after their copy (skipped without CUDA).

Run on a GPU machine by ``bash bench/gpu_device.sh`` (with ``bench/gpu_handoff.py``'s measurements).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from foresight.format import DatasetWriter, open_dataset
from foresight.io import Arena
from foresight.loader import Loader
from foresight.plan import build_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tokens(path, *, dtype, seed, high):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=400)
    data = rng.integers(0, high, size=int(lengths.sum()), dtype=np.int64).astype(dtype)
    with DatasetWriter(str(path), token_dtype=np.dtype(dtype).name, fsync=False) as w:
        w.add_many(data, lengths, modality="tokens")
    return open_dataset(str(path))


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    small = _tokens(root / "u16", dtype=np.uint16, seed=0, high=65_536)
    large = _tokens(root / "u32", dtype=np.uint32, seed=1, high=4_000_000_000)  # ids above 2**31 too
    plan = build_plan([(small, 0.5), (large, 0.5)], seed=5, global_batch_size=8, seq_len=64, num_steps=24)
    return [small, large], plan


def _cpu_batches(datasets, plan):
    with Loader(datasets, plan, device="cpu") as loader:
        return {b.step: {k: b[k].clone() for k in ("input_ids", "labels", "position_ids", "cu_seqlens")}
                for b in loader}


@pytest.mark.parametrize("backend", ["uring", "pread"])
def test_cuda_batches_equal_cpu_batches(mixture, backend):
    datasets, plan = mixture
    want = _cpu_batches(datasets, plan)
    with Loader(datasets, plan, device="cuda", backend=backend) as loader:
        seen = 0
        for batch in loader:
            assert batch["input_ids"].is_cuda and batch["input_ids"].dtype == torch.int64
            for key, value in want[batch.step].items():
                assert torch.equal(batch[key].cpu(), value), (batch.step, key)
            seen += 1
    assert seen == plan.num_steps
    assert max(int(v["input_ids"].max()) for v in want.values()) > 2**31  # the uint32 ids survived the trip


def test_slots_are_reused_only_after_their_copy(mixture):
    # prefetch=1: three slots for 24 steps, every slot reused many times while the GPU tensors of earlier
    # steps are still alive; a slot recycled before its copy finished would show as wrong rows later.
    datasets, plan = mixture
    want = _cpu_batches(datasets, plan)
    kept = []
    with Loader(datasets, plan, device="cuda", prefetch=1) as loader:
        for batch in loader:
            kept.append((batch.step, batch["input_ids"], batch["labels"]))
            torch.cuda._sleep(1_000_000)  # keep the stream busy so copies lag behind the host
    torch.cuda.synchronize()
    for step, ids, labels in kept:
        assert torch.equal(ids.cpu(), want[step]["input_ids"]), step
        assert torch.equal(labels.cpu(), want[step]["labels"]), step


def test_cpu_batches_view_the_pinned_arena(mixture):
    datasets, plan = mixture
    with Loader(datasets, plan, device="cpu", end_step=2) as loader:
        batch = next(iter(loader))
        tokens = batch["tokens"]
        arena = loader._arena
        assert arena.pinned and tokens.is_pinned()
        ptr, end = tokens.data_ptr(), tokens.data_ptr() + tokens.numel() * tokens.element_size()
        assert any(arena.address(i) <= ptr and end <= arena.address(i) + arena.slot_bytes
                   for i in range(arena.slots))


def test_arena_slot_copies_to_the_gpu_and_back():
    with Arena(1 << 20, 2, pin=True) as arena:
        slot = arena.acquire()
        host = arena.tensor(slot)
        host.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
        device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), host)
        arena.release(slot)
