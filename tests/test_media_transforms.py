"""Deterministic transform specs: JSON round-trip, keyed randomness, per-sample hashes across processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from foresight.media import (
    FrameSampling,
    TransformSpec,
    keyed_rng,
    output_hash,
    probe_media,
)
from foresight.testing.media_synth import make_audio, make_image, make_video

VIDEO_SPEC = TransformSpec(modality="video", frames=FrameSampling(4, 1.0), size=(32, 48), crop="random_resized",
                           flip=0.5, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), dtype="float32")


@pytest.fixture(scope="module")
def video():
    data = make_video(codec="libx264", width=96, height=64, seconds=2, gop=15)
    return data, probe_media(data, "video")


def test_json_round_trip_and_checks():
    for spec in (VIDEO_SPEC, TransformSpec(modality="image", size=(8, 8), crop="center"),
                 TransformSpec(modality="audio")):
        again = TransformSpec.from_json(spec.to_json())
        assert again == spec and again.to_json() == spec.to_json()
    with pytest.raises(ValueError, match="crop must be one of"):
        TransformSpec(crop="sideways")
    with pytest.raises(ValueError, match="needs size"):
        TransformSpec(crop="center")
    with pytest.raises(ValueError, match="float dtype"):
        TransformSpec(size=(4, 4), mean=(0.5,), std=(0.5,))


def test_fingerprint_records_versions():
    fp = VIDEO_SPEC.fingerprint()
    json.dumps(fp)
    assert {"av", "ffmpeg", "pillow", "numpy", "torch"} <= set(fp["versions"])
    assert fp["spec"] == VIDEO_SPEC.to_dict() and fp["digest"] == VIDEO_SPEC.fingerprint()["digest"]
    assert TransformSpec(modality="video", size=(32, 32)).fingerprint()["digest"] != fp["digest"]


def test_keyed_rng_is_pure():
    a = keyed_rng(seed=1, epoch=2, sample_id=3, purpose="crop").random(4)
    np.random.seed(123)  # global state must not matter
    assert np.array_equal(a, keyed_rng(seed=1, epoch=2, sample_id=3, purpose="crop").random(4))
    for other in ({"seed": 2, "epoch": 2, "sample_id": 3}, {"seed": 1, "epoch": 3, "sample_id": 3}, {"seed": 1, "epoch": 2, "sample_id": 4}):
        assert not np.array_equal(a, keyed_rng(**other, purpose="crop").random(4))
    assert not np.array_equal(a, keyed_rng(seed=1, epoch=2, sample_id=3, purpose="flip").random(4))


def test_video_transform_deterministic_and_keyed(video):
    data, meta = video
    x = VIDEO_SPEC.apply(data, meta, seed=7, epoch=0, sample_id=1)
    assert x.shape == (4, 3, 32, 48) and x.dtype == torch.float32
    assert output_hash(x) == output_hash(VIDEO_SPEC.apply(data, meta, seed=7, epoch=0, sample_id=1))
    boxes = {VIDEO_SPEC.crop_box(96, 64, seed=7, epoch=0, sample_id=i) for i in range(10)}
    assert len(boxes) == 10  # different keys -> different crops
    hashes = {output_hash(VIDEO_SPEC.apply(data, meta, seed=7, epoch=e, sample_id=1)) for e in range(4)}
    assert len(hashes) == 4
    u8 = TransformSpec(modality="video", frames=FrameSampling(4, 1.0), size=(32, 48), layout="channels_last")
    y = u8.apply(data, meta, seed=7, sample_id=1)
    assert y.dtype == torch.uint8 and y.shape == (4, 32, 48, 3)


def test_normalize_and_flip_values(video):
    data, meta = video
    plain = TransformSpec(modality="video", frames=FrameSampling(2, 1.0), size=(16, 16), layout="channels_last",
                          output="numpy")
    flipped = TransformSpec(modality="video", frames=FrameSampling(2, 1.0), size=(16, 16), flip=1.0,
                            layout="channels_last", output="numpy")
    a = plain.apply(data, meta, seed=1, sample_id=2)
    assert np.array_equal(flipped.apply(data, meta, seed=1, sample_id=2), a[:, :, ::-1])
    norm = TransformSpec(modality="video", frames=FrameSampling(2, 1.0), size=(16, 16), dtype="float32",
                         mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), output="numpy")
    b = norm.apply(data, meta, seed=1, sample_id=2)
    assert np.allclose(b, (a.transpose(0, 3, 1, 2) / 255.0 - 0.5) / 0.25, atol=1e-5)


def test_center_crop_matches_resize_then_slice(video):
    data, meta = video
    spec = TransformSpec(modality="video", frames=FrameSampling(2, 1.0), size=(32, 32), crop="center",
                         layout="channels_last", output="numpy")
    box = spec.crop_box(96, 64, seed=0, epoch=0, sample_id=0)
    assert box == (0.0, 16.0, 64, 64.0)
    assert spec.apply(data, meta).shape == (2, 32, 32, 3)


def test_image_and_audio_specs():
    img = make_image("JPEG", width=400, height=300)
    spec = TransformSpec(modality="image", size=(64, 64), crop="random_resized", flip=0.5, dtype="float16")
    x = spec.apply(img, None, seed=1, sample_id=5)
    assert x.shape == (3, 64, 64) and x.dtype == torch.float16
    assert output_hash(x) == output_hash(spec.apply(img, probe_media(img, "image"), seed=1, sample_id=5))
    aud = make_audio(seconds=2.0, codec="flac", container="flac")
    aspec = TransformSpec.from_dict({"modality": "audio", "audio": {"rate": 8000, "window_s": 0.5, "start": "random"}})
    a = aspec.apply(aud, None, seed=3, sample_id=1)
    assert a.shape == (1, 4000) and a.dtype == torch.float32
    assert output_hash(a) == output_hash(aspec.apply(aud, None, seed=3, sample_id=1))


_CHILD = r"""
import sys
from foresight.media import TransformSpec, output_hash, probe_media
from foresight.testing.media_synth import make_video
data = open(sys.argv[1], "rb").read()
spec = TransformSpec.from_json(sys.argv[2])
meta = probe_media(data, "video")
print(",".join(output_hash(spec.apply(data, meta, seed=11, epoch=1, sample_id=i)) for i in range(3)))
"""


def test_hash_stable_across_processes(video, tmp_path):
    data, meta = video
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    mine = ",".join(output_hash(VIDEO_SPEC.apply(data, meta, seed=11, epoch=1, sample_id=i)) for i in range(3))
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    outs = {subprocess.run([sys.executable, "-c", _CHILD, str(path), VIDEO_SPEC.to_json()], capture_output=True,
                           text=True, check=True, env=env).stdout.strip() for _ in range(2)}
    assert outs == {mine}
