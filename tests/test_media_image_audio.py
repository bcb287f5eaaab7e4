"""Images (JPEG draft, PNG, WebP) and audio (float32 PCM at a target rate over a window)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from foresight.errors import DecodeError
from foresight.media import decode_audio, decode_image, probe_media
from foresight.testing.media_synth import make_audio, make_image
from PIL import Image


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("WEBP", {"lossless": True}), ("JPEG", {"quality": 95})])
def test_full_decode_matches_pillow(fmt, kw):
    data = make_image(fmt, width=200, height=120, **kw)
    meta = probe_media(data, "image")
    assert (meta["width"], meta["height"], meta["format"]) == (200, 120, fmt)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(decode_image(data), ref)
    crop = decode_image(data, crop=(10, 20, 50, 60))
    assert np.array_equal(crop, ref[10:60, 20:80])


def test_jpeg_draft_decodes_at_reduced_scale_and_stays_close():
    data = make_image("JPEG", width=1600, height=1200, quality=95)
    fast = decode_image(data, size=(150, 200))
    slow = decode_image(data, size=(150, 200), draft=False)
    assert fast.shape == slow.shape == (150, 200, 3)
    assert np.abs(fast.astype(int) - slow.astype(int)).mean() < 3.0
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (200, 150))
    assert img.size == (200, 150)  # libjpeg really decoded at 1/8 scale
    # a small crop needs more resolution: the draft keeps the crop >= output size
    crop = decode_image(data, size=(100, 100), crop=(0, 0, 400, 400))
    ref = decode_image(data, size=(100, 100), crop=(0, 0, 400, 400), draft=False)
    assert np.abs(crop.astype(int) - ref.astype(int)).mean() < 3.0


def test_bad_image_raises_decode_error():
    data = make_image("PNG", width=64, height=64)
    with pytest.raises(DecodeError, match="sample=9"):
        decode_image(data[: len(data) // 2], sample=9)
    with pytest.raises(DecodeError, match="sample=9"):
        probe_media(b"nope", "image", sample=9)


@pytest.mark.parametrize("codec,container", [("aac", "mp4"), ("flac", "flac"), ("pcm_s16le", "wav")])
def test_audio_window_rate_and_tone(codec, container):
    data = make_audio(seconds=2.0, rate=48000, freq=440.0, codec=codec, container=container)
    meta = probe_media(data, "audio")
    assert meta["sample_rate"] == 48000 and meta["num_samples"] == 96000  # 2 s of media, counted in samples
    assert meta["duration_s"] == meta["num_samples"] / meta["sample_rate"]
    pcm = decode_audio(data, start_s=0.5, duration_s=1.0, rate=16000)
    assert pcm.dtype == np.float32 and pcm.shape == (1, 16000)
    spectrum = np.abs(np.fft.rfft(pcm[0]))
    assert abs(np.argmax(spectrum) - 440) <= 2  # 1 s window: bin = Hz
    assert 0.3 < np.sqrt(np.mean(pcm**2)) < 0.4  # a 0.5-amplitude sine has rms 0.354
    # the window is located by time: it equals the same stretch of a full decode
    full = decode_audio(data, rate=16000)
    assert np.abs(full[0, 8000:24000] - pcm[0]).max() < 0.02


def test_audio_past_end_pads_and_stereo():
    data = make_audio(seconds=1.0, rate=44100, codec="flac", container="flac", channels=2)
    pcm = decode_audio(data, start_s=0.8, duration_s=0.5, rate=8000, mono=False)
    assert pcm.shape == (2, 4000)
    assert np.all(pcm[:, 2000:] == 0) and np.abs(pcm[:, :1500]).max() > 0.3


def test_bad_audio_raises_decode_error():
    with pytest.raises(DecodeError, match="sample=4"):
        decode_audio(b"\x00" * 300, sample=4)
