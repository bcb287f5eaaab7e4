"""Caps on the work one job may ask of a node, checked when it registers (before anything is decoded).

A job's transform specs decide how much a node produces: output bytes per sample (size x frames x channels x
dtype, or the source frame when ``size`` is None), per step part (samples in the rank's share x the largest sample),
and decode memory (each decode thread's working set: the source frame, a video's frames resized so that the crop
box lands on ``size`` -- a small crop box means a large intermediate --, the float conversion, the output; plus the
stacked step). Bounds that depend on the source (frame sizes and aspect ratios, audio length and channels) come
from the datasets' media metadata, scanned once per dataset and modality and kept (:func:`source_extents`).

A job over a cap is refused with one line naming the spec field and both numbers.

Example::

    limits = WorkLimits(max_output_bytes_per_sample=64 << 20, max_step_bytes=1 << 30, max_decode_bytes=2 << 30)
    check_job(limits, specs, datasets, samples_per_step=32, decode_threads=4)   # ProtocolError if over
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from foresight.errors import ProtocolError

CHANNELS = 3  # images and video frames decode to RGB
ITEMSIZE = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4}
_META_CHUNK = 1 << 16


@dataclass(frozen=True)
class WorkLimits:
    """The node's caps (``foresight node serve --max-output-bytes-per-sample, --max-step-bytes,
    --max-decode-bytes-per-job``); 0 turns one off."""

    max_output_bytes_per_sample: int = 256 << 20
    max_step_bytes: int = 2 << 30
    max_decode_bytes: int = 4 << 30


@dataclass(frozen=True)
class SourceExtents:
    """The largest (and most elongated) source media of one modality in one dataset."""

    samples: int
    max_width: int = 0
    max_height: int = 0
    max_pixels: int = 0
    min_aspect: float = 1.0  # width / height
    max_aspect: float = 1.0
    max_duration_s: float = 0.0
    max_channels: int = 0


@dataclass(frozen=True)
class SampleBounds:
    output_bytes: int
    decode_bytes: int  # one decode thread's working set for one sample, output included


_extents: dict[tuple[str, str, int], SourceExtents] = {}
_extents_lock = threading.Lock()


def source_extents(ds, code: int) -> SourceExtents:
    """Extents of the samples of modality ``code`` in ``ds``, from their metadata (batched per shard, once per
    dataset fingerprint and modality)."""
    from foresight.loader.meta import sample_metas

    key = (str(getattr(ds, "path", id(ds))), str(ds.fingerprint), int(code))
    with _extents_lock:
        got = _extents.get(key)
    if got is not None:
        return got
    ids = np.flatnonzero(np.asarray(ds.modality_codes()) == code)
    width = height = pixels = channels = 0
    duration = 0.0
    lo_aspect = hi_aspect = 1.0
    for lo in range(0, len(ids), _META_CHUNK):
        metas = sample_metas([ds], None, ids[lo: lo + _META_CHUNK])
        ws = np.asarray([_number(m, "width") for m in metas], dtype=np.float64)
        hs = np.asarray([_number(m, "height") for m in metas], dtype=np.float64)
        width, height = max(width, int(ws.max(initial=0))), max(height, int(hs.max(initial=0)))
        pixels = max(pixels, int((ws * hs).max(initial=0)))
        channels = max(channels, int(max((_number(m, "channels") for m in metas), default=0)))
        duration = max(duration, max((_number(m, "duration_s") for m in metas), default=0.0))
        both = (ws > 0) & (hs > 0)
        if both.any():
            r = ws[both] / hs[both]
            lo_aspect, hi_aspect = min(lo_aspect, float(r.min())), max(hi_aspect, float(r.max()))
    got = SourceExtents(samples=len(ids), max_width=width, max_height=height, max_pixels=pixels,
                        min_aspect=lo_aspect, max_aspect=hi_aspect, max_duration_s=duration, max_channels=channels)
    with _extents_lock:
        _extents[key] = got
    return got


def _number(meta: dict, name: str) -> float:
    v = meta.get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def crop_fraction(spec, ext: SourceExtents) -> float:
    """The smallest share of the source frame a crop box of ``spec`` can cover (1 without a crop): a video is
    resized so that the box becomes ``size``, so the intermediate frame is ``size`` / this."""
    if spec.crop == "none" or spec.size is None:
        return 1.0
    out_h, out_w = spec.size
    target = out_w / out_h
    # the largest box of the output's aspect inside a source of aspect a covers min(a / t, t / a) of it
    fixed = min(min(a / target, target / a) for a in (ext.min_aspect, ext.max_aspect))
    if spec.crop in ("center", "random"):
        return fixed
    # random_resized: an area share of at least scale[0], or (after 10 misses) a box clamped to the ratio range,
    # which covers ratio[1] / a of a source wider than ratio[1]
    fallback = min(1.0, spec.ratio[1] / ext.max_aspect)
    return max(min(spec.scale[0], fallback), 1e-9)


def sample_bounds(spec, ext: SourceExtents) -> SampleBounds:
    """The most one sample of ``spec`` can take: output bytes and a decode thread's working set."""
    if ext.samples == 0:
        return SampleBounds(0, 0)
    item = ITEMSIZE[spec.dtype]
    floats = spec.dtype != "uint8" or spec.modality == "audio"  # converted through float32
    if spec.modality == "audio":
        a = spec.audio
        seconds = ext.max_duration_s if a.window_s is None else min(a.window_s, ext.max_duration_s or a.window_s)
        elems = (1 if a.mono else max(1, ext.max_channels)) * math.ceil(a.rate * seconds + a.rate)
        out = elems * 4
        return SampleBounds(out, 2 * out)
    if spec.size is None:
        out_px = ext.max_pixels
    else:
        out_px = spec.size[0] * spec.size[1]
    frames = spec.frames.num_frames if spec.modality == "video" else 1
    elems = frames * CHANNELS * out_px
    out = elems * item
    source = CHANNELS * ext.max_pixels
    if spec.modality == "video":
        inter = frames * CHANNELS * math.ceil(out_px / crop_fraction(spec, ext))  # resized frames before the crop
        work = source + inter
    else:
        work = source
    return SampleBounds(out, work + (elems * 4 if floats else 0) + out)


def check_job(limits: WorkLimits, specs: dict, datasets: list, *, samples_per_step: int,
              decode_threads: int) -> dict:
    """Refuse (:class:`ProtocolError`, one line naming the spec field) a job whose specs can make a sample, a step
    part or its decoding larger than the node's caps; returns the bounds (``output_bytes_per_sample``,
    ``step_bytes``, ``decode_bytes``) for the registration's answer."""
    from foresight.format import Modality

    per_sample = {}
    for name, spec in specs.items():
        code = int(Modality.parse(name))
        bounds = [sample_bounds(spec, source_extents(ds, code)) for ds in datasets]
        per_sample[name] = SampleBounds(max(b.output_bytes for b in bounds), max(b.decode_bytes for b in bounds))
    worst_out = max(per_sample, key=lambda n: per_sample[n].output_bytes)
    worst_work = max(per_sample, key=lambda n: per_sample[n].decode_bytes)
    out, work = per_sample[worst_out].output_bytes, per_sample[worst_work].decode_bytes
    step = samples_per_step * out
    decode = min(max(1, decode_threads), samples_per_step) * work + step
    for field, value, cap, flag in (
            (_field(specs[worst_out], worst_out), out, limits.max_output_bytes_per_sample,
             "--max-output-bytes-per-sample"),
            (f"{_field(specs[worst_out], worst_out)} x {samples_per_step} samples per step part", step,
             limits.max_step_bytes, "--max-step-bytes"),
            (f"{_field(specs[worst_work], worst_work)} decoded on {max(1, decode_threads)} threads", decode,
             limits.max_decode_bytes, "--max-decode-bytes-per-job")):
        if cap and value > cap:
            raise ProtocolError(f"job refused: {field} needs {_human(value)}, over the node's {flag} "
                                f"{_human(cap)}")
    return {"output_bytes_per_sample": out, "step_bytes": step, "decode_bytes": decode}


def _field(spec, name: str) -> str:
    """The spec fields that set a sample's size, as the request names them."""
    if spec.modality == "audio":
        return f"specs.{name}.audio (rate {spec.audio.rate}, window_s {spec.audio.window_s})"
    parts = [f"specs.{name}.size {list(spec.size) if spec.size else 'None (source frame)'}"]
    if spec.modality == "video":
        parts.append(f"frames.num_frames {spec.frames.num_frames}")
    if spec.crop != "none":
        parts.append(f"crop {spec.crop} (scale {list(spec.scale)}, ratio {list(spec.ratio)})")
    parts.append(f"dtype {spec.dtype}")
    return ", ".join(parts)


def _human(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


__all__ = ["SampleBounds", "SourceExtents", "WorkLimits", "check_job", "crop_fraction", "sample_bounds",
           "source_extents"]
