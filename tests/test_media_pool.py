"""DecodePool: same tensors as serial decode, input order kept, errors name the sample, stats."""
from __future__ import annotations

import numpy as np
import pytest
from foresight.errors import DecodeError
from foresight.media import (
    DecodePool,
    FrameSampling,
    TransformSpec,
    estimate_cost,
    output_hash,
    probe_media,
)
from foresight.testing.media_synth import make_video


@pytest.fixture(scope="module")
def batch():
    datas = [make_video(codec="libx264", width=96, height=64, seconds=2, gop=g) for g in (5, 60, 12, 30)]
    return datas, [probe_media(d, "video") for d in datas]


SPEC = TransformSpec(modality="video", frames=FrameSampling(4, 1.0), size=(24, 32), crop="random", flip=0.5)


def test_pool_matches_serial_and_keeps_order(batch):
    datas, metas = batch
    ids = [10, 11, 12, 13]
    serial = [output_hash(SPEC.apply(d, m, seed=5, epoch=2, sample_id=i)) for d, m, i in zip(datas, metas, ids)]
    for threads in (1, 2, 3):
        with DecodePool(threads=threads) as pool:
            out = pool.decode(SPEC, datas, metas, ids, seed=5, epoch=2)
            assert [output_hash(x) for x in out] == serial
            stats = pool.stats()
            assert stats["video"]["samples"] == 4 and stats["video"]["errors"] == 0


def test_pool_errors_name_sample(batch):
    datas, metas = batch
    bad = [datas[0], datas[1][:500]]
    with DecodePool(threads=2) as pool:
        with pytest.raises(DecodeError, match="sample=8"):
            pool.decode(SPEC, bad, metas[:2], [7, 8], seed=0, epoch=0)
        res = pool.decode(SPEC, bad, metas[:2], [7, 8], seed=0, epoch=0, return_exceptions=True)
        assert res[0].shape == (4, 3, 24, 32) and isinstance(res[1], DecodeError)
        assert pool.stats()["video"]["errors"] == 2
    with pytest.raises(ValueError, match="threads"):
        DecodePool(threads=0)


def test_cost_orders_long_gop_first(batch):
    _, metas = batch
    costs = [estimate_cost(SPEC, m, seed=5, epoch=0, sample_id=3) for m in metas]
    assert costs[1] >= costs[0]  # GOP 60 decodes at least as much as GOP 5 for the same window
    assert estimate_cost(SPEC, None, seed=0, epoch=0, sample_id=0, nbytes=10) > 0


def test_submit_overlaps_and_stacks(batch):
    datas, metas = batch
    with DecodePool(threads=2) as pool:
        handle = pool.submit(SPEC, datas, metas, [1, 2, 3, 4], seed=0, epoch=0)
        x = handle.stacked()
        assert handle.done() and tuple(x.shape) == (4, 4, 3, 24, 32)
        assert pool.stats(reset=True)["video"]["samples"] == 4 and pool.stats() == {}


def test_views_into_buffers_and_quiet_logging(batch):
    """The loader hands out numpy/memoryview slices of its arena; FFmpeg logs never reach Python."""
    import av.logging

    datas, metas = batch
    arena = np.zeros(len(datas[0]) + 4096, dtype=np.uint8)
    arena[100:100 + len(datas[0])] = np.frombuffer(datas[0], dtype=np.uint8)
    view = arena[100:100 + len(datas[0])]
    ref = SPEC.apply(datas[0], metas[0], seed=1, sample_id=0)
    assert output_hash(SPEC.apply(view, metas[0], seed=1, sample_id=0)) == output_hash(ref)
    assert output_hash(SPEC.apply(memoryview(view), metas[0], seed=1, sample_id=0)) == output_hash(ref)
    av.logging.set_level(av.logging.ERROR)  # installs PyAV's Python log callback
    try:
        with DecodePool(threads=2) as pool:
            assert av.logging.get_level() is None  # the pool removed it before any decode
            pool.decode(SPEC, datas, metas, [0, 1, 2, 3], seed=0, epoch=0)
    finally:
        av.logging.set_level(None)


def _decode_in_forked_child(pool, datas, metas) -> list[str]:
    """Decode with ``pool`` in a forked child; its output hashes come back through a pipe (None if it hung)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            out = pool.decode(SPEC, datas, metas, [1, 2, 3, 4], seed=5, epoch=0)
            child_end.send([output_hash(x) for x in out])
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            child_end.send(repr(e))

    proc = ctx.Process(target=child)
    proc.start()
    got = parent_end.recv() if parent_end.poll(120) else None
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return got


def test_pool_used_before_a_fork_decodes_in_the_child(batch):
    datas, metas = batch
    serial = [output_hash(SPEC.apply(d, m, seed=5, epoch=0, sample_id=i))
              for d, m, i in zip(datas, metas, [1, 2, 3, 4])]
    with DecodePool(threads=2) as pool:
        assert [output_hash(x) for x in pool.decode(SPEC, datas, metas, [1, 2, 3, 4], seed=5, epoch=0)] == serial
        assert _decode_in_forked_child(pool, datas, metas) == serial  # the parent's threads are not in the child
        assert [output_hash(x) for x in pool.decode(SPEC, datas, metas, [1, 2, 3, 4], seed=5, epoch=0)] == serial


def test_wait_for_a_stuck_pool_raises_naming_the_sample(batch):
    import threading

    from foresight.errors import DecodeTimeoutError

    datas, metas = batch
    gate = threading.Event()
    with DecodePool(threads=1, timeout_s=0.2) as pool:
        blocker = pool._pool.submit(gate.wait)  # the only worker is busy until the gate opens
        handle = pool.submit(SPEC, datas[:2], metas[:2], [21, 22], seed=0, epoch=0)
        with pytest.raises(DecodeTimeoutError, match=r"sample=2[12]"):
            handle.result()
        with pytest.raises(DecodeTimeoutError):
            handle.result(timeout=0.05)
        gate.set()
        blocker.result()
        assert len(handle.result(timeout=None)) == 2  # no limit: the work finishes once the worker is free


def test_pool_pickles_without_its_threads(batch):
    import pickle

    datas, metas = batch
    with DecodePool(threads=2, codec_threads=1, timeout_s=30) as pool:
        pool.decode(SPEC, datas[:1], metas[:1], [0], seed=0, epoch=0)
        copy = pickle.loads(pickle.dumps(pool))
    with copy:
        assert (copy.threads, copy.codec_threads, copy.timeout_s) == (2, 1, 30)
        assert len(copy.decode(SPEC, datas[:1], metas[:1], [0], seed=0, epoch=0)) == 1


def test_batch_submitted_before_a_fork_raises_in_the_child(batch):
    import multiprocessing as mp
    import threading

    datas, metas = batch
    gate = threading.Event()
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    with DecodePool(threads=1) as pool:
        blocker = pool._pool.submit(gate.wait)
        handle = pool.submit(SPEC, datas[:1], metas[:1], [31], seed=0, epoch=0)  # pending when the fork comes

        def child() -> None:
            try:
                handle.result()
                child_end.send("no error")
            except BaseException as e:  # noqa: BLE001 (reported to the parent)
                child_end.send(f"{type(e).__name__}: {e}")

        proc = ctx.Process(target=child)
        proc.start()
        got = parent_end.recv() if parent_end.poll(120) else "hung"
        proc.join(10)
        gate.set()
        blocker.result()
        assert len(handle.result()) == 1  # in the parent the batch completes as ever
    assert got.startswith("DecodeTimeoutError: decode batch was submitted in another process") and "sample=31" in got
