"""Pack a folder of media files (images, audio, video) into foresight shards, one file per sample.

Files are taken in sorted relative-path order (the same folder always packs to the same dataset). Each sample's
meta holds ``file`` (relative path), ``bytes``, the ``caption`` when a captions file names it, and whatever
``foresight.media.probe.probe_media(data, modality)`` returns (keyframes, time base, fps, duration, size...). The
probe is imported lazily; when the media layer is not importable the basic meta is stored and packing goes on.

Captions: JSONL (``{"file": "a.jpg", "caption": "..."}``; ``file_name``/``filename``/``path`` and ``text`` also
work) or CSV with a header naming the same columns. Keys match the relative path, or else the base name.

Example::

    pack_media("photos/", "out/", captions="captions.jsonl")
"""
from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from ...errors import DecodeError, FormatError
from ..types import Modality
from ..writer import DatasetWriter
from .progress import PackProgress

__all__ = ["pack_media", "MEDIA_EXTENSIONS", "load_captions", "load_probe", "media_meta", "modality_of",
           "check_on_error"]

log = logging.getLogger(__name__)

MEDIA_EXTENSIONS: dict[str, Modality] = {
    **{e: Modality.IMAGE for e in (".jpg", ".jpeg", ".png", ".webp")},
    **{e: Modality.AUDIO for e in (".wav", ".flac", ".mp3", ".ogg")},
    **{e: Modality.VIDEO for e in (".mp4", ".mkv", ".webm", ".avi", ".mov")},
}
_FILE_KEYS = ("file", "file_name", "filename", "path", "name")
_TEXT_KEYS = ("caption", "text")


def _pick(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return None


def load_captions(path: str | os.PathLike) -> dict[str, str]:
    """Read a captions JSONL or CSV into ``{file: caption}``; malformed lines raise FormatError naming the line."""
    path = os.fspath(path)
    rows: list[tuple[int, Any]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            if path.lower().endswith(".csv"):
                rows = list(enumerate(csv.DictReader(f), start=2))
            else:
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        try:
                            rows.append((lineno, json.loads(line)))
                        except ValueError as e:
                            raise FormatError(f"bad JSON: {e}", path=path, line=lineno) from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"cannot read captions: {e}", path=path) from None
    out: dict[str, str] = {}
    for lineno, row in rows:
        if not isinstance(row, dict):
            raise FormatError("captions row is not an object", path=path, line=lineno)
        name, text = _pick(row, _FILE_KEYS), _pick(row, _TEXT_KEYS)
        if not isinstance(name, str) or not isinstance(text, str):
            raise FormatError(f"captions row needs a file ({'/'.join(_FILE_KEYS)}) and a caption "
                              f"({'/'.join(_TEXT_KEYS)}) string", path=path, line=lineno)
        out[os.path.normpath(name)] = text
    return out


Probe = Callable[[bytes, str], dict]


def modality_of(name: str) -> Modality | None:
    """The media modality of a file name by its extension (``a/b.JPG`` -> IMAGE), None if not a media file."""
    return MEDIA_EXTENSIONS.get(os.path.splitext(name)[1].lower())


def check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def media_meta(probe_media: Probe | None, data: bytes, mod: Modality, on_error: str, where: str) -> dict | None:
    """What the probe says of one media file (keyframes, time base, size...), ``{}`` without a probe; None when the
    probe rejected it and ``on_error == "skip"``, else a DecodeError naming ``where``."""
    if probe_media is None:
        return {}
    try:
        return dict(probe_media(data, mod.label))
    except Exception as e:
        if on_error == "skip":
            return None
        raise DecodeError(f"media probe rejected the file: {type(e).__name__}: {e}", path=where) from e


def load_probe() -> Probe | None:
    try:
        from ...media.probe import probe_media  # lazy: PyAV (media extra); packing works without it
    except Exception as e:  # the media layer is optional here: store basic meta instead
        log.warning("foresight.media.probe not importable (%s); packing with basic meta only", e)
        return None
    return probe_media


def media_files(folder: str) -> list[tuple[str, Modality]]:
    """Sorted ``(relative path, modality)`` of every media file under ``folder`` (hidden entries skipped)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            mod = modality_of(name)
            if mod is not None and not name.startswith("."):
                found.append((os.path.relpath(os.path.join(root, name), folder), mod))
    found.sort()
    return found


def pack_media(folder: str | os.PathLike, out: str | os.PathLike, *, captions: str | os.PathLike | None = None,
               align: int = 4096, shard_bytes: int = 1 << 30, probe: bool = True, on_error: str = "raise",
               overwrite: bool = False, progress: bool = True) -> str:
    """Pack every media file under ``folder`` into a dataset at ``out``; returns its path.

    ``on_error``: "raise" (default) stops at the first file the probe rejects, "skip" leaves it out (counted in the
    manifest's ``extra``). A folder without media files, or whose every file was skipped, is a FormatError (an empty
    dataset would only fail later, in the plan).
    """
    check_on_error(on_error)
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FormatError("media input is not a directory", path=folder)
    files = media_files(folder)
    if not files:
        raise FormatError(f"no media files here (looked for {' '.join(sorted(MEDIA_EXTENSIONS))}, hidden entries "
                          f"skipped)", path=folder)
    caption_of = load_captions(captions) if captions is not None else {}
    probe_media = load_probe() if probe else None
    extra: dict[str, Any] = {"source": os.path.abspath(folder), "source_format": "media",
                             "probe": probe_media is not None}
    skipped: list[str] = []
    captioned = 0
    with DatasetWriter(out, align=align, shard_bytes=shard_bytes, overwrite=overwrite, extra=extra) as w, \
            PackProgress(len(files), f"pack {os.path.basename(os.path.abspath(folder))}", progress, "files") as bar:
        for rel, mod in files:
            full = os.path.join(folder, rel)
            try:
                with open(full, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise FormatError(f"cannot read media file: {e.strerror}", path=full) from None
            probed = media_meta(probe_media, data, mod, on_error, full)
            if probed is None:
                skipped.append(rel)
                bar.advance(1)
                continue
            meta: dict[str, Any] = {**probed, "file": rel, "bytes": len(data)}
            caption = caption_of.get(os.path.normpath(rel), caption_of.get(os.path.basename(rel)))
            if caption is not None:
                meta["caption"] = caption
                captioned += 1
            w.add(data, modality=mod, meta=meta)
            bar.advance(1)  # counted once written: the bar ends with the work
        if len(skipped) == len(files):  # raised inside the writer: it removes what it wrote
            raise FormatError(f"the probe rejected all {len(files)} media files (first: {skipped[0]})", path=folder)
        w.extra.update(files=len(files) - len(skipped), captioned=captioned, skipped=skipped[:100],
                       skipped_count=len(skipped))
    return os.path.abspath(os.fspath(out))
