"""Frame-selective decode on real video files this project did not make: the sample media Debian's
``opencv-doc`` ships (scripts/setup.sh installs it). Each returned row must be what a full sequential
decode of the same file shows at its pts, pixel for pixel.

* ``Megamind.avi``, ``Megamind_bugy.avi``: Xvid in AVI with packed B-frames ("DivX503b1393p");
* ``vtest.avi`` cut to its first 1.5 MB: DivX 3 (msmpeg4v3) in an AVI whose index is lost, so the demuxer
  calls every packet a keyframe;
* ``box.mp4``: H.264 with B-frames whose edit list hides the last frame; ``cup.mp4``: H.264, no B-frames.
"""
from __future__ import annotations

import gzip
import io
from pathlib import Path

import av
import numpy as np
import pytest
from foresight.media import probe_media, video_pts
from foresight.testing.media_reference import decode_all
from foresight.media.video import DecodeReport, decode_video
from installed import require_file
from test_media_video_robust import check_rows

DOC = Path("/usr/share/doc/opencv-doc")
SIZE = (48, 64)  # small, so memory stays small; the reference resizes with PyAV's own call, bit-exact
FILES = {
    "Megamind.avi": ("examples/data/Megamind.avi", None),
    "Megamind_bugy.avi": ("examples/data/Megamind_bugy.avi", None),
    "vtest_cut.avi": ("examples/data/vtest.avi", 1_500_000),
    "box.mp4": ("opencv4/html/box.mp4.gz", None),
    "cup.mp4": ("opencv4/html/cup.mp4.gz", None),
}


def _read(name: str) -> bytes:
    rel, cut = FILES[name]
    path = require_file(DOC / rel, "opencv-doc")
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data[:cut] if cut else data


@pytest.fixture(scope="module")
def real():
    cache: dict[str, tuple[bytes, dict, tuple]] = {}

    def get(name: str):
        if name not in cache:
            data = _read(name)
            cache[name] = (data, probe_media(data, "video"), decode_all(data, size=SIZE))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(FILES))
def test_real_file_rows_are_the_frames_they_name(real, name):
    data, meta, ref = real(name)
    n = meta["num_frames"]
    rng = np.random.default_rng(7)
    sets = [sorted(rng.choice(n, 4, replace=False).tolist()) for _ in range(8)]
    sets += [[n - 3, n - 2, n - 1], [5, 20, 35, 50], list(range(0, n, max(1, n // 8)))]
    for idx in sets:
        check_rows(data, meta, ref, idx, size=SIZE)


def test_megamind_packs_bframes_and_decodes_without_skipping(real):
    data, meta, ref = real("Megamind.avi")
    assert meta["packed_bframes"] is True
    report = check_rows(data, meta, ref, list(range(meta["num_frames"] - 40, meta["num_frames"], 3)), size=SIZE)
    assert report.packed_bframes and not report.nonref_skip


def test_vtest_cut_short_gets_its_true_keyframes(real):
    data, meta, ref = real("vtest_cut.avi")
    with av.open(io.BytesIO(data)) as c:
        assert all(p.is_keyframe for p in c.demux(video=0) if p.size)
    assert len(meta["key_frames"]) < meta["num_frames"] // 10
    report = check_rows(data, meta, ref, [10, 60, 110, meta["num_frames"] - 1], size=SIZE)
    assert not report.from_start and not report.refused_keys


def test_box_hidden_last_frame(real):
    """The edit list hides the last packet: the index leaves it out; an index that still lists it gets the
    previous frame there (a player shows that one), not a DecodeError and never a later frame."""
    data, meta, ref = real("box.mp4")
    with av.open(io.BytesIO(data)) as c:
        hidden = [p.pts for p in c.demux(video=0) if p.size and p.is_discard]
    assert len(hidden) == 1 and hidden[0] not in video_pts(meta)
    stale = dict(meta, num_frames=meta["num_frames"] + 1,
                 pts_deltas=meta["pts_deltas"] + [[int(hidden[0] - video_pts(meta)[-1]), 1]])
    report = DecodeReport()
    clip, shown = decode_video(data, stale, [stale["num_frames"] - 1], size=SIZE, return_pts=True, report=report)
    assert shown.tolist() == [int(ref[0][-1])] and report.substituted == {hidden[0]: int(ref[0][-1])}
    assert np.array_equal(clip[0], ref[1][-1])
