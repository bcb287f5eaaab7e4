"""Which frames (or which audio window) a sample contributes, drawn from (seed, epoch, sample id).

Rule for windows (documented contract, same for video and audio):

* the window start is ``start`` seconds from the clip start if given as a number, else drawn
  uniformly from ``[0, duration - window_s]`` ("random"), or centred ("center"), or 0 ("begin");
* a window reaching past the end is shifted back to end at the clip end (never padded);
* a clip shorter than the window uses the whole clip; frames are then spread evenly over it,
  repeating frames when ``num_frames`` exceeds the frames available.

Frame times are ``window_start + k * window_s / num_frames`` (k = 0..num_frames-1), and each time
maps to the frame *shown* at that time: the last frame whose pts is <= the time.

Example::

    spec = FrameSampling(num_frames=8, window_s=4.0)
    idx = sample_frame_indices(meta, spec, seed=1, epoch=0, sample_id=42)   # np.int64 (8,)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Self

import numpy as np

from .probe import time_base, video_pts
from .rng import keyed_rng

STARTS = ("random", "center", "begin")


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_seconds(v: Any) -> bool:
    """A finite number of seconds (not a bool; JSON's 1e999 parses as infinity)."""
    return (_is_int(v) or isinstance(v, (float, np.floating))) and bool(np.isfinite(v))


def _check_window(window_s: Any, start: Any) -> None:
    if window_s is not None and not (_is_seconds(window_s) and window_s > 0):
        raise ValueError(f"window_s must be > 0 seconds (finite) or None, got {window_s!r}")
    if isinstance(start, str):
        if start not in STARTS:
            raise ValueError(f"start must be a number of seconds or one of {STARTS}, got {start!r}")
    elif not _is_seconds(start) or start < 0:
        raise ValueError(f"start must be >= 0 seconds or one of {STARTS}, got {start!r}")


class _DictRoundTrip:
    """``to_dict``/``from_dict`` of a frozen dataclass (what transform specs store and hash)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class FrameSampling(_DictRoundTrip):
    """``num_frames`` frames evenly over a ``window_s`` window (None: the whole clip)."""

    num_frames: int = 8
    window_s: float | None = 4.0
    start: str | float = "random"

    def __post_init__(self) -> None:
        if not _is_int(self.num_frames) or self.num_frames < 1:
            raise ValueError(f"num_frames must be an int >= 1, got {self.num_frames!r}")
        _check_window(self.window_s, self.start)


@dataclasses.dataclass(frozen=True)
class AudioSampling(_DictRoundTrip):
    """A ``window_s`` window of audio (None: the whole clip), resampled to ``rate`` Hz."""

    rate: int = 16000
    window_s: float | None = None
    start: str | float = "random"
    mono: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.rate) or self.rate <= 0:
            raise ValueError(f"rate must be a positive int, got {self.rate!r}")
        if not isinstance(self.mono, bool):
            raise ValueError(f"mono must be true or false, got {self.mono!r}")
        _check_window(self.window_s, self.start)


def draw_window(duration_s: float, window_s: float | None, start: str | float, *,
                seed: int, epoch: int, sample_id: int) -> tuple[float, float]:
    """Return (start_s, length_s) of the window inside a clip of ``duration_s`` (module rule)."""
    if window_s is None or window_s >= duration_s:
        return 0.0, float(duration_s)
    room = duration_s - window_s
    if start == "random":
        t0 = keyed_rng(seed=seed, epoch=epoch, sample_id=sample_id, purpose="window").random() * room
    elif start == "center":
        t0 = room / 2
    elif start == "begin":
        t0 = 0.0
    else:
        t0 = min(float(start), room)  # past the end: shift back to end at the clip end
    return float(t0), float(window_s)


def sample_frame_indices(meta: dict[str, Any], sampling: FrameSampling, *, seed: int = 0, epoch: int = 0,
                         sample_id: int = 0) -> np.ndarray:
    """Frame indices (positions in presentation order) for one sample, sorted, repeats allowed."""
    pts = video_pts(meta)
    tb = time_base(meta)
    dur_s = float(meta["duration_s"])
    t0, length = draw_window(dur_s, sampling.window_s, sampling.start, seed=seed, epoch=epoch,
                             sample_id=sample_id)
    n = sampling.num_frames
    times = t0 + np.arange(n, dtype=np.float64) * (length / n)
    # times -> pts units (exact rational scale, then floor with a tiny tolerance for float error)
    ticks = np.floor(times * (tb.denominator / tb.numerator) + 1e-6).astype(np.int64) + int(pts[0])
    idx = np.searchsorted(pts, ticks, side="right") - 1
    return np.clip(idx, 0, pts.size - 1).astype(np.int64)


__all__ = ["STARTS", "AudioSampling", "FrameSampling", "draw_window", "sample_frame_indices"]
