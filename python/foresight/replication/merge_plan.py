"""Where every byte of a merged checkpoint goes, computed before any byte arrives.

:func:`~foresight.replication.merge.merge_checkpoint` reads a whole checkpoint, then writes safetensors. To merge
while units arrive (:mod:`.arrival_merge`), the output is laid out up front from the checkpoint's chunk list alone
(the names, dtypes, shapes and file offsets of the stored chunks): the safetensors files of each module group (and
evaluation rank, resharded), each with its header, and for every stored chunk the *segments* that copy its bytes
into them. A unit (a byte range of a data file) is then merged by copying the segments that fall inside it.

The files follow merge_checkpoint's rules (same groups, same reshard rule: ``torch.tensor_split`` along dim 0 for
a tensor with at least ``world`` rows, whole to every rank otherwise; same tensors, dtypes, shapes and metadata),
so loading either output gives the same tensors. Tensors lie in a file by descending element size, then name (as
safetensors orders them: each is aligned to its element size).

Example::

    plan = MergePlan(chunks, {"source_format": "dcp"}, groups={"vision.": "vision"}, reshard=2)
    plan.files            # [OutFile("vision-rank00000-of-00002.safetensors", header, size), ...]
    plan.segments_in("__0_data.bin", 0, 32 << 20)   # (src, out file, out offset, nbytes) arrays
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import _TYPES

from foresight.errors import CheckpointError
from foresight.replication.merge import Chunk, group_of

_ST_NAME = {dt: name for name, dt in _TYPES.items()}


@dataclass(frozen=True)
class OutFile:
    """One merged safetensors file: its name, its header bytes (length prefix included) and its total size."""

    name: str
    header: bytes
    size: int


def split_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """Row ranges of ``torch.tensor_split(t, world)`` for ``rows`` rows (the first ``rows % world`` get one more)."""
    q, r = divmod(rows, world)
    out, at = [], 0
    for i in range(world):
        n = q + (1 if i < r else 0)
        out.append((at, at + n))
        at += n
    return out


def _runs(c: Chunk, itemsize: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A chunk's bytes as runs contiguous in the full tensor: (byte offset in the chunk, byte offset in the full
    tensor) of each run, and the run length. Dims after the first partial one span the full tensor."""
    nd = len(c.full)
    k = nd - 1
    while k > 0 and c.shape[k] == c.full[k]:
        k -= 1
    if nd == 0 or all(s == f for s, f in zip(c.shape, c.full)):
        return np.zeros(1, np.int64), np.zeros(1, np.int64), math.prod(c.shape) * itemsize
    strides = np.array([math.prod(c.full[d + 1:]) for d in range(nd)], np.int64)
    run = c.shape[k] * int(strides[k]) * itemsize
    lead = c.shape[:k]
    idx = np.indices(lead, np.int64).reshape(len(lead), -1) if lead else np.zeros((0, 1), np.int64)
    starts = ((idx + np.array(c.at[:k], np.int64)[:, None]) * strides[:k, None]).sum(0) + c.at[k] * strides[k]
    n = starts.shape[0]
    return np.arange(n, dtype=np.int64) * run, starts * itemsize, run


class MergePlan:
    """The merged output of a checkpoint whose stored chunks are ``chunks`` (duplicates dropped by the caller)."""

    def __init__(self, chunks: Sequence[Chunk], meta: Mapping[str, str], *, groups: Mapping[str, str] | None = None,
                 depth: int = 1, reshard: int | None = None) -> None:
        if reshard is not None and reshard < 1:
            raise ValueError(f"reshard must be >= 1, got {reshard}")
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        covered: dict[str, int] = {}
        for c in chunks:
            if tensors.setdefault(c.fqn, (c.dtype, c.full)) != (c.dtype, c.full):
                raise CheckpointError("chunks of one tensor disagree on its dtype or shape", tensor=c.fqn,
                                      file=c.file, offset=c.offset)
            covered[c.fqn] = covered.get(c.fqn, 0) + math.prod(c.shape)
        for name, (_, full) in tensors.items():
            if covered[name] != math.prod(full):
                raise CheckpointError("chunks do not cover the tensor", tensor=name, covered=covered[name],
                                      numel=math.prod(full))
        by_group: dict[str, list[str]] = {}
        for name in sorted(tensors):
            by_group.setdefault(group_of(name, groups, depth), []).append(name)
        # per tensor: (file index, data start in that file, byte range of the full tensor it holds)
        places: dict[str, list[tuple[int, int, int, int]]] = {}
        self.files: list[OutFile] = []
        self.groups: dict[str, list[str]] = {}  # group -> its file names
        world = reshard or 1
        for g, names in sorted(by_group.items()):
            for r in range(world):
                entries, offset = {}, 0
                order = sorted(names, key=lambda n: (-tensors[n][0].itemsize, n))
                held = []
                for n in order:
                    dt, full = tensors[n]
                    nbytes = math.prod(full) * dt.itemsize
                    lo, hi, shape = 0, nbytes, full
                    if reshard is not None and len(full) and full[0] >= reshard:
                        a, b = split_rows(full[0], reshard)[r]
                        row = nbytes // full[0] if full[0] else 0
                        lo, hi, shape = a * row, b * row, (b - a, *full[1:])
                    if dt not in _ST_NAME:
                        raise CheckpointError("tensor dtype has no safetensors name", tensor=n, dtype=str(dt))
                    entries[n] = {"dtype": _ST_NAME[dt], "shape": list(shape),
                                  "data_offsets": [offset, offset + hi - lo]}
                    held.append((n, offset, lo, hi))
                    offset += hi - lo
                fmeta = {**meta, "group": g}
                if reshard is not None:
                    fmeta.update(rank=str(r), world_size=str(reshard))
                fname = f"{g}.safetensors" if reshard is None else f"{g}-rank{r:05d}-of-{reshard:05d}.safetensors"
                header = self._header(fmeta, entries)
                fi = len(self.files)
                self.files.append(OutFile(fname, header, len(header) + offset))
                self.groups.setdefault(g, []).append(fname)
                for n, off, lo, hi in held:
                    places.setdefault(n, []).append((fi, len(header) + off, lo, hi))
        self._segments = self._plan_segments(chunks, tensors, places)

    @staticmethod
    def _header(meta: Mapping[str, str], entries: dict[str, Any]) -> bytes:
        body = json.dumps({"__metadata__": {k: str(v) for k, v in meta.items()}, **entries},
                          separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(body)) + body

    @staticmethod
    def _plan_segments(chunks: Sequence[Chunk], tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                       places: Mapping[str, list[tuple[int, int, int, int]]]) -> dict[str, tuple[np.ndarray, ...]]:
        per_file: dict[str, list[np.ndarray]] = {}
        for c in chunks:
            itemsize = tensors[c.fqn][0].itemsize
            src, dst, run = _runs(c, itemsize)
            if run == 0:
                continue
            for fi, data_at, lo, hi in places[c.fqn]:
                a = np.maximum(dst, lo)
                b = np.minimum(dst + run, hi)
                keep = b > a
                if not keep.any():
                    continue
                rows = np.stack([c.offset + src[keep] + (a[keep] - dst[keep]), np.full(int(keep.sum()), fi),
                                 data_at + a[keep] - lo, b[keep] - a[keep]])
                per_file.setdefault(c.file, []).append(rows)
        out = {}
        for f, parts in per_file.items():
            seg = np.concatenate(parts, axis=1)
            seg = seg[:, np.argsort(seg[0], kind="stable")]
            out[f] = (seg[0], seg[1], seg[2], seg[3], np.maximum.accumulate(seg[0] + seg[3]))
        return out

    def segments_in(self, file: str, offset: int, length: int) -> tuple[np.ndarray, ...]:
        """The copies for bytes ``[offset, offset + length)`` of data file ``file``, clipped to that range:
        ``(source offset, output file index, output offset, nbytes)`` arrays."""
        seg = self._segments.get(file)
        if seg is None:
            e = np.zeros(0, np.int64)
            return e, e, e, e
        src, fi, dst, n, ends = seg
        end = offset + length
        first = int(np.searchsorted(ends, offset, side="right"))  # ends is non-decreasing: segments before end
        last = int(np.searchsorted(src, end, side="left"))
        src, fi, dst, n = src[first:last], fi[first:last], dst[first:last], n[first:last]
        a = np.maximum(src, offset)
        b = np.minimum(src + n, end)
        keep = b > a
        return a[keep], fi[keep], dst[keep] + (a[keep] - src[keep]), b[keep] - a[keep]

    def total_segment_bytes(self) -> int:
        return int(sum(int(s[3].sum()) for s in self._segments.values()))
