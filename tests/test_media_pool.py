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
from foresight.media.synth import make_video


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
