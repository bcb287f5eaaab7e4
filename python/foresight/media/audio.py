"""Audio decode to float32 PCM at a target rate over a time window, with PyAV's resampler.

The window is located by timestamps: we seek (audio frames are independently decodable for the
common codecs; a 0.5 s pre-roll absorbs codec priming), decode, resample the decoded stretch
continuously with one ``av.AudioResampler`` and cut exactly ``round(window * rate)`` samples
starting at the requested time. Past the end the output is zero-padded to its promised length.

Example::

    pcm = decode_audio(data, start_s=1.0, duration_s=2.0, rate=16000)   # float32 (1, 32000)
"""
from __future__ import annotations

import av
import numpy as np

from ..errors import DecodeError
from ._av import MEDIA_ERRORS, ensure_quiet_logging, first_stream, open_media

PREROLL_S = 0.5


def decode_audio(data: bytes | bytearray | memoryview, *,
                 start_s: float = 0.0, duration_s: float | None = None, rate: int = 16000,
                 mono: bool = True, sample: int | None = None) -> np.ndarray:
    """Decode ``[start_s, start_s + duration_s)`` (None: to the end) to float32 (channels, samples).

    Times are stream time in seconds. A window past the end is zero-padded to ``duration_s``.
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    ensure_quiet_logging()
    ctx = {"sample": sample}
    layout = "mono" if mono else "stereo"
    chunks: list[np.ndarray] = []
    with open_media(data, **ctx) as c:
        s = first_stream(c, "audio", **ctx)
        tb = s.time_base
        first_time = None
        try:
            if start_s > PREROLL_S:
                c.seek(int((start_s - PREROLL_S) / tb), stream=s, backward=True)
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            stop_s = None if duration_s is None else start_s + duration_s
            for frame in c.decode(s):
                if first_time is None:
                    first_time = float(frame.pts * tb) if frame.pts is not None else 0.0
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
                if stop_s is not None and frame.pts is not None and float(frame.pts * tb) > stop_s + 0.1:
                    break
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
        except MEDIA_ERRORS as e:
            raise DecodeError(f"audio decode failed: {type(e).__name__}: {e}", **ctx) from e
    if first_time is None:
        raise DecodeError("no audio decoded", **ctx)
    pcm = np.concatenate(chunks, axis=1) if chunks else np.zeros((1 if mono else 2, 0), np.float32)
    # times are stream time (pts 0 = 0 s); codec priming before 0 is dropped by the decoder
    skip = max(0, round((start_s - first_time) * rate))
    n = pcm.shape[1] - skip if duration_s is None else round(duration_s * rate)
    out = pcm[:, skip:skip + max(n, 0)]
    if out.shape[1] < n:  # window past the end: zero-pad to the promised length
        out = np.pad(out, ((0, 0), (0, n - out.shape[1])))
    return np.ascontiguousarray(out, dtype=np.float32)


__all__ = ["decode_audio"]
