"""Frame-selective video decode equals a full reference decode, frame by frame, pixel for pixel.

The reference (``foresight.testing.media_reference``) decodes every frame from the start with PyAV's own API and
converts it there, so the pixels at every size, crop and interpolation are checked against code decode_video does not run."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from foresight.errors import DecodeError, ForesightError
from foresight.media import (
    FrameSampling,
    decode_cost,
    decode_video,
    plan_segments,
    probe_media,
    sample_frame_indices,
    video_pts,
)
from foresight.testing.media_reference import decode_all
from foresight.testing.media_synth import make_video, remux
from foresight.media.video import NONREF_SKIP_CODECS, DecodeReport
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CLIPS = {
    "h264_short_gop": {"codec": "libx264", "gop": 10, "seconds": 3},
    "h264_long_gop": {"codec": "libx264", "gop": 300, "seconds": 3},
    "h264_no_bframes": {"codec": "libx264", "gop": 30, "seconds": 2, "options": {"x264-params": "bframes=0"}},
    "h264_bpyramid_strict": {"codec": "libx264", "gop": 45, "seconds": 3,
                                 "options": {"x264-params": "bframes=5:b-pyramid=strict:b-adapt=2"}},
    "h264_open_gop": {"codec": "libx264", "gop": 30, "seconds": 3, "options": {"x264-params": "open-gop=1:bframes=3"}},
    "hevc": {"codec": "libx265", "gop": 30, "seconds": 2, "options": {"x265-params": "log-level=none:bframes=3"}},
    "vp9": {"codec": "libvpx-vp9", "gop": 30, "seconds": 2},
    "mpeg4_bframes": {"codec": "mpeg4", "gop": 15, "bframes": 2, "seconds": 2},
    "av1": {"codec": "libsvtav1", "gop": 24, "seconds": 2, "width": 128, "height": 96},
}


@pytest.fixture(scope="module")
def clips():
    out = {}
    for name, kw in CLIPS.items():
        kw = {"width": 96, "height": 64, **kw}
        out[name] = make_video(**kw)
    base = out["h264_short_gop"]
    out["h264_mkv_pts_eq_dts"] = remux(base, container="matroska", pts_from_dts=True)
    out["h264_mpegts"] = remux(base, container="mpegts")
    return out


@pytest.fixture(scope="module")
def references(clips):
    return {name: decode_all(data) for name, data in clips.items()}


def _check_selection(data, meta, ref, indices, **kw):
    rp, rf = ref
    clip, pts = decode_video(data, meta, indices, return_pts=True, **kw)
    assert np.array_equal(pts, video_pts(meta)[np.asarray(indices)])
    pos = np.searchsorted(rp, pts)
    assert np.array_equal(rp[pos], pts), "selected pts not in the reference decode"
    assert np.array_equal(clip, rf[pos]), "pixels differ from the reference decode"


@pytest.mark.parametrize("name", list(CLIPS) + ["h264_mkv_pts_eq_dts", "h264_mpegts"])
def test_index_matches_reference_pts(clips, references, name):
    meta = probe_media(clips[name], "video")
    json.dumps(meta)
    rp, _rf = references[name]
    assert np.array_equal(video_pts(meta), rp)
    assert meta["num_frames"] == len(rp) and meta["key_frames"][0] == 0
    assert len(json.dumps(meta)) < 2000  # compact: CFR pts collapse to one run


@pytest.mark.parametrize("name", list(CLIPS) + ["h264_mkv_pts_eq_dts", "h264_mpegts"])
def test_selected_frames_equal_reference(clips, references, name):
    data = clips[name]
    meta = probe_media(data, "video")
    n = meta["num_frames"]
    rng = np.random.default_rng(0)
    cases = [[0], [n - 1], list(range(0, n, 7)), sorted(rng.choice(n, 8, replace=False).tolist()),
             [5, 5, 2, n - 2, 2]]  # unsorted with repeats: output follows the request order
    for sid in range(6):
        cases.append(sample_frame_indices(meta, FrameSampling(8, 1.0), seed=3, sample_id=sid))
    for idx in cases:
        _check_selection(data, meta, references[name], idx)


def test_pts_eq_dts_clip_really_has_nonmonotone_frame_pts(clips):
    import io

    import av
    with av.open(io.BytesIO(clips["h264_mkv_pts_eq_dts"])) as c:
        pts = [f.pts for f in c.decode(video=0)]
    assert any(b <= a for a, b in itertools.pairwise(pts)), "remux did not produce the messy case"


@pytest.mark.parametrize("name", list(CLIPS) + ["h264_mkv_pts_eq_dts", "h264_mpegts"])
def test_fast_path_needs_no_fallback(clips, references, name):
    """On sound files every group starts on its index keyframe (confirmed), NONREF skipping stays on where
    the codec allows it, and nothing is decoded again from the start."""
    data = clips[name]
    meta = probe_media(data, "video")
    n = meta["num_frames"]
    for idx in ([1], [n // 2, n // 2 + 1], [3, n // 3, 2 * n // 3, n - 1]):
        report = DecodeReport()
        _check_selection(data, meta, references[name], idx, report=report)
        assert not report.refused_keys and not report.from_start and not report.substituted, idx
        assert report.nonref_skip == (meta["codec"] in NONREF_SKIP_CODECS)


def _frames_out_of_decoder(monkeypatch, *args, **kw) -> tuple[np.ndarray, list[int]]:
    """decode_video(*args, **kw) and the pts of every frame the codec handed back (skipped frames never come out)."""
    from foresight.media import video

    seen: list[int] = []
    take = video._Run._take

    def counting_take(run, frame):
        seen.append(frame.pts)
        return take(run, frame)

    with monkeypatch.context() as m:
        m.setattr(video._Run, "_take", counting_take)
        out = decode_video(*args, **kw)
    return out, seen


def test_skip_nonref_is_exact_and_skips(clips, references, monkeypatch):
    import io

    import av
    from av.video.frame import PictureType

    data = clips["h264_long_gop"]
    meta = probe_media(data, "video")
    idx = [3, 40, 41, 77]
    report = DecodeReport()
    a, skipping = _frames_out_of_decoder(monkeypatch, data, meta, idx, skip_nonref=True, report=report)
    b, plain = _frames_out_of_decoder(monkeypatch, data, meta, idx, skip_nonref=False)
    assert report.nonref_skip and not report.from_start
    assert np.array_equal(a, b)
    _check_selection(data, meta, references["h264_long_gop"], idx)
    # frames were really skipped, and only B-frames that were not asked for (a plain decode tells their type)
    with av.open(io.BytesIO(data)) as c:
        b_frames = {f.pts for f in c.decode(video=0) if f.pict_type == PictureType.B}
    skipped = set(plain) - set(skipping)
    assert len(skipping) < len(plain) and len(skipped) >= 10, (len(skipping), len(plain))
    assert set(skipping) <= set(plain)
    assert skipped <= b_frames and not skipped & set(video_pts(meta)[idx].tolist())


def test_resize_crop_layout_threads(clips, references):
    data = clips["h264_short_gop"]
    meta = probe_media(data, "video")
    idx = [1, 20, 33]
    rp, _ = references["h264_short_gop"]
    pos = np.searchsorted(rp, video_pts(meta)[idx])
    _, ref_small = decode_all(data, size=(40, 50))
    _, ref_crop = decode_all(data, size=(40, 50), crop=(5, 6, 20, 30))
    small = decode_video(data, meta, idx, size=(40, 50))
    assert small.shape == (3, 40, 50, 3) and np.array_equal(small, ref_small[pos])
    chw = decode_video(data, meta, idx, size=(40, 50), layout="TCHW")
    assert np.array_equal(chw, ref_small[pos].transpose(0, 3, 1, 2))
    crop = decode_video(data, meta, idx, size=(40, 50), crop=(5, 6, 20, 30))
    assert crop.shape == (3, 20, 30, 3) and np.array_equal(crop, ref_crop[pos])
    threaded = decode_video(data, meta, idx, size=(40, 50), threads=2)
    assert np.array_equal(threaded, ref_small[pos])


@pytest.mark.parametrize("interpolation", ["BILINEAR", "BICUBIC", "AREA", "FAST_BILINEAR", "POINT", "LANCZOS"])
@pytest.mark.parametrize("size", [(224, 224), (40, 50), (33, 77)])
def test_resized_frames_equal_reference_bit_for_bit(clips, references, interpolation, size):
    """The output the loader and the bench use (224x224, BILINEAR) and other sizes and filters, up- and
    downscaled: equal to the reference's own PyAV conversion, no tolerance (the same swscale underneath)."""
    data = clips["h264_bpyramid_strict"]
    meta = probe_media(data, "video")
    idx = [0, 7, 8, 31, meta["num_frames"] - 1]
    rp, _ = references["h264_bpyramid_strict"]
    ref_pts, ref = decode_all(data, size=size, interpolation=interpolation)
    assert np.array_equal(ref_pts, rp)  # resizing never changes which frames come out
    pos = np.searchsorted(rp, video_pts(meta)[idx])
    got = decode_video(data, meta, idx, size=size, interpolation=interpolation)
    assert got.shape == (len(idx), *size, 3)
    assert np.array_equal(got, ref[pos]), f"max pixel diff {int(np.abs(got.astype(np.int16) - ref[pos]).max())}"


def test_plan_segments_and_cost(clips):
    meta = probe_media(clips["h264_short_gop"], "video")
    segs = plan_segments(meta, np.array([25, 3, 12, 5, 3]))
    assert [(k, w.tolist()) for k, w in segs] == [(0, [3, 5]), (10, [12]), (20, [25])]
    assert decode_cost(meta, [3, 5, 12, 25]) == (6 + 3 + 6) * 96 * 64
    with pytest.raises(ValueError, match="frame indices"):
        plan_segments(meta, np.array([meta["num_frames"]]))


def test_window_rules(clips):
    meta = probe_media(clips["h264_short_gop"], "video")  # 3 s, 90 frames
    n = meta["num_frames"]
    # past the end: shifted back to end at the clip end
    late = sample_frame_indices(meta, FrameSampling(4, 1.0, start=10.0))
    assert late.tolist() == [60, 67, 75, 82]
    # clip shorter than the window: whole clip, evenly, repeats allowed
    whole = sample_frame_indices(meta, FrameSampling(4, 60.0))
    assert whole.tolist() == [0, 22, 45, 67]
    many = sample_frame_indices(meta, FrameSampling(200, None))
    assert many.size == 200 and many.min() == 0 and many.max() == n - 1 and np.all(np.diff(many) >= 0)
    # random start: deterministic per key, different across keys, always inside the clip
    draws = [tuple(sample_frame_indices(meta, FrameSampling(8, 1.0), seed=1, sample_id=i)) for i in range(20)]
    assert draws == [tuple(sample_frame_indices(meta, FrameSampling(8, 1.0), seed=1, sample_id=i)) for i in range(20)]
    assert len(set(draws)) > 10
    assert all(0 <= min(d) and max(d) < n for d in draws)
    clip = decode_video(clips["h264_short_gop"], meta, FrameSampling(200, None))
    assert clip.shape[0] == 200


def test_sampling_argument_checks():
    with pytest.raises(ValueError, match="num_frames"):
        FrameSampling(0)
    with pytest.raises(ValueError, match="start must be"):
        FrameSampling(4, 1.0, start="middle")
    with pytest.raises(ValueError, match="layout must be one of"):
        decode_video(b"", {}, [0], layout="HWC")


@pytest.mark.parametrize("cut", [0.0, 0.05, 0.5, 0.9])
def test_truncated_bytes_raise_decode_error_naming_sample(clips, cut):
    data = clips["h264_short_gop"]
    meta = probe_media(data, "video")
    broken = data[: int(len(data) * cut)]
    with pytest.raises(DecodeError, match="sample=17"):
        decode_video(broken, meta, [0, 45, meta["num_frames"] - 1], sample_id=17)


def test_probe_rejects_garbage():
    with pytest.raises(DecodeError, match="sample=3"):
        probe_media(b"\x00" * 1000, "video", sample=3)
    with pytest.raises(ValueError, match="modality must be one of"):
        probe_media(b"", "text")


def test_a_stream_whose_codec_ffmpeg_cannot_open_is_a_decode_error(clips):
    """Damaged codec parameters leave a video stream with no decoder (PyAV: ``codec_context`` is None); found by
    the flips below in a stress run (one byte of the sample entry zeroed): a DecodeError naming the sample, from the
    probe and from the decode, never an AttributeError."""
    data = clips["h264_short_gop"]
    meta = probe_media(data, "video")
    bad = data.replace(b"avc1", b"zzzz")  # the sample entry's codec: no decoder for it
    with pytest.raises(DecodeError, match="no decoder.*sample=5"):
        decode_video(bad, meta, [0, 30, 60], sample_id=5)
    with pytest.raises(DecodeError, match="no decoder.*sample=5"):
        probe_media(bad, "video", sample=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=20))
def test_corrupt_bytes_never_crash(clips, flips):
    """Random byte flips: frames or a DecodeError, never another exception or a crash."""
    data = bytearray(clips["h264_short_gop"])
    meta = probe_media(bytes(data), "video")
    for pos, val in flips:
        data[pos % len(data)] = val
    try:
        out = decode_video(bytes(data), meta, [0, 30, 60], sample_id=5)
        assert out.shape[0] == 3 and out.dtype == np.uint8
    except DecodeError as e:
        assert isinstance(e, ForesightError) and "sample=5" in str(e)
