"""Synthetic media for tests, benches and demos: small real clips encoded with PyAV.

Video frames come from FFmpeg's ``testsrc2`` (moving pattern with a frame counter, so every
frame is distinct). Source frames are stripped of their picture type, else libx264 would obey
it and make every frame a keyframe.

Files as real-world tools write them come from the ``ffmpeg`` command-line tool (``ffmpeg_cli``: Debian's
build has encoders PyAV's wheel lacks, e.g. libxvid, whose AVI output packs B-frames DivX-style), and a few
byte-level edits reproduce what downloads and old muxers do to files (``drop_avi_index``,
``with_not_coded_vop``).

Example::

    mp4 = make_video(codec="libx264", width=160, height=120, seconds=2, gop=12)   # bytes
    make_video("clip.mp4", seconds=60, width=1280, height=720, gop=60)            # to a file
    avi = ffmpeg_cli(["-f", "lavfi", "-i", "testsrc2=size=96x64:rate=25:duration=2", "-c:v", "libxvid",
                      "-bf", "2"], out_format="avi")                              # packed B-frames
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import av
import numpy as np
from av.video.frame import PictureType
from PIL import Image

CONTAINERS = {"libx264": "mp4", "libvpx-vp9": "webm", "mpeg4": "mp4", "libsvtav1": "mp4"}


@contextlib.contextmanager
def scheduling_kept() -> Iterator[None]:
    """Restore the calling thread's scheduling policy after the block.

    SVT-AV1 (``libsvtav1`` in PyAV's FFmpeg), run as root, leaves the thread that opens an encoder at SCHED_FIFO
    priority 99. Every process that thread starts afterwards inherits it, and equal-priority FIFO tasks never
    share a CPU: a busy child then starves the others for good (a vfork that never returns, a node that can neither
    start nor die of SIGKILL). The CI runs as root, so the whole test session would turn real-time.

    >>> with scheduling_kept():
    ...     clip = make_video(codec="libsvtav1", width=64, height=64, seconds=0.2)  # doctest: +SKIP
    """
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def make_video(path: str | None = None, *, codec: str = "libx264", width: int = 160, height: int = 120,
               seconds: float = 2.0, fps: int = 30, gop: int | None = None, bframes: int | None = None,
               container: str | None = None, options: dict[str, str] | None = None) -> bytes | None:
    """Encode a testsrc2 clip; returns the bytes (or writes ``path`` atomically and returns None). The caller's
    scheduling policy is kept whatever the encoder does to it (:func:`scheduling_kept`)."""
    with scheduling_kept():
        return _encode_video(path, codec=codec, width=width, height=height, seconds=seconds, fps=fps, gop=gop,
                             bframes=bframes, container=container, options=options)


def _encode_video(path: str | None, *, codec: str, width: int, height: int, seconds: float, fps: int,
                  gop: int | None, bframes: int | None, container: str | None,
                  options: dict[str, str] | None) -> bytes | None:
    fmt = container or CONTAINERS.get(codec, "mp4")
    src = av.open(f"testsrc2=size={width}x{height}:rate={fps}:duration={seconds}", format="lavfi")
    sink: Any = io.BytesIO() if path is None else path + ".part"
    out = av.open(sink, "w", format=fmt)
    opts = dict(options or {})
    if codec == "libvpx-vp9":
        opts.setdefault("deadline", "realtime")
        opts.setdefault("cpu-used", "8")
    if codec == "libsvtav1":
        opts.setdefault("preset", "12")
    s = out.add_stream(codec, rate=fps, options=opts)
    s.width, s.height, s.pix_fmt = width, height, "yuv420p"
    if gop is not None:
        s.codec_context.gop_size = gop
    if bframes is not None:
        s.codec_context.max_b_frames = bframes
    for frame in src.decode(video=0):
        frame.pts = None
        frame.pict_type = PictureType.NONE
        for p in s.encode(frame):
            out.mux(p)
    for p in s.encode():
        out.mux(p)
    out.close()
    src.close()
    if path is None:
        return sink.getvalue()
    os.replace(sink, path)
    return None


def remux(data: bytes, *, container: str = "matroska", pts_from_dts: bool = False) -> bytes:
    """Copy the video packets into another container; ``pts_from_dts`` writes pts = dts (a real-world
    muxer bug: with B-frames the decoder then emits frames with non-increasing pts)."""
    src = av.open(io.BytesIO(data))
    ins = src.streams.video[0]
    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    os_ = out.add_stream_from_template(ins)
    for p in src.demux(ins):
        if p.dts is None:
            continue
        if pts_from_dts:
            p.pts = p.dts
        p.stream = os_
        out.mux(p)
    out.close()
    src.close()
    return buf.getvalue()


def ffmpeg_cli(args: Sequence[str], *, out_format: str, data: bytes | None = None, timeout: float = 120) -> bytes:
    """Run the ffmpeg command-line tool and return what it wrote. ``data`` (if given) is the input file,
    named ``{in}`` in ``args``; the output file (format ``out_format``) is appended to ``args``."""
    exe = shutil.which("ffmpeg")
    if exe is None:
        raise FileNotFoundError("the ffmpeg command-line tool is not installed (apt-get install ffmpeg)")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "in"), os.path.join(tmp, "out")
        if data is not None:
            with open(src, "wb") as f:
                f.write(data)
        cmd = [exe, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
               *(a.replace("{in}", src) for a in args), "-f", out_format, out]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"ffmpeg failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        with open(out, "rb") as f:
            return f.read()


def drop_avi_index(data: bytes) -> bytes:
    """The AVI with its ``idx1`` index renamed to a JUNK chunk: as if it were never written."""
    at = data.rfind(b"idx1")
    if at < 0:
        raise ValueError("no idx1 chunk in these bytes")
    return data[:at] + b"JUNK" + data[at + 4:]


_VOP_START = b"\x00\x00\x01\xb6"


def not_coded_vop(vop: bytes, time_increment_bits: int) -> bytes:
    """An MPEG-4 part 2 VOP cut down to its header with ``vop_coded = 0`` (same type and time): a legal
    "not coded" VOP, which Xvid writes for dropped frames and after which the previous picture is shown."""
    at = vop.find(_VOP_START)
    if at < 0:
        raise ValueError("no VOP start code")
    bits = "".join(f"{b:08b}" for b in vop[at + 4:at + 12])
    pos = 2                      # vop_coding_type
    while bits[pos] == "1":      # modulo_time_base: ones, then a zero
        pos += 1
    pos += 1 + 1 + time_increment_bits + 1  # the zero, marker, vop_time_increment, marker
    head = bits[:pos] + "0"      # vop_coded = 0
    head += "0" + "1" * (-(len(head) + 1) % 8)  # stuffing to the byte boundary
    return vop[:at + 4] + int(head, 2).to_bytes(len(head) // 8, "big")


def with_not_coded_vop(data: bytes, *, nth_b: int, fps: int) -> tuple[bytes, int]:
    """Copy of an MPEG-4 part 2 clip (``make_video(codec="mpeg4", bframes=...)``, ``fps`` as encoded) with
    its ``nth_b``-th B-VOP (0-based) replaced by a not-coded VOP; returns (bytes, pts of that frame). The
    index lists that pts; the decoder never outputs a picture for it."""
    src = av.open(io.BytesIO(data))
    ins = src.streams.video[0]
    buf = io.BytesIO()
    out = av.open(buf, "w", format="mp4")
    os_ = out.add_stream_from_template(ins)
    seen, hit = 0, None
    for p in src.demux(ins):
        if p.dts is None:
            continue
        raw = bytes(p)
        at = raw.find(_VOP_START)
        if hit is None and at >= 0 and raw[at + 4] >> 6 == 2:  # vop_coding_type 2: B
            seen += 1
            if seen > nth_b:
                q = av.Packet(not_coded_vop(raw, max(1, (fps - 1).bit_length())))
                q.pts, q.dts, q.time_base, hit = p.pts, p.dts, p.time_base, p.pts
                p = q
        p.stream = os_
        out.mux(p)
    out.close()
    src.close()
    if hit is None:
        raise ValueError(f"the clip has no B-VOP number {nth_b}")
    return buf.getvalue(), int(hit)


def make_image(fmt: str = "JPEG", *, width: int = 320, height: int = 240, seed: int = 0, **save: Any) -> bytes:
    """A smooth colour image (plus mild noise) encoded as JPEG/PNG/WEBP."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    noise = np.random.default_rng(seed).normal(0, 6, (height, width, 3))
    rgb = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], -1) + noise
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format=fmt, **save)
    return buf.getvalue()


def make_audio(*, seconds: float = 2.0, rate: int = 48000, freq: float = 440.0, codec: str = "aac",
               container: str = "mp4", channels: int = 1) -> bytes:
    """A sine tone encoded with PyAV (aac/mp4, flac/flac, pcm_s16le/wav, libopus/ogg...)."""
    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    layout = "mono" if channels == 1 else "stereo"
    s = out.add_stream(codec, rate=rate, layout=layout)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    pcm = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    fs = s.codec_context.frame_size or 1024
    fmt = s.codec_context.format.name
    for i in range(0, n, fs):
        chunk = np.tile(pcm[i:i + fs], (channels, 1))
        if fmt in ("s16", "s16p"):
            chunk = (chunk * 32767).astype(np.int16)
        if not fmt.endswith("p"):  # packed: one row, interleaved
            chunk = chunk.T.reshape(1, -1)
        f = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format=fmt, layout=layout)
        f.sample_rate = rate
        f.pts = i
        for p in s.encode(f):
            out.mux(p)
    for p in s.encode():
        out.mux(p)
    out.close()
    return buf.getvalue()


__all__ = ["drop_avi_index", "ffmpeg_cli", "make_audio", "make_image", "make_video", "not_coded_vop", "remux",
           "with_not_coded_vop"]
