"""Deterministic, serializable transform specs: decode -> crop -> resize -> flip -> normalize -> dtype.

Every random choice (video window, crop box, flip) is drawn from ``keyed_rng(seed, epoch,
sample_id, purpose)``; nothing reads global random state, so the output is a pure function of
(bytes, meta, spec, seed, epoch, sample_id) and is the same on the host and the storage node.
``spec.fingerprint()`` records the spec and library versions; ``output_hash(tensor)`` proves two
runs produced the same tensor.

Crop kinds (``crop``): "none" (resize the whole frame), "center"/"random" (the largest box with the
output aspect ratio, centred or at a random position), "random_resized" (torchvision's
RandomResizedCrop rule: area fraction in ``scale``, aspect in ``ratio``, 10 tries, then centre).
Video frames are resized in swscale so that the crop box lands on the output size, then sliced;
images are cropped and resized in one Pillow call.

Example::

    spec = TransformSpec(modality="video", frames=FrameSampling(8, 4.0), size=(224, 224),
                         crop="random_resized", flip=0.5, mean=(0.485, 0.456, 0.406),
                         std=(0.229, 0.224, 0.225), dtype="float32")
    x = spec.apply(data, meta, seed=1, epoch=0, sample_id=42)   # torch float32 (8, 3, 224, 224)
    assert TransformSpec.from_json(spec.to_json()) == spec
"""
from __future__ import annotations

import dataclasses
import json
import math
import platform
from typing import Any

import numpy as np
import xxhash

from .audio import decode_audio
from .image import decode_image
from .probe import INDEX_VERSION, probe_media
from .rng import keyed_rng
from .sampling import AudioSampling, FrameSampling, draw_window
from .video import INTERPOLATIONS, decode_video

MODALITIES = ("video", "image", "audio")
CROPS = ("none", "center", "random", "random_resized")
DTYPES = ("uint8", "float32", "float16", "bfloat16")
LAYOUTS = ("channels_first", "channels_last")
OUTPUTS = ("torch", "numpy")


def _tuple(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    """A finite number (not a bool): specs arrive as JSON from other hosts, where 1e999 parses as infinity."""
    return (_is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(v)


def _reals(v: Any, name: str, lengths: tuple[int, ...]) -> None:
    if not isinstance(v, tuple) or len(v) not in lengths or not all(_is_real(x) for x in v):
        raise ValueError(f"{name} must be {' or '.join(map(str, lengths))} finite numbers, got {v!r}"[:200])


@dataclasses.dataclass(frozen=True)
class TransformSpec:
    """What to do with one media sample; JSON round-trips (``to_json`` / ``from_json``)."""

    modality: str = "video"
    frames: FrameSampling | None = None
    audio: AudioSampling | None = None
    size: tuple[int, int] | None = None
    crop: str = "none"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.0
    interpolation: str = "BILINEAR"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    dtype: str = "uint8"
    layout: str = "channels_first"
    output: str = "torch"

    def __post_init__(self) -> None:
        for name in ("size", "scale", "ratio", "mean", "std"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))
        if isinstance(self.frames, dict):
            object.__setattr__(self, "frames", FrameSampling.from_dict(self.frames))
        if isinstance(self.audio, dict):
            object.__setattr__(self, "audio", AudioSampling.from_dict(self.audio))
        # types first: a spec is also a request from another host (a node's register_job), checked whole here
        if self.frames is not None and not isinstance(self.frames, FrameSampling):
            raise ValueError(f"frames must be a FrameSampling (object) or None, got {self.frames!r}"[:200])
        if self.audio is not None and not isinstance(self.audio, AudioSampling):
            raise ValueError(f"audio must be an AudioSampling (object) or None, got {self.audio!r}"[:200])
        if self.size is not None and (not isinstance(self.size, tuple) or not all(_is_int(x) for x in self.size)):
            raise ValueError(f"size must be (height, width) of positive ints, got {self.size!r}"[:200])
        _reals(self.scale, "scale", (2,))
        _reals(self.ratio, "ratio", (2,))
        if not _is_real(self.flip):
            raise ValueError(f"flip is a probability in [0, 1], got {self.flip!r}"[:200])
        for name in ("mean", "std"):  # per channel (3, RGB) or one for all, broadcast over the channels-last pixels
            if getattr(self, name) is not None:
                _reals(getattr(self, name), name, (1, 3))
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std must be > 0, got {self.std!r}")
        if self.modality == "video" and self.frames is None:
            object.__setattr__(self, "frames", FrameSampling())
        if self.modality == "audio" and self.audio is None:
            object.__setattr__(self, "audio", AudioSampling())
        for name, allowed in (("modality", MODALITIES), ("crop", CROPS), ("dtype", DTYPES),
                              ("layout", LAYOUTS), ("output", OUTPUTS), ("interpolation", INTERPOLATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise ValueError(f"size must be (height, width) of positive ints, got {self.size!r}")
        if self.crop != "none" and self.size is None:
            raise ValueError(f"crop={self.crop!r} needs size=(height, width)")
        if not 0.0 <= self.flip <= 1.0:
            raise ValueError(f"flip is a probability in [0, 1], got {self.flip!r}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std, or neither")
        if self.mean is not None and self.dtype == "uint8":
            raise ValueError("normalize (mean/std) needs a float dtype")
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1], got {self.scale}, {self.ratio}")

    # serialization
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformSpec:
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> TransformSpec:
        return cls.from_dict(json.loads(s))

    def fingerprint(self) -> dict[str, Any]:
        """The spec, the library versions that shape its output, and a digest of both."""
        versions = library_versions()
        digest = xxhash.xxh3_64_hexdigest(json.dumps({"spec": self.to_dict(), "versions": versions}, sort_keys=True).encode())
        return {"spec": self.to_dict(), "versions": versions, "digest": digest}

    # random draws
    def crop_box(self, width: int, height: int, *, seed: int, epoch: int, sample_id: int) -> tuple[float, float, float, float] | None:
        """The crop box (y, x, h, w) in source pixels for this key, or None for no crop."""
        if self.crop == "none":
            return None
        out_h, out_w = self.size
        if self.crop in ("center", "random"):
            target = out_w / out_h
            cw, ch = (height * target, height) if width / height > target else (width, width / target)
            if self.crop == "center":
                return ((height - ch) / 2, (width - cw) / 2, ch, cw)
            u = keyed_rng(seed=seed, epoch=epoch, sample_id=sample_id, purpose="crop").random(2)
            return (u[0] * (height - ch), u[1] * (width - cw), ch, cw)
        rng = keyed_rng(seed=seed, epoch=epoch, sample_id=sample_id, purpose="crop")
        area = width * height
        log_r = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            a = area * rng.uniform(self.scale[0], self.scale[1])
            r = math.exp(rng.uniform(*log_r))
            cw, ch = math.sqrt(a * r), math.sqrt(a / r)
            if 0 < cw <= width and 0 < ch <= height:
                return (rng.uniform(0, height - ch), rng.uniform(0, width - cw), ch, cw)
        r_in = width / height  # fallback: centre crop clamped to the ratio range
        cw, ch = ((height * self.ratio[0], height) if r_in < self.ratio[0] else
                  (height * self.ratio[1], height) if r_in > self.ratio[1] else (width, height))
        cw, ch = min(cw, width), min(ch, height)
        return ((height - ch) / 2, (width - cw) / 2, ch, cw)

    def flips(self, *, seed: int, epoch: int, sample_id: int) -> bool:
        if self.flip <= 0:
            return False
        return bool(keyed_rng(seed=seed, epoch=epoch, sample_id=sample_id, purpose="flip").random() < self.flip)

    # the transform
    def apply(self, data: bytes | bytearray | memoryview, meta: dict[str, Any] | None = None, *, seed: int = 0,
              epoch: int = 0, sample_id: int = 0, threads: int = 1):
        """Decode and transform one sample; returns a torch tensor (or numpy with output="numpy")."""
        key = {"seed": seed, "epoch": epoch, "sample_id": sample_id}
        if self.modality == "audio":
            return self._finish(self._audio(data, meta, key), spatial=False)
        if meta is None:
            meta = probe_media(data, self.modality, sample=sample_id)
        box = self.crop_box(meta["width"], meta["height"], **key)
        if self.modality == "image":
            x = decode_image(data, size=self.size, crop=box, interpolation=self.interpolation, sample=sample_id)
        else:
            size, crop = self.size, None
            if box is not None:  # resize so that the crop box becomes exactly `size`, then slice it out
                y, x0, ch, cw = box
                out_h, out_w = self.size
                sh, sw = out_h / ch, out_w / cw
                full = (max(out_h, round(meta["height"] * sh)), max(out_w, round(meta["width"] * sw)))
                cy = min(max(0, round(y * sh)), full[0] - out_h)
                cx = min(max(0, round(x0 * sw)), full[1] - out_w)
                size, crop = full, (cy, cx, out_h, out_w)
            x = decode_video(data, meta, self.frames, size=size, crop=crop, interpolation=self.interpolation,
                             threads=threads, **key)
        if self.flips(**key):
            x = x[..., ::-1, :]
        return self._finish(x, spatial=True)

    def _audio(self, data, meta, key) -> np.ndarray:
        if meta is None:
            meta = probe_media(data, "audio", sample=key["sample_id"])
        a = self.audio
        t0, length = draw_window(float(meta["duration_s"]), a.window_s, a.start, **key)
        return decode_audio(data, start_s=t0, duration_s=length, rate=a.rate, mono=a.mono,
                            sample=key["sample_id"])

    def _finish(self, x: np.ndarray, *, spatial: bool):
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x))
        if spatial:
            if self.dtype != "uint8":
                t = t.to(torch.float32).div_(255.0)
                if self.mean is not None:
                    mean = torch.tensor(self.mean, dtype=torch.float32)
                    std = torch.tensor(self.std, dtype=torch.float32)
                    t = t.sub_(mean).div_(std)  # channels are last here
            if self.layout == "channels_first":
                t = t.movedim(-1, -3).contiguous()
        t = t.to(getattr(torch, self.dtype)) if self.dtype != "uint8" or spatial else t
        return t.numpy() if self.output == "numpy" and self.dtype != "bfloat16" else t


def library_versions() -> dict[str, Any]:
    """Versions of everything that can change decoded pixels."""
    import av
    import PIL
    import torch

    return {"av": av.__version__, "ffmpeg": {k: list(v) for k, v in av.library_versions.items()},
            "pillow": PIL.__version__, "numpy": np.__version__, "torch": torch.__version__.split("+")[0],
            "media_index": INDEX_VERSION, "machine": platform.machine()}


def output_hash(x) -> str:
    """xxh3_64 hex digest of a tensor/array's dtype, shape and bytes (to compare runs or machines)."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            dtype = str(x.dtype)
            shape = tuple(x.shape)
            x = x.detach().cpu().contiguous()
            arr = x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
        else:
            arr = np.ascontiguousarray(x)
            dtype, shape = str(arr.dtype), arr.shape
    except ImportError:  # pragma: no cover
        arr = np.ascontiguousarray(x)
        dtype, shape = str(arr.dtype), arr.shape
    h = xxhash.xxh3_64()
    h.update(f"{dtype}{shape}".encode())
    h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.hexdigest()


__all__ = ["CROPS", "DTYPES", "LAYOUTS", "OUTPUTS", "TransformSpec", "library_versions", "output_hash"]
