"""Pack-time media probe: the index that lets decode seek exactly without probing the file.

``probe_media`` demuxes packets only (no decoding), so it costs a fraction of a decode. For video
it records the sorted presentation timestamps of every frame (run-length encoded deltas, so a
constant-frame-rate clip costs a few bytes) and the positions of the keyframes in that sorted
order. Packet order is never trusted: timestamps are sorted, which also handles muxers that
write B-frames with pts == dts or with non-increasing pts.

The index lists only frames a player shows: packets an edit list hides (``is_discard``) and packets the
demuxer flags corrupt (the cut-off last packet of a truncated download) are left out. Keyframe flags are a
demuxer's word: an AVI without its index (cut short) flags every packet as a keyframe, so when every packet
of a codec that is not intra-only says "keyframe", the probe decodes the clip once to find the true ones.
Decode (``video.decode_video``) checks the flags again either way. MPEG-4 part 2 clips record whether their
B-frames are packed DivX-style (``packed_bframes``), which turns off NONREF skipping for them.

Example::

    meta = probe_media(open("clip.mp4", "rb").read(), "video")
    pts = video_pts(meta)            # np.int64 array, sorted, one per frame
    json.dumps(meta)                 # compact and JSON-serializable
"""
from __future__ import annotations

import io
import re
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

from ..errors import DecodeError
from ._av import MEDIA_ERRORS, first_stream, open_media

MODALITIES = ("video", "image", "audio")
INDEX_VERSION = 1
#: User data by which DivX 5 / Xvid mark a packed bitstream; FFmpeg's decoder switches to packed mode on it.
_DIVX_PACKED = re.compile(rb"DivX\d+(?:Build|b)\d+p")
_VOP_START = b"\x00\x00\x01\xb6"


def mpeg4_packed(buf: bytes | None) -> bool:
    """True if MPEG-4 part 2 bytes (extradata or a packet) show packed B-frames: the "DivX...p" user data,
    or two VOPs in one packet (a P-frame with the next B-frame riding along)."""
    if not buf:
        return False
    first = buf.find(_VOP_START)
    return bool(_DIVX_PACKED.search(buf)) or (first >= 0 and buf.find(_VOP_START, first + 4) >= 0)


def _rle(values: np.ndarray) -> list[list[int]]:
    """Run-length encode an int array as [[value, count], ...]."""
    if values.size == 0:
        return []
    change = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate(([0], change))
    counts = np.diff(np.concatenate((starts, [values.size])))
    return [[int(v), int(c)] for v, c in zip(values[starts], counts)]


def _unrle(runs: list[list[int]]) -> np.ndarray:
    if not runs:
        return np.zeros(0, dtype=np.int64)
    vals, counts = np.asarray(runs, dtype=np.int64).T
    return np.repeat(vals, counts)


def _frac(x: Fraction | None) -> list[int] | None:
    return None if x is None else [int(x.numerator), int(x.denominator)]


def _probe_video(data: bytes, ctx: dict) -> dict[str, Any]:
    with open_media(data, **ctx) as c:
        s = first_stream(c, "video", **ctx)
        pts_list: list[int] = []
        key_list: list[int] = []
        untimed = corrupt = 0
        mpeg4 = s.codec_context.name == "mpeg4"
        packed = mpeg4 and mpeg4_packed(s.codec_context.extradata)
        try:
            for p in c.demux(s):
                if p.size == 0 or p.is_discard:  # flush packet at the end / hidden by an edit list
                    continue
                if p.is_corrupt:  # e.g. the cut-off last packet: its picture is not the stream's
                    corrupt += 1
                    continue
                t = p.pts if p.pts is not None else p.dts
                if t is None:
                    untimed += 1
                    continue
                pts_list.append(t)
                if p.is_keyframe:
                    key_list.append(t)
                if mpeg4 and not packed:
                    packed = mpeg4_packed(bytes(p))
        except MEDIA_ERRORS as e:
            raise DecodeError(f"cannot demux video: {e}", **ctx) from e
        if untimed:
            raise DecodeError(f"{untimed} video packets have neither pts nor dts", **ctx)
        if not pts_list:
            raise DecodeError("video stream has no frames", **ctx)
        if len(key_list) == len(pts_list) > 1 and not _intra_only(s.codec_context.name):
            key_list = _decoded_key_pts(data, ctx)
        cc = s.codec_context
        tb = s.time_base
        rate = s.average_rate or s.guessed_rate
        pts = np.sort(np.asarray(pts_list, dtype=np.int64))
        # keyframes as positions in presentation order (duplicates pick the first one)
        key_pts = np.asarray(key_list, dtype=np.int64)
        keys = np.unique(np.searchsorted(pts, key_pts[np.isin(key_pts, pts)], side="left"))
        if keys.size == 0 or keys[0] != 0:
            # no keyframe flagged at the start: decoding must begin at the first packet
            keys = np.unique(np.concatenate(([0], keys)))
        deltas = np.diff(pts)
        frame_dur = int(np.median(deltas)) if deltas.size else (round(1 / (rate * tb)) if rate else 1)
        duration_s = float((pts[-1] - pts[0] + frame_dur) * tb)
        return {
            "modality": "video",
            "index_version": INDEX_VERSION,
            "codec": cc.name,
            "width": int(cc.width),
            "height": int(cc.height),
            "pix_fmt": cc.pix_fmt,
            "time_base": _frac(tb),
            "avg_rate": _frac(rate),
            "num_frames": int(pts.size),
            "duration_s": duration_s,
            "frame_dur": frame_dur,
            "pts_start": int(pts[0]),
            "pts_deltas": _rle(deltas),
            "key_frames": [int(k) for k in keys],
            "packed_bframes": bool(packed),
            "corrupt_packets": corrupt,
        }


def _intra_only(codec: str) -> bool:
    try:
        return bool(av.codec.Codec(codec, "r").intra_only)
    except (av.FFmpegError, ValueError):
        return False


def _decoded_key_pts(data: bytes, ctx: dict) -> list[int]:
    """Pts of the frames the decoder itself calls keyframes (one full decode, for untrustworthy flags)."""
    with open_media(data, **ctx) as c:
        s = c.streams.video[0]
        try:
            frames = (f for p in c.demux(s) if not p.is_corrupt for f in s.codec_context.decode(p))
            return [f.pts for f in frames if f.key_frame and f.pts is not None]
        except MEDIA_ERRORS as e:
            raise DecodeError(f"cannot decode video to find its keyframes: {e}", **ctx) from e


def _probe_audio(data: bytes, ctx: dict) -> dict[str, Any]:
    with open_media(data, **ctx) as c:
        s = first_stream(c, "audio", **ctx)
        tb = s.time_base
        first = last = None
        last_dur = 0
        try:
            for p in c.demux(s):
                if p.size == 0 or p.pts is None:
                    continue
                first = p.pts if first is None else min(first, p.pts)
                if last is None or p.pts >= last:
                    last, last_dur = p.pts, p.duration or 0
        except MEDIA_ERRORS as e:
            raise DecodeError(f"cannot demux audio: {e}", **ctx) from e
        if first is None:
            raise DecodeError("audio stream has no packets", **ctx)
        cc = s.codec_context
        duration_s = float((last + last_dur - max(first, 0)) * tb)  # priming (pts < 0) is dropped
        rate = int(cc.sample_rate)
        return {
            "modality": "audio",
            "index_version": INDEX_VERSION,
            "codec": cc.name,
            "sample_rate": rate,
            "channels": int(cc.channels),
            "time_base": _frac(tb),
            "pts_start": int(first),
            "duration_s": duration_s,
            "num_samples": round(duration_s * rate),
        }


def _probe_image(data: bytes, ctx: dict) -> dict[str, Any]:
    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            return {"modality": "image", "index_version": INDEX_VERSION, "width": int(img.width),
                    "height": int(img.height), "format": img.format, "mode": img.mode}
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DecodeError(f"cannot read image header: {e}", **ctx) from e


def probe_media(data: bytes | bytearray | memoryview, modality: str, *, sample: int | None = None) -> dict[str, Any]:
    """Return a compact JSON-serializable index of one media sample (see module docstring).

    ``modality`` is one of "video", "image", "audio". Raises :class:`DecodeError` on bad bytes.

    >>> meta = probe_media(mp4_bytes, "video")  # doctest: +SKIP
    >>> meta["num_frames"], meta["key_frames"][:3]  # doctest: +SKIP
    (120, [0, 30, 60])
    """
    modality = modality.lower()
    ctx = {"sample": sample}
    if modality == "video":
        return _probe_video(data, ctx)
    if modality == "audio":
        return _probe_audio(data, ctx)
    if modality == "image":
        return _probe_image(data, ctx)
    raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")


def video_pts(meta: dict[str, Any]) -> np.ndarray:
    """Sorted presentation timestamps (stream time base) of every frame, from a video index."""
    deltas = _unrle(meta["pts_deltas"])
    out = np.empty(deltas.size + 1, dtype=np.int64)
    out[0] = meta["pts_start"]
    np.cumsum(deltas, out=out[1:])
    out[1:] += meta["pts_start"]
    return out


def time_base(meta: dict[str, Any]) -> Fraction:
    num, den = meta["time_base"]
    return Fraction(num, den)


__all__ = ["MODALITIES", "mpeg4_packed", "probe_media", "time_base", "video_pts"]
