"""Pack WebDataset tar shards (``shards-{000000..000999}.tar``) into foresight shards, one sample per key.

A WebDataset shard is a tar whose members are grouped by key: ``000123.jpg``, ``000123.json``, ``000123.txt`` are
one sample (the key is the member path up to the first dot of its base name; the rest is the extension). The tars
are read as streams (``tarfile`` mode ``r|*``, gzip/bz2/xz too): nothing is extracted to disk, one sample is in
memory at a time. Per key:

* the one image/audio/video member (by extension, as :mod:`.media`: ``jpg``, ``png``, ``flac``, ``mp4``...) is the
  sample's payload, probed like a media folder's files (keyframes, size, duration) by :func:`.media.media_meta`;
* ``json``/``txt``/``cls`` members become meta fields named by the extension (``json``: the parsed value,
  ``txt``: the UTF-8 text, stripped, ``cls``: an int when it is one); a longer extension keeps its first part as the
  name (``caption.txt`` -> ``caption``). A ``txt`` also fills ``caption`` when there is none, so
  ``Loader(meta_fields=("caption",))`` reads captions as it does for ``foresight pack media --captions``;
* ``key``, ``shard`` (the tar's name), ``file`` (the member's) and ``bytes`` are added; other members (``.npy``...)
  are counted in the manifest's ``extra`` (``ignored_members``), not packed.

A key with no media member, or with several, is a FormatError naming the tar and the key (``on_error="skip"`` skips
it and counts it). Shards are given as paths, globs or brace patterns (``{000000..000009}``, ``{a,b}``), taken in
the order given (a glob's matches sorted), so the same command always packs the same dataset.

Example::

    pack_webdataset("shards-{000000..000009}.tar", "media/")
    # foresight pack webdataset 'shards-{000000..000009}.tar' media/
"""
from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

from ...errors import FormatError
from ..types import Modality
from ..writer import DatasetWriter
from .media import MEDIA_EXTENSIONS, check_on_error, load_probe, media_meta
from .progress import PackProgress

__all__ = ["pack_webdataset", "expand_shards", "expand_braces", "META_EXTENSIONS"]

META_EXTENSIONS = ("json", "txt", "cls")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")
_GLOB_CHARS = re.compile(r"[*?\[]")


def expand_braces(pattern: str) -> list[str]:
    """Brace expansion as the shell and WebDataset do it: numeric ranges (zero padding kept) and comma lists.

    >>> expand_braces("s-{00..02}.tar")
    ['s-00.tar', 's-01.tar', 's-02.tar']
    >>> expand_braces("{a,b}/x-{1..2}.tar")
    ['a/x-1.tar', 'a/x-2.tar', 'b/x-1.tar', 'b/x-2.tar']
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end():]
    r = _RANGE.fullmatch(body)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        if hi < lo:
            raise FormatError(f"brace range {{{body}}} runs backwards", path=pattern)
        width = len(r.group(1)) if r.group(1).startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(lo, hi + 1)]
    else:
        choices = body.split(",")
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def expand_shards(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Tar paths from paths, globs and brace patterns, in the order given; a missing shard or a shard named twice
    is a FormatError naming it."""
    args = [patterns] if isinstance(patterns, (str, os.PathLike)) else list(patterns)
    if not args:
        raise FormatError("no WebDataset shards given")
    out: list[str] = []
    seen: set[str] = set()
    for arg in map(os.fspath, args):
        for pattern in expand_braces(arg):
            if _GLOB_CHARS.search(pattern) and not os.path.exists(pattern):
                paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
                if not paths:
                    raise FormatError("the pattern matches no files", path=pattern)
            else:
                paths = [pattern]
            for path in paths:
                if not os.path.isfile(path):
                    raise FormatError("no such WebDataset shard", path=path)
                real = os.path.realpath(path)
                if real in seen:
                    raise FormatError("this shard is given twice; each is packed once", path=path)
                seen.add(real)
                out.append(path)
    return out


def _split_name(name: str) -> tuple[str, str]:
    """``dir/000123.seg.jpg`` -> (``dir/000123``, ``seg.jpg``): the key, and the extension (lower case)."""
    folder, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (os.path.join(folder, stem) if folder else stem), ext.lower()


def _samples(tar_path: str, position: list[int]) -> Iterator[tuple[str, dict[str, tuple[str, bytes]]]]:
    """``(key, {extension: (member name, bytes)})`` per key, streamed; ``position[0]`` is the bytes of the tar read
    so far (the progress). Members of one key lie together, as WebDataset writes them."""
    key, group = None, {}
    try:
        with open(tar_path, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                k, ext = _split_name(member.name)
                if os.path.basename(k).startswith((".", "__")):  # hidden entries and __index__-style metadata
                    continue
                if k != key:
                    if group:
                        yield key, group
                    key, group = k, {}
                if ext in group:
                    raise FormatError(f"key {k!r} has two members with extension {ext!r}", path=tar_path)
                group[ext] = (member.name, tar.extractfile(member).read())
                position[0] = raw.tell()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise FormatError(f"cannot read the tar: {e}", path=tar_path) from None
    if group:
        yield key, group


def _modality(ext: str) -> Modality | None:
    """The media modality of a member by its extension's last part (``seg.jpg`` -> IMAGE), None for others."""
    return MEDIA_EXTENSIONS.get("." + ext.rsplit(".", 1)[-1])


def _meta_value(ext: str, data: bytes, where: str) -> tuple[str, Any]:
    """A meta member as (field name, value): ``json`` parsed, ``txt`` text, ``cls`` an int when it is one."""
    kind = ext.rsplit(".", 1)[-1]
    name = ext.split(".", 1)[0] if "." in ext else ext
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{kind} member is not UTF-8: {e}", path=where) from None
    if kind == "json":
        try:
            return name, json.loads(text)
        except ValueError as e:
            raise FormatError(f"bad JSON: {e}", path=where) from None
    text = text.strip()
    if kind == "cls" and re.fullmatch(r"[+-]?\d+", text):
        return name, int(text)
    return name, text


def pack_webdataset(shards: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, *,
                    align: int = 4096, shard_bytes: int = 1 << 30, probe: bool = True, on_error: str = "raise",
                    overwrite: bool = False, progress: bool = True) -> str:
    """Pack WebDataset tar shards (paths, globs, brace patterns) into a dataset at ``out``; returns its path.

    ``probe``/``on_error``/``align`` as :func:`~foresight.format.pack_media` (``on_error="skip"`` also skips keys
    with no media member or with several).
    """
    check_on_error(on_error)
    tars = expand_shards(shards)
    probe_media = load_probe() if probe else None
    paths = [os.path.abspath(t) for t in tars]
    extra: dict[str, Any] = {"source": paths[0] if len(paths) == 1 else os.path.commonpath(paths),
                             "sources": paths, "source_format": "webdataset", "probe": probe_media is not None}
    samples, skipped, ignored = 0, [], {}
    total = sum(os.path.getsize(t) for t in tars)
    desc = f"pack {os.path.basename(tars[0])}" if len(tars) == 1 else f"pack {len(tars)} shards"
    with DatasetWriter(out, align=align, shard_bytes=shard_bytes, overwrite=overwrite, extra=extra) as w, \
            PackProgress(total, desc, progress) as bar:
        for tar_path in tars:
            position, counted = [0], 0
            for key, group in _samples(tar_path, position):
                media = {ext: m for ext, m in group.items() if _modality(ext)}
                where = f"{tar_path}:{key}"
                if len(media) != 1:
                    if on_error != "skip":
                        what = "no image, audio or video member" if not media else \
                            f"several media members ({', '.join(sorted(media))}); foresight packs one per sample"
                        raise FormatError(f"key {key!r} has {what} (members: {', '.join(sorted(group))}; media is "
                                          f"{' '.join(sorted(MEDIA_EXTENSIONS))})", path=tar_path)
                    skipped.append(where)
                else:
                    (ext, (member, data)), = media.items()
                    mod = _modality(ext)
                    probed = media_meta(probe_media, data, mod, on_error, where)
                    if probed is None:
                        skipped.append(where)
                    else:
                        w.add(data, modality=mod, meta=_meta(key, tar_path, member, data, probed, group, ignored))
                        samples += 1
                bar.advance(position[0] - counted)
                counted = position[0]
            bar.advance(os.path.getsize(tar_path) - counted)  # the tar's end blocks
        if samples == 0:  # raised inside the writer: it removes what it wrote
            raise FormatError(f"no sample packed from {len(tars)} shard(s) ({len(skipped)} keys skipped)",
                              path=tars[0])
        w.extra.update(samples=samples, skipped=skipped[:100], skipped_count=len(skipped), ignored_members=ignored)
    return os.path.abspath(os.fspath(out))


def _meta(key: str, tar_path: str, member: str, data: bytes, probed: dict, group: dict[str, tuple[str, bytes]],
          ignored: dict[str, int]) -> dict[str, Any]:
    meta: dict[str, Any] = dict(probed)
    for ext, (name, raw) in group.items():
        kind = ext.rsplit(".", 1)[-1]
        if kind in META_EXTENSIONS:
            field, value = _meta_value(ext, raw, f"{tar_path}:{name}")
            meta[field] = value
        elif _modality(kind) is None:
            ignored[ext] = ignored.get(ext, 0) + 1
    if isinstance(meta.get("txt"), str):
        meta.setdefault("caption", meta["txt"])
    meta.update(key=key, shard=os.path.basename(tar_path), file=member, bytes=len(data))
    return meta

