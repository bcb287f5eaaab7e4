"""Image decode (JPEG, PNG, WebP, anything Pillow reads) with reduced-size JPEG decoding.

JPEG can decode at 1/2, 1/4 or 1/8 scale inside libjpeg (``Image.draft``); we ask for the
smallest scale that still leaves the crop at least as large as the output, so a 4000x3000 photo
resized to 224 decodes ~64x fewer pixels. Crop and resize are one Pillow call
(``resize(size, box=crop)``), so no intermediate image is made.

Example::

    img = decode_image(data, size=(224, 224))                    # uint8 (224, 224, 3)
    img = decode_image(data, size=(224, 224), crop=(0, 0, 500, 500))  # crop (y, x, h, w) in source pixels
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from ..errors import DecodeError

RESAMPLE = {"BILINEAR": Image.Resampling.BILINEAR, "BICUBIC": Image.Resampling.BICUBIC,
            "AREA": Image.Resampling.BOX, "LANCZOS": Image.Resampling.LANCZOS,
            "POINT": Image.Resampling.NEAREST, "FAST_BILINEAR": Image.Resampling.BILINEAR}


def decode_image(data: bytes | bytearray | memoryview, *, size: tuple[int, int] | None = None,
                 crop: tuple[float, float, float, float] | None = None, interpolation: str = "BILINEAR",
                 draft: bool = True, sample: int | None = None) -> np.ndarray:
    """Decode an image to uint8 RGB (H, W, 3); optional ``crop=(y, x, h, w)`` (source pixels) then resize.

    ``draft`` lets JPEG decode at a reduced scale (never below the output size of the crop).
    Bad bytes raise :class:`DecodeError` naming ``sample``.
    """
    interp = interpolation.upper()
    if interp not in RESAMPLE:
        raise ValueError(f"interpolation must be one of {tuple(RESAMPLE)}, got {interpolation!r}")
    try:
        img = Image.open(io.BytesIO(data))
        W, H = img.size
        y, x, ch, cw = crop if crop is not None else (0, 0, H, W)
        if draft and size is not None and img.format == "JPEG":
            # ask for a scale where the crop still covers the output size
            need_w = int(np.ceil(W * size[1] / cw))
            need_h = int(np.ceil(H * size[0] / ch))
            img.draft("RGB", (need_w, need_h))
        sx, sy = img.size[0] / W, img.size[1] / H  # draft may have scaled the image down
        img = img.convert("RGB")
        box = (x * sx, y * sy, (x + cw) * sx, (y + ch) * sy)
        if size is not None:
            img = img.resize((size[1], size[0]), RESAMPLE[interp], box=box)
        elif crop is not None:
            img = img.crop(tuple(round(v) for v in box))
        return np.array(img, dtype=np.uint8)  # a writable copy (asarray of a PIL image is read-only)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DecodeError(f"image decode failed: {type(e).__name__}: {e}", sample=sample) from e


__all__ = ["RESAMPLE", "decode_image"]
