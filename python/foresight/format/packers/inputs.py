"""Turn the inputs a user has (files, globs, folders such as a Hugging Face dataset) into one ordered file list.

Each argument is expanded on its own, in sorted order, and the arguments are kept in the order given, so the same
command always packs the same files in the same order (sample ids depend on it):

* a file is taken as is (a ``kind="auto"`` file needs a known suffix);
* a glob (``data/train-*.parquet``, ``parts/**/*.jsonl.gz``) takes every data file it matches;
* a folder takes every data file under it (hidden entries skipped). A folder holding several splits
  (``train-00000-of-00003.parquet`` and ``test-00000-of-00001.parquet``, or ``train/`` and ``test/``) is refused
  unless ``split`` names one: packing train and test together is never what was meant.

Example::

    files = resolve_inputs(["hf_dataset/"], kind="auto", split="train")
    # [InputFile(path='hf_dataset/data/train-00000-of-00003.parquet', format='parquet', size=...), ...]
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import FormatError

__all__ = ["InputFile", "resolve_inputs", "compression_of", "split_of", "KINDS"]

KINDS = ("auto", "jsonl", "parquet")
# Suffixes taken from folders and globs; a .json beside them is usually metadata (dataset_info.json), not rows.
_FOLDER_SUFFIXES = {"parquet": (".parquet",), "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".jsonl.zst")}
# Also accepted when a file is named explicitly.
_FILE_SUFFIXES = {"parquet": (".parquet", ".pq"),
                  "jsonl": (".jsonl", ".ndjson", ".json") + tuple(s + c for s in (".jsonl", ".ndjson", ".json")
                                                                  for c in (".gz", ".bz2", ".zst"))}
_COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
_KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")
_SHARD_NAME = re.compile(r"(?P<split>.+?)-\d{5}-of-\d{5}(\.|$)")  # train-00000-of-00003.parquet
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class InputFile:
    """One input file: its path, how it is read (``"jsonl"`` or ``"parquet"``) and its size in bytes."""

    path: str
    format: str
    size: int


def compression_of(path: str) -> str | None:
    """The codec of a compressed JSONL file, from its suffix (``"gzip"`` for ``.jsonl.gz``), else None."""
    return _COMPRESSION.get(os.path.splitext(path)[1].lower())


def _format_by_suffix(path: str, kind: str, suffixes: dict[str, tuple[str, ...]]) -> str | None:
    name = path.lower()
    for fmt, ends in suffixes.items():
        if (kind in ("auto", fmt)) and name.endswith(ends):
            return fmt
    return None


def split_of(rel: str) -> str | None:
    """The dataset split a file belongs to, from a Hugging Face shard name or a split folder; None if neither."""
    m = _SHARD_NAME.match(os.path.basename(rel))
    if m:
        return m.group("split")
    for part in reversed(os.path.dirname(rel).split(os.sep)):
        if part in _KNOWN_SPLITS:
            return part
    return None


def _from_folder(folder: str, kind: str, split: str | None) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and _format_by_suffix(name, kind, _FOLDER_SUFFIXES):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    found.sort()
    splits = sorted({s for s in map(split_of, found) if s is not None})
    if split is not None:
        found = [rel for rel in found if split_of(rel) == split]
        if not found:
            raise FormatError(f"no files of split {split!r} here (splits found: {', '.join(splits) or 'none'})",
                              path=folder)
    elif len(splits) > 1:
        one = "train" if "train" in splits else splits[0]
        raise FormatError(f"this folder holds several splits ({', '.join(splits)}); pack one with --split {one} "
                          f"(split= in Python), or pass a glob such as '{os.path.join(folder, '**', one + '-*')}'",
                          path=folder)
    if not found:
        wanted = " ".join(s for f, ends in _FOLDER_SUFFIXES.items() if kind in ("auto", f) for s in ends)
        raise FormatError(f"no data files here (looked for {wanted}; hidden entries skipped)", path=folder)
    return [os.path.join(folder, rel) for rel in found]


def _expand(arg: str, kind: str, split: str | None) -> list[str]:
    if os.path.isdir(arg):
        return _from_folder(arg, kind, split)
    if os.path.exists(arg) or not _GLOB_CHARS.search(arg):
        return [arg]  # a missing plain path is reported by the caller, with its name
    matches = sorted(glob.glob(arg, recursive=True))
    files = [p for p in matches if os.path.isfile(p) and _format_by_suffix(p, kind, _FOLDER_SUFFIXES)]
    if split is not None:
        files = [p for p in files if split_of(p) == split]
    if not files:
        raise FormatError(f"the pattern matches no {'data' if kind == 'auto' else kind} files"
                          + (f" of split {split!r}" if split is not None else "")
                          + (f" ({len(matches)} other paths)" if matches else ""), path=arg)
    return files


def resolve_inputs(inputs: str | os.PathLike | Sequence[str | os.PathLike], kind: str = "auto",
                   split: str | None = None) -> list[InputFile]:
    """Expand files, globs and folders into the ordered list of files to pack (see the module doc).

    ``kind``: "jsonl" or "parquet" reads every named file that way and takes only that kind from folders and globs;
    "auto" decides by suffix. A path that does not exist, an unknown suffix, or a file named twice is a FormatError.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    args = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not args:
        raise FormatError("no inputs given")
    out: list[InputFile] = []
    seen: dict[str, str] = {}
    for arg in map(os.fspath, args):
        for path in _expand(arg, kind, split):
            try:
                size = os.stat(path).st_size
            except OSError as e:
                raise FormatError(f"cannot read input: {e.strerror}", path=path) from None
            fmt = _format_by_suffix(path, kind, _FILE_SUFFIXES) or (kind if kind != "auto" else None)
            if fmt is None:
                raise FormatError("unknown input type: name it .parquet, .jsonl or .jsonl.gz, or say which with "
                                  "the kind (foresight pack jsonl|parquet ...)", path=path)
            real = os.path.realpath(path)
            if real in seen:
                raise FormatError(f"this file is given twice (also as {seen[real]}); each file is packed once",
                                  path=path)
            seen[real] = path
            out.append(InputFile(path, fmt, size))
    return out
