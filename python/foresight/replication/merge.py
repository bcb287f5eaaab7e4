"""Merge a distributed checkpoint into one safetensors file per module group, optionally resharded.

The evaluation side's first step (in the source paper, 84.8% of an evaluation's I/O time): per-rank DCP
shards become whole tensors (a tensor split across ranks is concatenated from its chunks, placed at the
chunk offsets DCP recorded; a replicated tensor stored more than once is read once), grouped by module
(``vision.*``, ``text.*``: one safetensors file each), optionally cut again for an evaluation world size.
All extents are read in one coalesced batch through a :mod:`.source` (a local replica or a remote site)
and each is checked against its xxh3 before use. foresight's own checkpoints (``index.json``) merge the
same way (their tensors are already whole).

Reshard rule: a tensor with at least ``world`` rows is split along dim 0 with ``torch.tensor_split``
(rank r gets part r); smaller tensors and scalars go whole to every rank.

Example::

    merge_checkpoint(LocalSource("/ckpt/step-00001000"), "/eval/merged", groups={"vision.": "vision"})
    # -> {"vision": ["/eval/merged/vision.safetensors"], "text": [...]}
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from foresight.checkpoint import store
from foresight.checkpoint.layout import dtype_from_name
from foresight.checkpoint.safe_pickle import load_dcp_metadata
from foresight.checksum import xxh3_many
from foresight.errors import CheckpointError
from foresight.replication.units import DCP_METADATA


@dataclass
class Chunk:
    """One stored chunk of a tensor: where its bytes lie and where it sits in the full tensor."""

    fqn: str
    file: str
    offset: int
    nbytes: int
    xxh3: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of this chunk
    at: tuple[int, ...]  # where the chunk starts in the full tensor
    full: tuple[int, ...]  # the full tensor's shape


def chunks_of(source: Any) -> tuple[list[Chunk], dict[str, Any]]:
    """Every stored tensor chunk (duplicates of a replicated tensor dropped) and checkpoint-level metadata."""
    try:
        raw = source.read_file(DCP_METADATA)
    except CheckpointError:
        raw = None
    out: list[Chunk] = []
    if raw is not None:
        where = (os.path.join(source.path, DCP_METADATA) if hasattr(source, "path")
                 else f"{source.endpoint} {source.name}/{DCP_METADATA}")
        md = load_dcp_metadata(raw, source=where)  # it may come from another site: no code runs
        seen = set()
        for key, info in md.storage_data.items():
            tmd = md.state_dict_metadata.get(key.fqn)
            if tmd is None or not hasattr(tmd, "chunks"):
                continue  # a non-tensor (BYTE_IO) entry: no place in safetensors
            at = tuple(key.offset) if key.offset is not None else (0,) * len(tmd.size)
            if (key.fqn, at) in seen:
                continue
            seen.add((key.fqn, at))
            out.append(Chunk(key.fqn, info.relative_path, int(info.offset), int(info.length), int(info.xxh3),
                              dtype_from_name(info.dtype), tuple(info.shape), at, tuple(tmd.size)))
        return out, {"source_format": "dcp"}
    index = json.loads(source.read_file(store.INDEX))
    t = index["tensors"]
    files = [f["name"] for f in index["files"]]
    for n, fi, o, nb, h, dt, shape in zip(t["name"], t["file"], t["offset"], t["nbytes"], t["xxh3"], t["dtype"],
                                          t["shape"]):
        out.append(Chunk(n, files[fi], o, nb, int(h, 16), dtype_from_name(dt), tuple(shape), (0,) * len(shape),
                          tuple(shape)))
    return out, {"source_format": "foresight", "foresight.step": str(index["step"])}


def chunk_rows(chunks: list[Chunk]) -> list[list[Any]]:
    """``chunks`` as JSON rows (``[fqn, file, offset, nbytes, dtype, shape, at, full]``): the layout a sender ships
    to a site that merges as units arrive (:mod:`.arrival_merge`)."""
    return [[c.fqn, c.file, c.offset, c.nbytes, str(c.dtype), list(c.shape), list(c.at), list(c.full)]
            for c in chunks]


def chunks_from_rows(rows: list[list[Any]], *, where: str = "") -> list[Chunk]:
    """:func:`chunk_rows` back, checked (a row that does not fit raises naming it); duplicates (a replicated
    tensor shipped by several writers) dropped. The xxh3 is not shipped (0): units carry their own."""
    out, seen = [], set()
    for row in rows:
        try:
            fqn, file, offset, nbytes, dt, shape, at, full = row
            c = Chunk(str(fqn), str(file), int(offset), int(nbytes), 0, dtype_from_name(str(dt)),
                      tuple(int(x) for x in shape), tuple(int(x) for x in at), tuple(int(x) for x in full))
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"bad layout row: {e}", row=str(row)[:200], source=where) from None
        fits = len(c.shape) == len(c.at) == len(c.full) and all(
            a >= 0 and a + s <= f for a, s, f in zip(c.at, c.shape, c.full))
        if not fits or c.offset < 0 or c.nbytes != math.prod(c.shape) * c.dtype.itemsize:
            raise CheckpointError("layout row does not fit its tensor", tensor=c.fqn, file=c.file, offset=c.offset,
                                  source=where)
        if (c.fqn, c.at) not in seen:
            seen.add((c.fqn, c.at))
            out.append(c)
    return out


def group_of(fqn: str, groups: Mapping[str, str] | None, depth: int) -> str:
    """The module group of a tensor name: the longest matching prefix in ``groups``, else its first ``depth``
    dotted parts (``vision.blocks.0.w`` -> ``vision`` at depth 1)."""
    if groups:
        best = max((p for p in groups if fqn.startswith(p)), key=len, default=None)
        if best is not None:
            return groups[best]
        return "rest"
    parts = fqn.split(".")
    return ".".join(parts[:depth]) if len(parts) > depth else "root"


def read_tensors(source: Any, *, per_extent: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors of the checkpoint behind ``source``, whole (chunks concatenated), each chunk verified."""
    chunks, meta = chunks_of(source)
    files = sorted({c.file for c in chunks})
    fid = {f: i for i, f in enumerate(files)}
    region, tr = source.read_extents(files, np.array([fid[c.file] for c in chunks], np.int32),
                                     np.array([c.offset for c in chunks], np.int64),
                                     np.array([c.nbytes for c in chunks], np.int64), per_extent=per_extent)
    got = xxh3_many(region, tr.x_dest, tr.x_length)
    bad = np.flatnonzero(got != np.array([c.xxh3 for c in chunks], np.uint64))
    if len(bad):
        c = chunks[int(bad[0])]
        raise CheckpointError("tensor checksum mismatch while merging", file=c.file, tensor=c.fqn, offset=c.offset)
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for i, c in enumerate(chunks):
        data = torch.from_numpy(tr.view(region, i)).view(c.dtype).view(c.shape)
        if c.shape == c.full:
            out[c.fqn] = data.clone()  # its own storage: safetensors refuses shared ones
        else:
            full = out.get(c.fqn)
            if full is None:
                full = out[c.fqn] = torch.empty(c.full, dtype=c.dtype)
            full[tuple(slice(a, a + n) for a, n in zip(c.at, c.shape))] = data
        filled[c.fqn] = filled.get(c.fqn, 0) + data.numel()
    for name, t in out.items():
        if filled[name] != t.numel():
            raise CheckpointError("chunks do not cover the tensor", tensor=name, covered=filled[name],
                                  numel=t.numel())
    return out, meta


def merge_checkpoint(source: Any, out_dir: str | os.PathLike, *, groups: Mapping[str, str] | None = None,
                     depth: int = 1, reshard: int | None = None, per_extent: bool = False) -> dict[str, list[str]]:
    """Write ``<group>.safetensors`` (or ``<group>-rank00000-of-00004.safetensors`` with ``reshard=4``) for
    each module group into ``out_dir``; return ``{group: [paths]}``."""
    if reshard is not None and reshard < 1:
        raise ValueError(f"reshard must be >= 1, got {reshard}")
    tensors, meta = read_tensors(source, per_extent=per_extent)
    by_group: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(tensors):
        by_group.setdefault(group_of(name, groups, depth), {})[name] = tensors[name]
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    written: dict[str, list[str]] = {}
    for g, ts in sorted(by_group.items()):
        if reshard is None:
            written[g] = [_save(ts, os.path.join(out_dir, f"{g}.safetensors"), {**meta, "group": g})]
            continue
        written[g] = []
        for r in range(reshard):
            part = {n: (torch.tensor_split(t, reshard)[r].contiguous() if t.dim() and t.shape[0] >= reshard else t)
                    for n, t in ts.items()}
            written[g].append(_save(part, os.path.join(out_dir, f"{g}-rank{r:05d}-of-{reshard:05d}.safetensors"),
                                    {**meta, "group": g, "rank": str(r), "world_size": str(reshard)}))
    return written


def _save(tensors: dict[str, torch.Tensor], path: str, meta: dict[str, str]) -> str:
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)  # never a half-written file under the final name
    return path
