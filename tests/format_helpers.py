"""Small real inputs for the format tests: token arrays, JSONL/Parquet files, images, WAV audio, MP4 video."""
from __future__ import annotations

import io
import json
import os
import wave

import numpy as np


def random_tokens(rng: np.random.Generator, n_docs: int, *, max_len: int = 300, vocab: int = 50000,
                  dtype=np.uint16) -> tuple[np.ndarray, np.ndarray]:
    """(flat tokens, lengths) of ``n_docs`` documents, some empty."""
    lengths = rng.integers(0, max_len, size=n_docs).astype(np.int64)
    tokens = rng.integers(0, vocab, size=int(lengths.sum())).astype(dtype)
    return tokens, lengths


def split(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def png_bytes(seed: int, size: tuple[int, int] = (16, 12)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, size=(8, 8, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def wav_bytes(seconds: float = 0.05, rate: int = 8000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 440 * t) * 20000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def mp4_bytes(frames: int = 6, size: int = 32, fps: int = 10) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for i in range(frames):
            img = np.full((size, size, 3), i * 30 % 255, dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def make_media_folder(root: str) -> dict[str, bytes]:
    """A folder with images, audio and video (one in a subfolder) plus a non-media file; returns rel -> bytes."""
    files = {
        "a.png": png_bytes(1),
        "b.jpg": jpeg_bytes(2),
        "sub/c.png": png_bytes(3, (5, 7)),
        "tone.wav": wav_bytes(),
        "clip.mp4": mp4_bytes(),
    }
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("not media")
    return files
