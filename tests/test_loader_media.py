"""Loader + media decode stage: decoded batches equal a direct decode with the same (seed, epoch, sample) key."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from foresight.format import DatasetWriter, open_dataset
from foresight.loader import Loader, MediaDecodeStage
from foresight.media import FrameSampling, TransformSpec, probe_media
from foresight.plan import build_plan


def _jpeg(seed: int) -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _clip(seed: int) -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"g": "10"}
        for t in range(40):
            img = np.full((48, 64, 3), (t * 6 + seed * 40) % 256, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    path = tmp_path_factory.mktemp("media") / "ds"
    payloads = []
    with DatasetWriter(str(path)) as w:
        for i in range(6):
            data, kind = (_jpeg(i), "image") if i % 2 else (_clip(i), "video")
            w.add(data, modality=kind, meta=probe_media(data, kind))
            payloads.append((data, kind))
    return open_dataset(str(path)), payloads


SPECS = {
    "image": TransformSpec(modality="image", size=(32, 32), crop="random_resized", flip=0.5),
    "video": TransformSpec(modality="video", size=(32, 32), frames=FrameSampling(num_frames=3, window_s=0.8)),
}


@pytest.mark.parametrize("backend", ["uring", "pread"])
def test_decoded_batches_equal_direct_decode(media, backend):
    ds, payloads = media
    plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=4, num_steps=4)  # steps straddle epochs
    stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
    try:
        with Loader(ds, plan, decode=stage, backend=backend) as loader:
            for batch in loader:
                ids = batch["sample_ids"].numpy()
                start, _ = plan.rank_items(batch.step, 0, 1)
                for name, spec in SPECS.items():
                    if name not in batch:
                        continue
                    for row, pos in enumerate(batch[f"{name}_index"].tolist()):
                        sid = int(ids[pos])
                        epoch = (start + pos) // ds.num_samples
                        want = spec.apply(payloads[sid][0], ds.meta(sid), seed=9, epoch=epoch, sample_id=sid)
                        assert torch.equal(batch[name][row], want)
            assert set(loader.stats.decode_by_modality_s) == {"image", "video"}
    finally:
        stage.close()


def test_unknown_modality_spec_is_refused(media):
    ds, _ = media
    with pytest.raises(ValueError, match="allowed"):
        MediaDecodeStage([ds], {"hologram": SPECS["image"]}, seed=1)


def test_stage_used_before_a_fork_decodes_in_dataloader_workers(media):
    # A stage used once in the parent, then handed to forked DataLoader workers: their pools must be their own.
    from foresight.loader.torch_dataset import ForesightIterableDataset

    ds, _ = media
    plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=2, num_steps=6)
    stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
    try:
        with Loader(ds, plan, decode=stage) as loader:
            reference = [batch.clone() for batch in loader]
        adapter = ForesightIterableDataset([ds], plan, rank=0, world_size=1, decode=stage)
        workers = torch.utils.data.DataLoader(adapter, batch_size=None, num_workers=2,
                                              multiprocessing_context="fork", timeout=120)
        got = list(workers)
    finally:
        stage.close()
    assert [b["step"] for b in got] == [b.step for b in reference]
    for mine, want in zip(got, reference):
        for name in SPECS:
            if name in want:
                assert torch.equal(mine[name], want[name]) and torch.equal(mine[f"{name}_index"], want[f"{name}_index"])
