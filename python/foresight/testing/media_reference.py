"""The decode truth for tests and benches: every frame of a video, from the start, through PyAV's own API.

It shares no code with what it checks. No pack-time index, no seek, no NONREF skipping, no ``video._Converter``
and no ``_av`` helpers: ``container.decode`` hands every frame out in order, and ``VideoFrame.reformat`` (PyAV's
own call, a fresh swscale context per frame) builds the output that ``decode_video`` documents:

* rgb24, uint8 (H, W, 3), at the frame's own size, or at ``size=(h, w)`` resized with the named swscale
  ``interpolation`` (BILINEAR by default);
* ``crop=(y, x, h, w)``: that box sliced out of the resized frame (it must lie inside it).

So a bug in foresight's converter (channel order, height and width swapped, a crop box off by a pixel, the
interpolation not passed on) shows up as a pixel difference here instead of hiding on both sides. It is the
same FFmpeg scaler underneath, so foresight's output must equal it bit for bit: no tolerance. (A resampler of
our own cannot stand in: on sharp test patterns swscale's bilinear, which scales the YUV planes before the
colour conversion, differs from a resize of the RGB picture by a mean of 2-10 levels.)

Example::

    pts, frames = decode_all(data, size=(224, 224))          # every frame a player shows, in pts order
    shown_pts, rows = frames_shown_at((pts, frames), [3003, 6006])
"""
from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import av
import av.logging
import numpy as np

from ..errors import DecodeError

#: What PyAV raises for media it cannot read (written out here, not shared with the decoder under test).
_MEDIA_ERRORS = (av.FFmpegError, ValueError, OSError, IndexError, KeyError, EOFError, RuntimeError)


def iter_frames(data: bytes | bytearray | memoryview, *, threads: int = 1,
                sample: int | None = None) -> Iterator[tuple[int, av.VideoFrame]]:
    """(pts, frame) for every frame of the first video stream, in the order the decoder hands them out.

    A plain decode from the first packet to the drain. Frames without a pts cannot be named and are left out.
    ``threads`` > 1 turns on FFmpeg's frame threads (the same frames, sooner on a long clip).

    >>> for pts, frame in iter_frames(data): ...  # doctest: +SKIP
    """
    if av.logging.get_level() is not None:  # a Python log callback can deadlock FFmpeg's frame threads
        av.logging.set_level(None)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except _MEDIA_ERRORS as e:
        raise DecodeError(f"reference decode: cannot open media: {e}", sample=sample) from e
    with container:
        if not container.streams.video:
            raise DecodeError("reference decode: no video stream", sample=sample)
        stream = container.streams.video[0]
        stream.codec_context.thread_count = threads
        stream.codec_context.thread_type = "AUTO" if threads > 1 else "SLICE"
        try:
            for frame in container.decode(stream):
                if frame.pts is not None:
                    yield int(frame.pts), frame
        except _MEDIA_ERRORS as e:
            raise DecodeError(f"reference decode failed: {type(e).__name__}: {e}", sample=sample) from e


def convert(frame: av.VideoFrame, *, size: tuple[int, int] | None = None, interpolation: str = "BILINEAR",
            crop: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """One decoded frame as the rgb24 array ``decode_video`` documents: resized to ``size=(h, w)``, then
    ``crop=(y, x, h, w)`` sliced out.

    >>> convert(frame, size=(40, 50), crop=(5, 6, 20, 30)).shape  # doctest: +SKIP
    (20, 30, 3)
    """
    height, width = (frame.height, frame.width) if size is None else size
    rgb = frame.reformat(width=width, height=height, format="rgb24", interpolation=interpolation).to_ndarray()
    if rgb.shape != (height, width, 3):
        raise AssertionError(f"reference convert: PyAV gave {rgb.shape}, asked for ({height}, {width}, 3)")
    if crop is None:
        return rgb
    y, x, h, w = crop
    if min(y, x) < 0 or min(h, w) < 1 or y + h > height or x + w > width:
        raise ValueError(f"crop (y, x, h, w)={crop} does not lie inside the {height}x{width} frame")
    return rgb[y:y + h, x:x + w]


def decode_all(data: bytes | bytearray | memoryview, *, size: tuple[int, int] | None = None,
               interpolation: str = "BILINEAR", crop: tuple[int, int, int, int] | None = None,
               threads: int = 1, sample: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every frame a plain player shows: (pts ascending, uint8 (N, H, W, 3)). Where the decoder hands out two
    frames with one pts, the first counts. Errors are :class:`DecodeError` naming ``sample``.

    >>> pts, frames = decode_all(data, size=(48, 64))  # doctest: +SKIP
    """
    frames: dict[int, np.ndarray] = {}
    for pts, frame in iter_frames(data, threads=threads, sample=sample):
        if pts not in frames:
            frames[pts] = convert(frame, size=size, interpolation=interpolation, crop=crop)
    if not frames:
        raise DecodeError("reference decode: no frame came out", sample=sample)
    pts_sorted = np.array(sorted(frames), dtype=np.int64)
    return pts_sorted, np.stack([frames[int(p)] for p in pts_sorted])


def frames_shown_at(reference: tuple[np.ndarray, np.ndarray], pts: np.ndarray | Sequence[int]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """What a player shows at each pts, from a full decode (``decode_all``'s (pts, frames)): the frame with
    that pts, else the latest one before it. Returns (shown pts, frames); the truth ``decode_video`` meets.

    >>> shown_pts, frames = frames_shown_at(decode_all(data), [0, 512])  # doctest: +SKIP
    """
    ref_pts, ref_frames = reference
    pos = np.searchsorted(ref_pts, np.asarray(pts, dtype=np.int64), side="right") - 1
    if pos.size and pos.min() < 0:
        raise ValueError(f"no frame at or before pts {int(np.asarray(pts)[pos < 0][0])} in the reference")
    return ref_pts[pos], ref_frames[pos]


__all__ = ["convert", "decode_all", "frames_shown_at", "iter_frames"]
