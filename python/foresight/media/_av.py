"""Shared PyAV plumbing: open media from bytes, keep FFmpeg logging out of Python, wrap errors.

Why logging matters: a Python log callback (``av.logging.set_level(<level>)`` installs one) is
called from FFmpeg's own worker threads. With frame threading, a decoder closing on one thread
while another thread holds the GIL waiting on it can deadlock. ``av.logging.set_level(None)``
(PyAV's default) routes FFmpeg logs to a C no-op callback, so no FFmpeg thread ever needs the GIL.

Example::

    with open_media(data, sample=7) as container:
        stream = container.streams.video[0]
"""
from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import av
import av.logging

from ..errors import DecodeError


def ensure_quiet_logging() -> None:
    """Make sure no Python log callback is installed (see module docstring for the deadlock)."""
    if av.logging.get_level() is not None:
        av.logging.set_level(None)


@contextlib.contextmanager
def open_media(data: bytes | bytearray | memoryview, **ctx: Any) -> Iterator[av.container.InputContainer]:
    """Open in-memory media bytes with PyAV (no temp files); errors become :class:`DecodeError`."""
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError, IndexError) as e:
        raise DecodeError(f"cannot open media: {e}", **ctx) from e
    try:
        yield container
    finally:
        container.close()


def first_stream(container: av.container.InputContainer, kind: str, **ctx: Any) -> Any:
    """The container's first ``kind`` ("video" or "audio") stream, with a decoder: damaged bytes can leave a stream
    whose codec FFmpeg cannot open (no ``codec_context``); that is a :class:`DecodeError` naming the sample, as a
    missing stream is."""
    streams = getattr(container.streams, kind)
    if not streams:
        raise DecodeError(f"no {kind} stream", **ctx)
    if streams[0].codec_context is None:
        raise DecodeError(f"{kind} stream has no decoder FFmpeg can open (damaged codec parameters?)", **ctx)
    return streams[0]


#: Exceptions that PyAV raises for bad media; anything else is a bug and propagates.
MEDIA_ERRORS = (av.FFmpegError, ValueError, OSError, IndexError, KeyError, EOFError, RuntimeError, ZeroDivisionError)
