"""Video decode never returns a frame other than the one it names, on files as real-world tools leave them.

Each clip is made here (the ffmpeg command-line tool or PyAV) and damaged the way downloads and old muxers
damage files: MPEG-4 in AVI with packed B-frames (libxvid), AVIs without their index or cut short (the demuxer
then calls every packet a keyframe), MP4/MKV cut short, an MP4 whose edit list hides frames, a not-coded VOP.
Every returned row is checked against a full sequential decode by pts and pixels: the frame with the wanted
pts, or, for a pts that never decodes, the frame before it (``frames_shown_at``), never a later one.
"""
from __future__ import annotations

import io
import json

import av
import numpy as np
import pytest
from installed import require
from foresight.errors import DecodeError
from foresight.media import probe_media, video_pts
from foresight.testing.media_reference import decode_all, frames_shown_at
from foresight.testing.media_synth import drop_avi_index, ffmpeg_cli, make_video, remux, with_not_coded_vop
from foresight.media.video import DecodeReport, decode_video



@pytest.fixture
def _ffmpeg_installed() -> None:
    require("ffmpeg")  # the command-line tool scripts/setup.sh installs: missing fails, never skips


needs_ffmpeg = pytest.mark.usefixtures("_ffmpeg_installed")


def _lavfi(seconds: float = 4, fps: int = 25) -> list[str]:
    return ["-f", "lavfi", "-i", f"testsrc2=size=96x64:rate={fps}:duration={seconds}"]


def _cut_avi(avi: bytes, fraction: float = 0.7) -> bytes:
    """Cut short inside the movie data, as an interrupted download is: idx1 (at the end) is lost."""
    return avi[: int(avi.rfind(b"idx1") * fraction)]


@pytest.fixture(scope="module")
def clips() -> dict[str, tuple[bytes, bytes]]:
    """name -> (file bytes, bytes of the intact file whose full decode is the truth)."""
    require("ffmpeg")
    h264 = ffmpeg_cli([*_lavfi(), "-c:v", "libx264", "-g", "25", "-bf", "2", "-movflags", "+faststart"],
                      out_format="mp4")
    mkv = remux(h264, container="matroska")
    mpeg4 = ffmpeg_cli([*_lavfi(), "-c:v", "mpeg4", "-g", "25", "-bf", "2"], out_format="avi")
    xvid = ffmpeg_cli([*_lavfi(), "-c:v", "libxvid", "-g", "25", "-bf", "2"], out_format="avi")
    msmpeg4 = ffmpeg_cli([*_lavfi(), "-c:v", "msmpeg4", "-g", "25"], out_format="avi")  # DivX 3: no parser
    edited = ffmpeg_cli(["-ss", "0.5", "-i", "{in}", "-c", "copy"], data=h264, out_format="mp4")
    nvop, _ = with_not_coded_vop(make_video(codec="mpeg4", width=96, height=64, seconds=2, fps=30, gop=15,
                                            bframes=1), nth_b=4, fps=30)
    return {
        "h264_mp4": (h264, h264),
        "h264_mp4_cut": (h264[: int(len(h264) * 0.7)], h264),
        "h264_mkv": (mkv, mkv),
        "h264_mkv_cut": (mkv[: int(len(mkv) * 0.7)], mkv),
        "h264_mp4_edit_list": (edited, edited),
        "mpeg4_avi": (mpeg4, mpeg4),
        "mpeg4_avi_no_index": (drop_avi_index(mpeg4), mpeg4),
        "mpeg4_avi_cut": (_cut_avi(mpeg4), mpeg4),
        "xvid_packed_avi": (xvid, xvid),
        "xvid_packed_avi_cut": (_cut_avi(xvid), xvid),
        "msmpeg4_avi_cut": (_cut_avi(msmpeg4), msmpeg4),
        "mpeg4_mp4_not_coded_vop": (nvop, nvop),
    }


@pytest.fixture(scope="module")
def references(clips):
    return {name: decode_all(truth) for name, (_, truth) in clips.items()}


def check_rows(data: bytes, meta: dict, reference, indices, **kw) -> DecodeReport:
    """decode_video rows == what a full decode shows at each wanted pts (pts and pixels); never a later frame."""
    report = DecodeReport()
    clip, shown = decode_video(data, meta, indices, return_pts=True, report=report, **kw)
    wanted = video_pts(meta)[np.asarray(indices)]
    ref_pts, ref_frames = frames_shown_at(reference, wanted)
    assert np.all(shown <= wanted), "a later frame under an earlier name"
    assert np.array_equal(shown, ref_pts), f"rows hold pts {shown.tolist()}, a full decode shows {ref_pts.tolist()}"
    for row, (got, want) in enumerate(zip(clip, ref_frames)):
        diff = int(np.abs(got.astype(np.int16) - want).max())
        assert diff == 0, f"row {row} (index {indices[row]}, pts {wanted[row]}): max pixel diff {diff}"
    substituted = {int(p): int(s) for p, s in zip(wanted, shown) if p != s}
    assert report.substituted == substituted
    return report


def selections(n: int, seed: int = 0) -> list[list[int]]:
    """Every frame alone, and sets spanning several GOPs (a later group's seek once landed on a P-frame that
    a no-index AVI calls a keyframe)."""
    rng = np.random.default_rng(seed)
    sets = [[i] for i in range(n)]
    sets += [sorted(rng.choice(n, 4, replace=False).tolist()) for _ in range(8)]
    sets += [[5, 20], [2, 12, 22, 32], [n - 3, n - 2, n - 1]]
    return [[i for i in s if i < n] for s in sets]


@needs_ffmpeg
@pytest.mark.parametrize("name", ["h264_mp4", "h264_mp4_cut", "h264_mkv", "h264_mkv_cut", "h264_mp4_edit_list",
                                  "mpeg4_avi", "mpeg4_avi_no_index", "mpeg4_avi_cut", "xvid_packed_avi",
                                  "xvid_packed_avi_cut", "msmpeg4_avi_cut", "mpeg4_mp4_not_coded_vop"])
def test_every_row_is_the_frame_it_names(clips, references, name):
    data, _ = clips[name]
    meta = probe_media(data, "video")
    json.dumps(meta)
    for idx in selections(meta["num_frames"]):
        check_rows(data, meta, references[name], idx)


@needs_ffmpeg
def test_packed_bframes_are_detected_and_not_skipped(clips, references):
    data, _ = clips["xvid_packed_avi"]
    meta = probe_media(data, "video")
    assert meta["packed_bframes"] is True
    assert probe_media(clips["mpeg4_avi"][0], "video")["packed_bframes"] is False
    meta_without_flag = {k: v for k, v in meta.items() if k != "packed_bframes"}  # an index made before
    for m in (meta, meta_without_flag):  # the DivX...p user data in the extradata says it as well
        report = check_rows(data, m, references["xvid_packed_avi"], [3, 6, 9, 40, 41])
        assert report.packed_bframes and not report.nonref_skip and not report.from_start


@needs_ffmpeg
def test_nonref_skipping_stays_on_for_unpacked_clips(clips, references):
    """The fast path keeps its speed: NONREF skipping, one seek per GOP, no fallback."""
    for name in ("h264_mp4", "h264_mkv", "mpeg4_avi"):
        data, _ = clips[name]
        meta = probe_media(data, "video")
        for idx in ([30, 31, 60], [3, 40, 77], [meta["num_frames"] - 1]):
            report = check_rows(data, meta, references[name], idx)
            assert report.nonref_skip and not report.packed_bframes, name
            assert not report.refused_keys and not report.from_start and not report.substituted, (name, idx)


@needs_ffmpeg
def test_avi_without_index_keyframes_are_confirmed(clips, references):
    """Cut short, a DivX 3 AVI has no index and its demuxer calls every packet a keyframe; the probe finds
    the true ones by decoding, so seeks start on real keyframes (no fallback)."""
    data, truth = clips["msmpeg4_avi_cut"]
    with av.open(io.BytesIO(data)) as c:
        flags = [p.is_keyframe for p in c.demux(video=0) if p.size]
    assert all(flags), "the cut AVI no longer shows the all-keyframe demuxer behaviour"
    meta = probe_media(data, "video")
    assert meta["key_frames"] == probe_media(truth, "video")["key_frames"][: len(meta["key_frames"])]
    assert len(meta["key_frames"]) < meta["num_frames"] // 10
    report = check_rows(data, meta, references["msmpeg4_avi_cut"], [5, 20, 30, 45])
    assert not report.refused_keys and not report.from_start


@needs_ffmpeg
@pytest.mark.parametrize("name", ["msmpeg4_avi_cut", "mpeg4_avi", "h264_mp4"])
def test_an_index_that_calls_p_frames_keyframes_is_refused_not_trusted(clips, references, name):
    """An index made before the probe confirmed keyframes lists every frame as a keyframe: decoding from such
    a "keyframe" yields no frame the decoder calls a keyframe, so the seek is refused and the frames come
    from a plain decode, exact."""
    data, _ = clips[name]
    meta = dict(probe_media(data, "video"))
    meta["key_frames"] = list(range(meta["num_frames"]))
    report = check_rows(data, meta, references[name], [5, 20, 30, 45])
    assert report.from_start


def _stale_index(data: bytes) -> dict:
    """The index as the probe wrote it before hidden (edit-list) packets were left out."""
    meta = dict(probe_media(data, "video"))
    with av.open(io.BytesIO(data)) as c:
        pts = np.sort([p.pts for p in c.demux(video=0) if p.size])
    meta.update(num_frames=int(pts.size), pts_start=int(pts[0]),
                pts_deltas=[[int(d), 1] for d in np.diff(pts)], key_frames=[0])
    return meta


@needs_ffmpeg
def test_edit_list_hidden_frames_leave_the_index(clips, references):
    data, _ = clips["h264_mp4_edit_list"]
    meta = probe_media(data, "video")
    ref_pts, _ = references["h264_mp4_edit_list"]
    assert np.array_equal(video_pts(meta), ref_pts)
    assert _stale_index(data)["num_frames"] > meta["num_frames"], "ffmpeg -ss no longer writes an edit list"


@needs_ffmpeg
def test_pts_that_never_decodes_shows_the_previous_frame(clips, references):
    data, _ = clips["mpeg4_mp4_not_coded_vop"]
    meta = probe_media(data, "video")
    pts = video_pts(meta)
    ref_pts, _ = references["mpeg4_mp4_not_coded_vop"]
    lost = np.flatnonzero(~np.isin(pts, ref_pts))
    assert lost.size == 1, "the not-coded VOP should be the one pts a full decode never shows"
    i = int(lost[0])
    for idx in ([i], [i - 1, i, i + 1], [0, i, meta["num_frames"] - 1]):
        report = check_rows(data, meta, references["mpeg4_mp4_not_coded_vop"], idx)
        assert report.substituted == {int(pts[i]): int(pts[i - 1])}


@needs_ffmpeg
def test_stale_index_pts_before_any_frame_raises(clips):
    """A hidden pts with no frame before it cannot be shown: a clear error, not the next frame."""
    data, _ = clips["h264_mp4_edit_list"]
    stale = _stale_index(data)
    with pytest.raises(DecodeError, match=r"never decodes and no frame before it.*sample=4"):
        decode_video(data, stale, [0], sample_id=4)


@needs_ffmpeg
@pytest.mark.parametrize("name", ["h264_mp4_cut", "mpeg4_avi_cut", "xvid_packed_avi_cut"])
def test_frames_past_the_cut_raise_with_the_intact_files_index(clips, name):
    """The index of the intact file lists frames the cut file no longer has: DecodeError, never garbage."""
    data, truth = clips[name]
    meta = probe_media(truth, "video")
    n_cut = probe_media(data, "video")["num_frames"]
    with pytest.raises(DecodeError, match="sample=9"):
        decode_video(data, meta, [1, n_cut + 2], sample_id=9)


@needs_ffmpeg
@pytest.mark.parametrize("name", ["h264_mp4_cut", "mpeg4_avi_cut", "xvid_packed_avi_cut"])
def test_cut_off_last_packet_leaves_the_index(clips, name):
    """The demuxer flags the cut-off last packet corrupt: its picture is not the stream's, so it is not listed."""
    data, truth = clips[name]
    meta = probe_media(data, "video")
    assert meta["corrupt_packets"] == 1
    assert np.isin(video_pts(meta), video_pts(probe_media(truth, "video"))).all()


@needs_ffmpeg
@pytest.mark.parametrize("name", ["xvid_packed_avi", "msmpeg4_avi_cut", "h264_mp4_cut", "mpeg4_mp4_not_coded_vop"])
def test_frame_threads_name_the_same_frames(clips, references, name):
    """FFmpeg frame threads delay output; the frames matched by pts stay the same."""
    data, _ = clips[name]
    meta = probe_media(data, "video")
    for idx in selections(meta["num_frames"], seed=1)[meta["num_frames"]:]:
        check_rows(data, meta, references[name], idx, threads=3)
