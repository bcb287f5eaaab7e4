"""The decode bench runs end to end in --smoke mode (so it never rots) and every method it ran is correct; its FFmpeg
links for torchcodec live in a directory of the run, never in a fixed path another checkout or venv may have left."""
from __future__ import annotations

import json
import os
from pathlib import Path

import av
from bench_presets import load_bench, run_bench


def test_bench_decode_smoke(tmp_path):
    scratch = tmp_path / "tmp"  # the run's own TMPDIR: its FFmpeg links must be made (and removed) under it
    scratch.mkdir()
    proc, results = run_bench("decode", "--smoke", "--clips-dir", str(tmp_path / "clips"), results=tmp_path / "out",
                              env=dict(os.environ, TMPDIR=str(scratch)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "clips/s" in proc.stdout
    result = json.loads((results / "decode_smoke.json").read_text())
    assert result["smoke"] is True and result["summary"]
    links = Path(result["ffmpeg_links"])
    assert links.parent == scratch and links.name.startswith("foresight-tc-ffmpeg-")
    assert not links.exists()  # the run's links went with it
    methods = {c["method"] for c in result["correctness"]}
    assert {"foresight", "pyav_start", "pyav_seek"} <= methods
    for check in result["correctness"]:
        assert check["wrong_frame"] == 0, check
    fs = [c for c in result["correctness"] if c["method"] == "foresight"]
    assert all(c["pixel_exact"] == c["frames"] for c in fs)
    for check in result["correctness"]:  # the timed 224x224 output of every method is checked too
        assert check["frames_224"] > 0 and check["wrong_frame_224"] == 0, check
    # foresight's timed 224x224 frames equal the independent reference (PyAV's own conversion) bit for bit
    assert all(c["pixel_exact_224"] == c["frames_224"] and c["max_abs_diff_224"] == 0 for c in fs), fs
    for m in ("decord", "tc_exact", "tc_approx", "tc_mapped"):  # an anchor runs or is listed as unavailable
        assert m in methods or m in result["skipped"]


def test_stale_ffmpeg_links_are_replaced(tmp_path):
    """A link left dangling (its venv deleted) or naming another venv's FFmpeg is replaced by one to ours."""
    decode = load_bench("decode")
    other = tmp_path / "other-venv-libavcodec.so.62"
    other.write_bytes(b"not ours")
    (tmp_path / "libavcodec.so.62").symlink_to(tmp_path / "gone" / "libavcodec-0.so.62")  # dangling
    (tmp_path / "libavutil.so.60").symlink_to(other)
    links = decode.ffmpeg_links(tmp_path)
    ours = os.path.realpath(os.path.join(os.path.dirname(av.__file__), "..", "av.libs"))
    made = {p.name: os.readlink(p) for p in links.iterdir() if p.is_symlink()}
    assert {"libavcodec.so.62", "libavutil.so.60", "libswscale.so.9"} <= set(made), made
    assert all(os.path.dirname(target) == ours and os.path.exists(target) for target in made.values()), made
    assert not [p for p in links.iterdir() if p.name.endswith(".tmp")]
    decode.ffmpeg_links(tmp_path)  # again: links already right are kept
    assert {p.name: os.readlink(p) for p in links.iterdir() if p.is_symlink()} == made
