"""Frame-selective video decode from bytes in memory, guided by the pack-time index.

The index (``probe_media``) is a hint that decoding confirms. For the wanted frames of one sample (frame
indices in presentation order, see ``sampling``):

1. group them by the index keyframe at or before each (``plan_segments``: no probing);
2. per group, seek to that keyframe. Packets before it (a demuxer may land earlier) are read, never decoded.
   The first frame decoded must carry the decoder's own key flag; if it does not (an AVI without its index
   calls every packet a keyframe), the group's key is refused and its frames come from step 5;
3. decode forward in decode order until the packet of every wanted frame has been sent. Packets whose pts is
   not wanted go with ``skip_frame="NONREF"`` (H.264, HEVC, MPEG-4 part 2), so frames nothing references are
   never decoded. Not for MPEG-4 with packed B-frames (DivX/Xvid AVIs: a B-frame travels in the packet
   before its own placeholder, so the skip decision of one packet would land on another picture);
4. match frames by the pts they come out with, never by order. Codecs whose drained frames keep the pts a
   full decode gives them (``EARLY_DRAIN_CODECS``) are then drained; others are fed on until the wanted
   frames come out (MPEG-4 part 2 names the last frame of a drain after a not-coded VOP with that VOP's pts,
   so an early drain could show a later picture under an earlier name);
5. frames still missing (a refused key, a seek that landed wrong, a pts that did not come out) are decoded
   plainly from the start of the stream: no seek, no skipping;
6. convert only kept frames to rgb24, resizing inside FFmpeg (swscale) with one reformatter.

A pts that never decodes: when its packet was decoded but no picture came out (an MPEG-4 not-coded VOP, a
frame an edit list hides in an index made before the probe left those out), the row holds the previous
picture, the frame with the largest pts below it. That is what players show and what the MPEG-4 standard
says a not-coded VOP means; raising would make valid files unusable, and a later frame would leak the
future. ``return_pts`` gives the pts of the frame each row really holds, and ``report.substituted`` records
the swap. A pts with no earlier picture, whose packet is missing (a file cut short), or that lies past a
corrupt packet raises :class:`DecodeError`.

Example::

    meta = probe_media(data, "video")
    clip = decode_video(data, meta, FrameSampling(num_frames=8, window_s=4.0), seed=1, sample_id=7,
                        size=(224, 224))             # uint8 (8, 224, 224, 3)
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from av.video.reformatter import VideoReformatter

from ..errors import DecodeError
from ._av import MEDIA_ERRORS, ensure_quiet_logging, first_stream, open_media
from .probe import INDEX_VERSION, mpeg4_packed, probe_media, video_pts
from .sampling import FrameSampling, sample_frame_indices

LAYOUTS = ("THWC", "TCHW")
#: Decoders that honour ``skip_frame`` per packet and skip exactly the frames nothing references.
#: libdav1d reads it once when opened (it then drops frames we want), so it is not listed; VP9 is
#: left out as unproven. Others decode every frame (still exact, just without this speed-up).
NONREF_SKIP_CODECS = frozenset({"h264", "hevc", "mpeg4"})
#: Decoders whose drained frames keep the pts a full decode gives them (tests compare against one), so a
#: group can stop feeding packets once its last wanted packet is in. Others are fed on (see module doc).
EARLY_DRAIN_CODECS = frozenset({"h264", "hevc", "vp9", "libdav1d"})
#: Frames out past a wanted pts after which that pts counts as never decoding: reorder slack (packed MPEG-4
#: shows a P-frame after the B-frame that follows it, so one frame is not enough).
SETTLE_FRAMES = 3
#: FFmpeg's MAX_NVOP_SIZE: an MPEG-4 packet this small may be a not-coded VOP, and a drain right after one
#: names the last picture with that packet's pts.
NVOP_MAX_BYTES = 19
INTERPOLATIONS = ("BILINEAR", "BICUBIC", "AREA", "FAST_BILINEAR", "POINT", "LANCZOS")


@dataclass
class DecodeReport:
    """What one ``decode_video`` call did besides the fast path (pass one as ``report=``; it is filled in).

    ``nonref_skip``: NONREF skipping was on. ``packed_bframes``: the clip packs B-frames DivX-style.
    ``refused_keys``: index keyframes (pts; None: the stream start) whose decode did not start on a
    keyframe, or failed. ``from_start``: a plain decode from the start of the stream ran.
    ``substituted``: wanted pts -> pts of the earlier frame returned for it (the wanted pts never decodes).
    """

    nonref_skip: bool = False
    packed_bframes: bool = False
    refused_keys: list[int] = field(default_factory=list)
    from_start: bool = False
    substituted: dict[int, int] = field(default_factory=dict)


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


class _SeekFailed(Exception):
    """The demuxer could not seek (an AVI without its index, say): decode from the start instead."""


class _Run:
    """One decode run, from an index keyframe (or the first packet) until its wanted pts are decided.

    ``settled`` means the decoder ran far enough that a wanted pts which has not come out never will: a drain
    at the end of the stream (what a plain decode does), an early drain of an ``EARLY_DRAIN_CODECS`` decoder,
    or ``SETTLE_FRAMES`` frames out past it. ``previous`` (when asked for) keeps, per wanted pts, the latest
    frame before it, the picture a player shows for a pts that never decodes.
    """

    def __init__(self, container, stream, keep, wanted: Iterable[int], *, track_previous: bool = False):
        self.container, self.stream, self.keep = container, stream, keep
        self.wanted = {int(p) for p in wanted}
        self.got: dict[int, np.ndarray] = {}
        self.sent: set[int] = set()
        self.previous: dict[int, Any] = dict.fromkeys(self.wanted) if track_previous else {}
        self.first_is_key: bool | None = None
        self.corrupt_pts: int | None = None
        self.settled = False

    def _take(self, frame) -> None:
        if self.first_is_key is None:
            self.first_is_key = bool(frame.key_frame)
        t = frame.pts
        if t is None:
            return
        if t in self.wanted and t not in self.got:
            self.got[t] = self.keep(frame)
        for p, best in self.previous.items():
            if t < p and (best is None or t > best.pts):
                self.previous[p] = frame

    def packets_from(self, key_pts: int, earlier: int | None) -> Iterator:
        """Demux from the packet with pts ``key_pts``: seek there, read (never decode) packets before it; if the
        seek lands past it (MPEG-TS seeks by dts, one packet late), seek to ``earlier`` instead."""
        for target in (key_pts,) if earlier is None else (key_pts, earlier):
            try:
                self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
            except MEDIA_ERRORS as e:
                raise _SeekFailed from e
            packets = self.container.demux(self.stream)
            for packet in packets:
                t = packet.pts if packet.pts is not None else packet.dts
                if packet.size and t is not None:
                    if t < key_pts:
                        continue
                    if t > key_pts and target != earlier and earlier is not None:
                        break  # landed past our keyframe: try again from the one before
                yield packet
                yield from packets
                return

    def run(self, key_pts: int | None, pending: Iterable[int], *, skip: bool, early_drain: bool,
            earlier: int | None = None) -> bool:
        """Decode from the keyframe at ``key_pts`` (None: from where the container stands, the stream start when
        fresh) until every pts in ``pending`` has been sent, then settle. False: the first frame out was no
        keyframe, or the seek failed."""
        cc = self.stream.codec_context
        packets = self.container.demux(self.stream) if key_pts is None else self.packets_from(key_pts, earlier)
        pending = {int(p) for p in pending}
        skipping = False
        past = 0  # frames out past every open wanted pts since the last pending packet went in
        last_size, last_pts = 0, None
        try:
            for packet in packets:
                if packet.size == 0:
                    break  # end of stream: drain below, as a plain decode does
                t = packet.pts if packet.pts is not None else packet.dts
                if packet.is_corrupt:  # never decoded; what depends on it is an error, not a frame
                    self.corrupt_pts = t
                    # after a possible not-coded VOP, a drained frame may carry that VOP's pts: not taken
                    self._drain(cc, None if early_drain or last_size > NVOP_MAX_BYTES else last_pts)
                    return self._started_on_key(key_pts)
                want = t is None or t in pending
                if skip and skipping == want:  # toggle only on change
                    skipping = not want
                    cc.skip_frame = "NONREF" if skipping else "DEFAULT"
                out = cc.decode(packet)
                for frame in out:
                    self._take(frame)
                    if not self._started_on_key(key_pts):
                        return False
                last_size, last_pts = packet.size, t
                if t is not None:
                    self.sent.add(t)
                    pending.discard(t)
                if pending:
                    continue
                if early_drain:
                    break
                open_ = self.wanted.difference(self.got)
                if open_:
                    top = max(open_)
                    past += sum(1 for f in out if f.pts is not None and f.pts > top)
                if not open_ or past >= SETTLE_FRAMES:
                    self.settled = True
                    return True
            self._drain(cc)
            self.settled = True
            return self._started_on_key(key_pts)
        except _SeekFailed:
            return False
        finally:
            cc.skip_frame = "DEFAULT"

    def _started_on_key(self, key_pts: int | None) -> bool:
        """A seek's decode must start on a frame the decoder itself calls a keyframe (None: nothing to check)."""
        return key_pts is None or self.first_is_key is not False

    def _drain(self, cc, distrust_pts: int | None = None) -> None:
        cc.skip_frame = "DEFAULT"
        for frame in cc.decode(None):  # the frames still inside the decoder; no further packets
            if distrust_pts is None or frame.pts != distrust_pts:
                self._take(frame)


def _seek_groups(container, stream, keep, meta: dict[str, Any], groups, report: DecodeReport,
                 early_drain: bool) -> dict[int, np.ndarray]:
    """Steps 2-4 of the module doc for every group: pts -> frame for what decoded as named."""
    pts_all = video_pts(meta)
    keys = np.asarray(meta["key_frames"], dtype=np.int64)
    got: dict[int, np.ndarray] = {}
    for i, (key_idx, wanted_idx) in enumerate(groups):
        # the first group at index key 0 starts at the stream start: no seek, nothing to confirm
        key_pts = None if i == 0 and key_idx == 0 else int(pts_all[key_idx])
        before = keys[keys < key_idx]
        run = _Run(container, stream, keep, pts_all[wanted_idx])
        try:
            started_on_key = run.run(key_pts, run.wanted, skip=report.nonref_skip, early_drain=early_drain,
                                     earlier=int(pts_all[before[-1]]) if before.size else None)
        except MEDIA_ERRORS:  # the plain decode from the start will say whether the data is bad
            started_on_key = False
        if started_on_key:
            got.update(run.got)
        else:
            report.refused_keys.append(key_pts)
    return got


def _from_start(data, ctx: dict, configure, keep, missing: np.ndarray, pts_all: np.ndarray,
                early_drain: bool) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Plain decode from the start of the stream (fresh container, no seek, no skipping) of the ``missing``
    pts: (pts -> frame, pts -> pts of the earlier frame shown instead). Raises where neither exists."""
    with open_media(data, **ctx) as container:
        stream = first_stream(container, "video", **ctx)
        configure(stream.codec_context)
        run = _Run(container, stream, keep, missing, track_previous=True)
        try:  # send every packet up to the last missing pts, so all frames before each one come out
            run.run(None, pts_all[pts_all <= missing.max()], skip=False, early_drain=early_drain)
        except MEDIA_ERRORS as e:
            raise DecodeError(f"video decode failed: {type(e).__name__}: {e}", **ctx) from e
        shown: dict[int, int] = {}
        for p in (int(x) for x in missing):
            if p in run.got:
                continue
            where = (f"the corrupt packet at pts {run.corrupt_pts}" if run.corrupt_pts is not None
                     else "the end of the data")
            if p not in run.sent:
                raise DecodeError(f"no packet with pts {p} before {where} (file cut short, or an index of "
                                  f"another file?)", **ctx)
            if not run.settled:
                raise DecodeError(f"frame at pts {p} did not come out before {where}", **ctx)
            prev = run.previous[p]
            if prev is None:
                raise DecodeError(f"pts {p} never decodes and no frame before it does", **ctx)
            run.got[p] = keep(prev)
            shown[p] = int(prev.pts)
    return run.got, shown


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
    report: DecodeReport | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Decode only the wanted frames of one video; returns uint8 (T, H, W, 3) or (T, 3, H, W).

    ``frames`` is a :class:`FrameSampling` (drawn from seed, epoch, sample_id) or explicit frame
    indices in presentation order. ``meta`` is the ``probe_media`` index (None: probe now, slower).
    ``size=(h, w)`` resizes inside swscale; ``crop=(y, x, h, w)`` then slices that resized frame.
    ``threads`` > 1 enables FFmpeg frame+slice threads (worth it for large frames when few samples
    run at once). ``return_pts`` also returns the pts (stream time base) of the frame each row holds: the
    wanted pts, except where that pts never decodes and the previous frame stands in (module doc).
    ``report`` (a :class:`DecodeReport`) is filled with what the call had to do beyond the fast path.
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
    want_pts = pts_all[indices]
    keep = _Converter(size, interpolation, crop)
    report = DecodeReport() if report is None else report

    def configure(cc) -> None:
        cc.thread_count = threads
        cc.thread_type = "AUTO" if threads > 1 else "SLICE"

    with open_media(data, **ctx) as container:
        stream = first_stream(container, "video", **ctx)
        cc = stream.codec_context
        configure(cc)
        report.packed_bframes = cc.name == "mpeg4" and bool(meta.get("packed_bframes")
                                                            or mpeg4_packed(cc.extradata))
        report.nonref_skip = skip_nonref and cc.name in NONREF_SKIP_CODECS and not report.packed_bframes
        early_drain = cc.name in EARLY_DRAIN_CODECS
        got = _seek_groups(container, stream, keep, meta, groups, report, early_drain)
    missing = np.unique(want_pts[~np.isin(want_pts, list(got))])
    if missing.size:
        report.from_start = True
        more, shown = _from_start(data, ctx, configure, keep, missing, pts_all, early_drain)
        got.update(more)
        report.substituted.update(shown)
    out = np.stack([got[int(p)] for p in want_pts]) if want_pts.size else np.zeros((0, 0, 0, 3), np.uint8)
    if layout == "TCHW":
        out = np.ascontiguousarray(out.transpose(0, 3, 1, 2))
    if not return_pts:
        return out
    return out, np.array([report.substituted.get(int(p), int(p)) for p in want_pts], dtype=np.int64)


__all__ = ["EARLY_DRAIN_CODECS", "INTERPOLATIONS", "LAYOUTS", "NONREF_SKIP_CODECS", "DecodeReport", "decode_cost",
           "decode_video", "plan_segments"]
