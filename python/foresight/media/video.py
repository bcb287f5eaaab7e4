"""Frame-selective video decode from bytes in memory, guided by the pack-time index.

For the wanted frames of one sample (frame indices in presentation order, see ``sampling``):

1. group them by the keyframe at or before each (``plan_segments``, from the index: no probing);
2. per group, seek to that keyframe and decode forward in decode order; packets whose pts is not
   wanted are sent with ``skip_frame="NONREF"`` (H.264, HEVC, MPEG-4 part 2), so frames that nothing references are never
   decoded (this is exact: a non-reference frame by definition feeds no other frame), while
   reference frames and wanted frames are decoded normally;
3. once the packet of the group's last wanted frame is sent, drain the decoder (no further
   packets are decoded), keep frames whose pts is wanted (match by pts, never by order);
4. convert only kept frames to rgb24, resizing inside FFmpeg (swscale) with one reformatter.

A group in a later GOP is always reached by a new seek: decoding through would decode a superset
of the frames the seek decodes. If a seek lands wrong (files whose index lies), the missing frames
are decoded again from the start of the stream; still-missing frames raise :class:`DecodeError`.

Example::

    meta = probe_media(data, "video")
    clip = decode_video(data, meta, FrameSampling(num_frames=8, window_s=4.0), seed=1, sample_id=7,
                        size=(224, 224))             # uint8 (8, 224, 224, 3)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from av.video.reformatter import VideoReformatter

from ..errors import DecodeError
from ._av import MEDIA_ERRORS, ensure_quiet_logging, open_media
from .probe import INDEX_VERSION, probe_media, video_pts
from .sampling import FrameSampling, sample_frame_indices

LAYOUTS = ("THWC", "TCHW")
#: Decoders that honour ``skip_frame`` per packet and skip exactly the frames nothing references.
#: libdav1d reads it once when opened (it then drops frames we want), so it is not listed; VP9 is
#: left out as unproven. Others decode every frame (still exact, just without this speed-up).
NONREF_SKIP_CODECS = frozenset({"h264", "hevc", "mpeg4"})
INTERPOLATIONS = ("BILINEAR", "BICUBIC", "AREA", "FAST_BILINEAR", "POINT", "LANCZOS")


def plan_segments(meta: dict[str, Any], indices: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Group unique wanted frame indices by their keyframe: [(keyframe index, wanted indices), ...]."""
    keys = np.asarray(meta["key_frames"], dtype=np.int64)
    uniq = np.unique(np.asarray(indices, dtype=np.int64))
    if uniq.size and (uniq[0] < 0 or uniq[-1] >= meta["num_frames"]):
        raise ValueError(f"frame indices must lie in [0, {meta['num_frames']}), got {uniq[0]}..{uniq[-1]}")
    kf = keys[np.searchsorted(keys, uniq, side="right") - 1]
    cuts = np.flatnonzero(np.diff(kf)) + 1
    return [(int(kf[g[0]]), uniq[g]) for g in np.split(np.arange(uniq.size), cuts) if g.size]


def decode_cost(meta: dict[str, Any], indices: np.ndarray) -> float:
    """Estimated work: frames from each segment's keyframe to its last wanted frame, times pixels."""
    frames = sum(int(w[-1]) - k + 1 for k, w in plan_segments(meta, indices))
    return float(frames) * meta["width"] * meta["height"]


def _check_options(layout: str, interpolation: str, size: Any) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if interpolation.upper() not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    if size is not None and (len(size) != 2 or min(size) < 1):
        raise ValueError(f"size must be (height, width) with positive ints, got {size!r}")


class _Converter:
    """Converts kept frames to rgb24 at (h, w) with one reusable swscale context."""

    def __init__(self, size: tuple[int, int] | None, interpolation: str, crop: tuple[int, int, int, int] | None):
        self.reformatter = VideoReformatter()
        self.size = size
        self.interpolation = interpolation.upper()
        self.crop = crop

    def __call__(self, frame) -> np.ndarray:
        h, w = self.size if self.size is not None else (frame.height, frame.width)
        rgb = self.reformatter.reformat(frame, w, h, "rgb24", interpolation=self.interpolation)
        arr = rgb.to_ndarray()
        if self.crop is not None:
            y, x, ch, cw = self.crop
            arr = arr[y:y + ch, x:x + cw]
        return arr


def _decode_groups(container, stream, pts_all: np.ndarray, groups, keep, skip_nonref: bool) -> dict[int, np.ndarray]:
    cc = stream.codec_context
    got: dict[int, np.ndarray] = {}
    for key_idx, wanted_idx in groups:
        wanted = set(pts_all[wanted_idx].tolist())
        pending = set(wanted)
        if key_idx is None:  # fallback: from the very start of the stream
            container.seek(0, backward=True, any_frame=False)
        else:
            container.seek(int(pts_all[key_idx]), stream=stream, backward=True, any_frame=False)
        skipping = False
        for packet in container.demux(stream):
            if packet.size == 0:
                break
            t = packet.pts
            want = t is None or t in pending
            if skip_nonref and skipping == want:  # toggle only on change
                skipping = not want
                cc.skip_frame = "NONREF" if skipping else "DEFAULT"
            for frame in cc.decode(packet):
                if frame.pts in wanted and frame.pts not in got:
                    got[frame.pts] = keep(frame)
            if t is not None:
                pending.discard(t)
            if not pending:
                break
        if skipping:
            cc.skip_frame = "DEFAULT"
        for frame in cc.decode(None):  # drain: the remaining frames, no further packets decoded
            if frame.pts in wanted and frame.pts not in got:
                got[frame.pts] = keep(frame)
    return got


def decode_video(
    data: bytes | bytearray | memoryview,
    meta: dict[str, Any] | None,
    frames: FrameSampling | Sequence[int] | np.ndarray,
    *,
    seed: int = 0,
    epoch: int = 0,
    sample_id: int = 0,
    size: tuple[int, int] | None = None,
    crop: tuple[int, int, int, int] | None = None,
    layout: str = "THWC",
    interpolation: str = "BILINEAR",
    skip_nonref: bool = True,
    threads: int = 1,
    return_pts: bool = False,
    sample: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Decode only the wanted frames of one video; returns uint8 (T, H, W, 3) or (T, 3, H, W).

    ``frames`` is a :class:`FrameSampling` (drawn from seed, epoch, sample_id) or explicit frame
    indices in presentation order. ``meta`` is the ``probe_media`` index (None: probe now, slower).
    ``size=(h, w)`` resizes inside swscale; ``crop=(y, x, h, w)`` then slices that resized frame.
    ``threads`` > 1 enables FFmpeg frame+slice threads (worth it for large frames when few samples
    run at once). ``return_pts`` also returns the pts (stream time base) of each output frame.
    Errors name ``sample`` (default: ``sample_id``).

    >>> clip = decode_video(data, meta, [0, 10, 20], size=(112, 112))  # doctest: +SKIP
    >>> clip.shape, clip.dtype  # doctest: +SKIP
    ((3, 112, 112, 3), dtype('uint8'))
    """
    _check_options(layout, interpolation, size)
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    ctx = {"sample": sample_id if sample is None else sample}
    ensure_quiet_logging()
    if meta is None:
        meta = probe_media(data, "video", sample=ctx["sample"])
    elif meta.get("modality") != "video" or meta.get("index_version") != INDEX_VERSION:
        raise ValueError(f"meta is not a video index of version {INDEX_VERSION} (re-probe with probe_media): "
                         f"modality={meta.get('modality')!r}, index_version={meta.get('index_version')!r}")
    if isinstance(frames, FrameSampling):
        indices = sample_frame_indices(meta, frames, seed=seed, epoch=epoch, sample_id=sample_id)
    else:
        indices = np.asarray(frames, dtype=np.int64).reshape(-1)
    pts_all = video_pts(meta)
    groups = plan_segments(meta, indices)
    keep = _Converter(size, interpolation, crop)
    with open_media(data, **ctx) as container:
        if not container.streams.video:
            raise DecodeError("no video stream", **ctx)
        stream = container.streams.video[0]
        cc = stream.codec_context
        cc.thread_count = threads
        cc.thread_type = "AUTO" if threads > 1 else "SLICE"
        try:
            skip = skip_nonref and cc.name in NONREF_SKIP_CODECS
            got = _decode_groups(container, stream, pts_all, groups, keep, skip)
            missing = np.unique(indices[~np.isin(pts_all[indices], list(got))])
            if missing.size:  # the seek landed wrong: decode again from the start, no skipping
                got.update(_decode_groups(container, stream, pts_all, [(None, missing)], keep, False))
        except MEDIA_ERRORS as e:
            raise DecodeError(f"video decode failed: {type(e).__name__}: {e}", **ctx) from e
    want_pts = pts_all[indices]
    lost = [int(p) for p in want_pts if int(p) not in got]
    if lost:
        raise DecodeError(f"{len(lost)} wanted frames missing (truncated or corrupt video?), first pts {lost[0]}",
                          **ctx)
    out = np.stack([got[int(p)] for p in want_pts]) if want_pts.size else np.zeros((0, 0, 0, 3), np.uint8)
    if layout == "TCHW":
        out = np.ascontiguousarray(out.transpose(0, 3, 1, 2))
    return (out, want_pts) if return_pts else out


def decode_all(data: bytes | bytearray | memoryview, *, size: tuple[int, int] | None = None,
               interpolation: str = "BILINEAR", sample: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Reference decode of every frame from the start: (pts sorted ascending, uint8 (N, H, W, 3)).

    No seeking, no skipping: what a plain player shows. Used by tests and the bench as the truth.
    """
    ensure_quiet_logging()
    ctx = {"sample": sample}
    keep = _Converter(size, interpolation, None)
    frames: dict[int, np.ndarray] = {}
    with open_media(data, **ctx) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        try:
            for frame in container.decode(stream):
                frames.setdefault(frame.pts, keep(frame))
        except MEDIA_ERRORS as e:
            raise DecodeError(f"video decode failed: {e}", **ctx) from e
    pts = np.array(sorted(frames), dtype=np.int64)
    return pts, np.stack([frames[int(p)] for p in pts])


__all__ = ["INTERPOLATIONS", "LAYOUTS", "decode_all", "decode_cost", "decode_video", "plan_segments"]
