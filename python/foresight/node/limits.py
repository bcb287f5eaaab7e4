"""Caps on the work one job may ask of a node, checked when it registers (before anything is decoded).

A job's transform specs decide how much a node produces: output bytes per sample (size x frames x channels x
dtype, or the source frame when ``size`` is None), per step part (samples in the rank's share x the largest sample),
and decode memory (each decode thread's working set: a video's frames resized so that the crop box lands on
``size`` -- a small crop box means a large intermediate --, the float conversion, the output; plus the stacked
step; the source frame is the operator's data and is not counted). Bounds that depend on the source (size None,
video crops, audio) come from the datasets' media metadata, read once per dataset and modality by Arrow's regex
kernels over the maps' meta column and kept (:func:`source_extents`).

A job over a cap is refused with one line naming the spec field and both numbers.

Example::

    limits = WorkLimits(max_output_bytes_per_sample=64 << 20, max_step_bytes=1 << 30, max_decode_bytes=2 << 30)
    check_job(limits, specs, datasets, samples_per_step=32, decode_threads=4)   # ProtocolError if over
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass

import numpy as np

from foresight.errors import ProtocolError
from foresight.format import Modality

CHANNELS = 3  # images and video frames decode to RGB
ITEMSIZE = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4}
_META_CHUNK = 1024


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
    """Extents of the samples of modality ``code`` in ``ds``, from their metadata: the numbers are pulled out of
    the maps' meta JSON column by Arrow's regex kernels (no Python object per sample; a video's frame index is
    never parsed), once per dataset fingerprint and modality."""
    key = (str(getattr(ds, "path", id(ds))), str(ds.fingerprint), int(code))
    with _extents_lock:
        got = _extents.get(key)
    if got is not None:
        return got
    width = height = pixels = channels = samples = 0
    duration = 0.0
    lo_aspect = hi_aspect = 1.0
    for texts in _meta_texts(ds, code):
        samples += len(texts)
        ws, hs = _numbers(texts, "width"), _numbers(texts, "height")
        width, height = max(width, int(ws.max(initial=0))), max(height, int(hs.max(initial=0)))
        pixels = max(pixels, int((ws * hs).max(initial=0)))
        channels = max(channels, int(_numbers(texts, "channels").max(initial=0)))
        duration = max(duration, float(_numbers(texts, "duration_s").max(initial=0)))
        both = (ws > 0) & (hs > 0)
        if both.any():
            r = ws[both] / hs[both]
            lo_aspect, hi_aspect = min(lo_aspect, float(r.min())), max(hi_aspect, float(r.max()))
    got = SourceExtents(samples=samples, max_width=width, max_height=height, max_pixels=pixels,
                        min_aspect=lo_aspect, max_aspect=hi_aspect, max_duration_s=duration, max_channels=channels)
    with _extents_lock:
        _extents[key] = got
    return got


def _meta_texts(ds, code: int):
    """The meta JSON texts of ``ds``'s samples of modality ``code``, one Arrow string array per shard map (the
    format's mapped column); formats without one go through ``meta_many`` in bounded chunks."""
    import pyarrow as pa

    maps = getattr(ds, "_maps", None)
    if maps and all(hasattr(m, "_meta") for m in maps):
        for m in maps:
            rows = np.flatnonzero(np.asarray(m.modality) == code)
            if len(rows):
                yield m._meta.take(pa.array(rows, type=pa.int64()))
        return
    ids = np.flatnonzero(np.asarray(ds.modality_codes()) == code)
    for lo in range(0, len(ids), _META_CHUNK):
        yield pa.array([json.dumps(m) for m in ds.meta_many(ids[lo: lo + _META_CHUNK])], type=pa.large_string())


def _numbers(texts, name: str) -> np.ndarray:
    """The number under top-level-looking key ``name`` in each JSON text (0 where absent). A key inside a string
    value cannot match: its quotes are escaped there, and the pattern wants an unescaped quote after ``{`` or
    ``,``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    number = r"(?P<v>[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
    found = pc.extract_regex(texts, r'(?:^|[{,])\s*"' + name + r'"\s*:\s*' + number)
    values = pc.if_else(found.is_valid(), found.field("v"), pa.scalar("0", found.type.field(0).type))
    out = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    return np.where(np.isfinite(out), out, 0.0)


def needs_source(spec) -> bool:
    """Whether a bound of ``spec`` depends on the media: source-sized output (``size`` None), a video crop (its
    intermediate frame depends on the source's aspect ratio), audio (length, channels)."""
    return spec.modality == "audio" or spec.size is None or (spec.modality == "video" and spec.crop != "none")


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
    out_px = ext.max_pixels if spec.size is None else spec.size[0] * spec.size[1]
    frames = spec.frames.num_frames if spec.modality == "video" else 1
    elems = frames * CHANNELS * out_px
    out = elems * item
    # a video's frames resized so that the crop box lands on ``size``, before the crop (the source frame itself
    # is the operator's data, not shaped by the spec, and is not counted)
    inter = frames * CHANNELS * math.ceil(out_px / crop_fraction(spec, ext)) if spec.modality == "video" else 0
    return SampleBounds(out, inter + (elems * 4 if floats else 0) + out)


def check_job(limits: WorkLimits, specs: dict, datasets: list, *, samples_per_step: int,
              decode_threads: int) -> dict:
    """Refuse (:class:`ProtocolError`, one line naming the spec field) a job whose specs can make a sample, a step
    part or its decoding larger than the node's caps; returns the bounds (``output_bytes_per_sample``,
    ``step_bytes``, ``decode_bytes``) for the registration's answer."""
    per_sample = {}
    for name, spec in specs.items():
        code = int(Modality.parse(name))
        bounds = [sample_bounds(spec, source_extents(ds, code) if needs_source(spec) else
                                SourceExtents(int(np.count_nonzero(np.asarray(ds.modality_codes()) == code))))
                  for ds in datasets]
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


__all__ = ["SampleBounds", "SourceExtents", "WorkLimits", "check_job", "crop_fraction", "needs_source",
           "sample_bounds", "source_extents"]
