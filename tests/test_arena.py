"""foresight.io.arena: aligned, pre-touched, shared with numpy/torch without copies, bounded by its pool."""
from __future__ import annotations

import gc
import logging
import threading

import numpy as np
import pytest

from foresight.io.arena import Arena

PAGE = 4096


@pytest.fixture
def arena():
    with Arena(10_000, 3, pin="auto") as a:
        yield a


def test_sizes_alignment_and_description(arena, caplog):
    assert arena.slot_bytes == 12288 and arena.slots == 3 and arena.nbytes == 3 * 12288
    assert all(arena.address(i) % PAGE == 0 for i in range(3))
    assert arena.buffers() == [(arena.address(i), 12288) for i in range(3)]
    assert "3 slots x 0.0 MiB = 0.0 MiB" in arena.describe()
    with caplog.at_level(logging.INFO, logger="foresight.io.arena"):
        Arena(1 << 20, 2, pin=False).close()
    assert "2 slots x 1.0 MiB = 2.0 MiB page-aligned, pre-touched host memory, not pinned" in caplog.text


def test_views_share_memory(arena):
    torch = pytest.importorskip("torch")
    a, b = arena.slot(1), arena.slot(1)
    a[:4] = [1, 2, 3, 4]
    assert b[:4].tolist() == [1, 2, 3, 4] and np.shares_memory(a, b)
    t = arena.tensor(1)
    assert t.dtype == torch.uint8 and t.numel() == arena.slot_bytes and t.data_ptr() == arena.address(1)
    t[4] = 9
    assert a[4] == 9
    assert arena.slot(0).ctypes.data + arena.slot_bytes == arena.slot(1).ctypes.data


def test_slots_are_pretouched_zeroed_memory(arena):
    assert not arena.slot(2).any()


def test_acquire_blocks_until_release(arena):
    held = [arena.acquire(timeout=1) for _ in range(3)]
    assert sorted(held) == [0, 1, 2] and arena.free_slots == 0
    assert arena.try_acquire() is None and arena.try_acquire(timeout=0.01) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(arena.acquire(timeout=60)))
    waiter.start()
    arena.release(held[1])  # whether the waiter is already waiting or not, it gets exactly this slot
    waiter.join(60)
    assert got == [held[1]] and arena.free_slots == 0


def test_acquire_timeout_raises(arena):
    for _ in range(3):
        arena.acquire()
    with pytest.raises(TimeoutError, match="no slot free after 0.05 s"):
        arena.acquire(timeout=0.05)


def test_close_wakes_waiters_with_an_error(arena):
    for _ in range(3):
        arena.acquire()
    errors = []

    def wait():
        try:
            arena.acquire(timeout=60)
        except ValueError as e:
            errors.append(str(e))

    waiter = threading.Thread(target=wait)
    waiter.start()
    arena.close()
    waiter.join(60)
    assert not waiter.is_alive() and errors and "closed" in errors[0]


def test_release_errors(arena):
    with pytest.raises(ValueError, match="not acquired"):
        arena.release(0)
    with pytest.raises(ValueError, match="arena has 3 slots"):
        arena.release(3)


def test_use_after_close_raises_and_views_keep_memory_alive():
    torch = pytest.importorskip("torch")
    arena = Arena(PAGE, 2, pin=False)
    view, tensor = arena.slot(0), arena.tensor(1)
    assert arena.live_views == 2
    arena.close()
    arena.close()  # idempotent
    assert arena.closed and "closed" in arena.describe()
    for use in (lambda: arena.slot(0), lambda: arena.tensor(0), lambda: arena.address(0), arena.acquire):
        with pytest.raises(ValueError, match="close"):
            use()
    view[:] = 1  # memory stays mapped while views exist
    tensor.fill_(2)
    assert int(view.sum()) == PAGE and int(tensor.sum()) == 2 * PAGE
    del view, tensor
    gc.collect()
    assert arena.live_views == 0


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 1), {}, "slot_bytes must be an int >= 1"),
        ((PAGE, 0), {}, "slots must be an int >= 1"),
        ((PAGE, 1.5), {}, "slots must be an int >= 1"),
        ((PAGE, 1), {"pin": "yes"}, r"pin must be one of \('auto', True, False\)"),
        ((PAGE, 1), {"pin": 1}, "pin must be one of"),
    ],
)
def test_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Arena(*args, **kwargs)


def test_pinning_follows_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="pin=True needs a CUDA device"):
            Arena(PAGE, 1, pin=True)
        with Arena(PAGE, 1) as a:
            assert not a.pinned
        return
    with Arena(1 << 20, 2, pin=True) as a:
        t = a.tensor(0)
        assert a.pinned and t.is_pinned()
        t.fill_(5)
        assert int(t.to("cuda", non_blocking=True).sum()) == 5 << 20


def test_hugepages_advice_is_optional():
    with Arena(4 << 20, 1, hugepages=True, pin=False) as a:
        a.slot(0)[:] = 1
        assert int(a.slot(0).sum()) == 4 << 20
