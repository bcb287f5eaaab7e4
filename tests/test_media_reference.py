"""The decode reference (``foresight.testing.media_reference``) is right on its own and shares no code with
decode_video, so the comparisons in test_media_video*.py can fail: a broken converter in foresight is seen, not
mirrored."""
from __future__ import annotations

import ast
import io
from pathlib import Path

import av
import numpy as np
import pytest
from foresight.errors import DecodeError
from foresight.media import probe_media, video_pts
from foresight.testing import media_reference as ref_module
from foresight.testing.media_reference import convert, decode_all, frames_shown_at
from foresight.testing.media_synth import make_video
from foresight.media.video import decode_video

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_video(codec="libx264", width=96, height=64, seconds=2, fps=25, gop=12,
                      options={"x264-params": "bframes=3"})


def _quadrant_frame() -> av.VideoFrame:
    """A 64x96 picture as a decoder hands it out (yuv420p): red top left, blue top right, green bottom."""
    rgb = np.zeros((64, 96, 3), np.uint8)
    rgb[:32, :48], rgb[:32, 48:], rgb[32:] = RED, BLUE, GREEN
    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")


def test_reference_imports_nothing_of_what_it_checks():
    """Only PyAV, numpy, the standard library and the error classes: no index, no decoder, no converter."""
    tree = ast.parse(Path(ref_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported <= {"__future__", "io", "collections.abc", "av", "av.logging", "numpy", "..errors"}, imported


def test_every_frame_in_pts_order(clip):
    """One frame per packet (2 s at 25 fps, B-frames reordered), pts ascending: counted from the demuxer,
    not from foresight's index."""
    with av.open(io.BytesIO(clip)) as c:
        packet_pts = sorted(p.pts for p in c.demux(video=0) if p.size)
    pts, frames = decode_all(clip)
    assert pts.tolist() == packet_pts and len(pts) == 50
    assert frames.shape == (50, 64, 96, 3) and frames.dtype == np.uint8
    assert len({f.tobytes() for f in frames}) == 50  # testsrc2 draws a frame counter: all distinct
    threaded_pts, threaded = decode_all(clip, threads=3)
    assert np.array_equal(threaded_pts, pts) and np.array_equal(threaded, frames)


def test_convert_is_rgb_in_height_width_order():
    frame = _quadrant_frame()
    for size in (None, (40, 50), (128, 192)):
        out = convert(frame, size=size).astype(np.int16)
        h, w = (64, 96) if size is None else size
        assert out.shape == (h, w, 3)
        for (ys, xs), colour in (((slice(0, h // 4), slice(0, w // 4)), RED),
                                 ((slice(0, h // 4), slice(-w // 4, None)), BLUE),
                                 ((slice(-h // 4, None), slice(None)), GREEN)):
            assert np.abs(out[ys, xs] - colour).max() <= 8, (size, colour)  # yuv420p rounding only


def test_crop_slices_the_resized_frame_and_must_fit():
    frame = _quadrant_frame()
    whole = convert(frame, size=(40, 50), interpolation="BICUBIC")
    assert np.array_equal(convert(frame, size=(40, 50), interpolation="BICUBIC", crop=(5, 6, 20, 30)),
                          whole[5:25, 6:36])
    for bad in ((30, 0, 20, 10), (0, -1, 10, 10), (0, 0, 0, 5)):
        with pytest.raises(ValueError, match="does not lie inside the 40x50 frame"):
            convert(frame, size=(40, 50), crop=bad)


def test_frames_shown_at_takes_the_latest_frame_not_after():
    pts = np.array([0, 10, 20])
    frames = np.arange(3).reshape(3, 1, 1, 1)
    shown, rows = frames_shown_at((pts, frames), [10, 15, 25, 0])
    assert shown.tolist() == [10, 10, 20, 0] and rows.ravel().tolist() == [1, 1, 2, 0]
    with pytest.raises(ValueError, match="no frame at or before pts -1"):
        frames_shown_at((pts, frames), [-1])


def test_bad_bytes_raise_decode_error_naming_sample(clip):
    with pytest.raises(DecodeError, match="sample=3"):
        decode_all(b"\x00" * 1000, sample=3)
    with pytest.raises(DecodeError, match="sample=4"):
        decode_all(clip[: len(clip) // 20], sample=4)


def _break(monkeypatch, how: str) -> None:
    """Break foresight's converter the way a bug would (the reference must not follow)."""
    from foresight.media import video

    init, call = video._Converter.__init__, video._Converter.__call__
    if how == "channels_swapped":
        monkeypatch.setattr(video._Converter, "__call__", lambda self, frame: call(self, frame)[..., ::-1])
    elif how == "crop_one_pixel_right":
        monkeypatch.setattr(video._Converter, "__init__", lambda self, size, interp, crop: init(
            self, size, interp, (crop[0], crop[1] + 1, crop[2], crop[3])))
    elif how == "interpolation_dropped":
        monkeypatch.setattr(video._Converter, "__init__", lambda self, size, interp, crop: init(
            self, size, "BILINEAR", crop))
    elif how == "height_width_swapped":
        monkeypatch.setattr(video._Converter, "__init__", lambda self, size, interp, crop: init(
            self, size[::-1], interp, crop))


@pytest.mark.parametrize("how", ["intact", "channels_swapped", "crop_one_pixel_right", "interpolation_dropped",
                                 "height_width_swapped"])
def test_a_broken_converter_is_seen(clip, monkeypatch, how):
    """The old reference ran foresight's own converter: a channel swap or a dropped interpolation passed every test."""
    meta = probe_media(clip, "video")
    idx = [2, 17, 40]
    kw = {"size": (40, 52), "interpolation": "BICUBIC", "crop": (4, 6, 30, 40)}
    ref_pts, ref = decode_all(clip, **kw)
    pos = np.searchsorted(ref_pts, video_pts(meta)[idx])
    _break(monkeypatch, how)
    got = decode_video(clip, meta, idx, **kw)
    assert (got.shape == ref[pos].shape and np.array_equal(got, ref[pos])) == (how == "intact")
