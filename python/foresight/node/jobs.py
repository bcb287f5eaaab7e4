"""One registered job on a node: its plan, datasets, decode stage, the shards this node serves, and how one step's
part is prepared: read and decoded by the read path the host runs (:mod:`foresight.source`: extents, modality
codes, coalesced reads, :class:`~foresight.source.MediaDecodeStage`): one code path for host and node.

A job's *part* of a step is the samples of this rank's share whose modality has a spec and whose shard this node
serves; each travels with its ``position`` in the step so the client can assemble the step in plan order.

Example::

    job = NodeJob.open(request, token="t", node="n1", served_shards=lambda fp: None, decode_threads=2,
                       open_cache=lambda kind, name: opened[kind, name])   # the node opens, under its root
    part = job.prepare(step=3, engine=engine, raw=False)     # StepPart: Arrow schema + record batches
"""
from __future__ import annotations

import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import xxhash

from foresight.bucket import BucketDataset
from foresight.checksum import xxh3_many
from foresight.errors import ProtocolError
from foresight.io import open_file
from foresight.media import TransformSpec
from foresight.node.limits import WorkLimits, check_job
from foresight.node.protocol import KIND_DECODED, KIND_DEFERRED, KIND_RAW, encode_deferred, encode_raw, encode_tensors
from foresight.source import (FileTable, MediaDecodeStage, dataset_modality_codes, decode_part,
                              extents_without_fetching, modality_codes, read_extents, sample_shards, spec_codes,
                              step_extents)


def spec_digest(specs: dict) -> str:
    """Digest of the specs and of every library version that shapes their output: host and node must agree on
    it, or their tensors could differ (the node refuses the job rather than serve different pixels)."""
    fps = {name: (s if isinstance(s, TransformSpec) else TransformSpec.from_dict(s)).fingerprint()["digest"]
           for name, s in sorted(specs.items())}
    return xxhash.xxh3_64_hexdigest(json.dumps(fps, sort_keys=True).encode())


def resolve_under(root: str, name: str, what: str) -> str:
    """``root/name`` with symlinks resolved; :class:`ProtocolError` when it escapes ``root``."""
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, name))
    if os.path.commonpath([real_root, path]) != real_root or path == real_root:
        raise ProtocolError(f"{what} escapes the node's data root", name=name)
    if not os.path.isdir(path):
        raise ProtocolError(f"no such {what} under the node's data root", name=name)
    return path


@dataclass
class StepPart:
    """A prepared part of one step: what DoGet streams."""

    step: int
    kind: str
    schema: Any
    batches: list
    nbytes: int
    samples: int
    copied_bytes: int = 0
    corrupt: int = 0  # samples whose bytes on this node failed their xxh3 (left out; the client decodes them)


class _DecodeTimes:
    """The stage reports decode seconds per modality here (LoaderStats' ``add_decode`` interface)."""

    def __init__(self, sink: Callable[[str, float], None]) -> None:
        self.sink = sink

    def add_decode(self, modality: str, seconds: float) -> None:
        self.sink(modality, seconds)


@dataclass
class NodeJob:
    job: str
    token: str
    rank: int
    world_size: int
    plan: Any
    datasets: list
    specs: dict
    seed: int
    lead: int
    queue_bytes: int
    served: list  # per dataset: sorted shard list this node serves, or None for all
    stage: Any
    files: Any
    node: str
    dataset_names: list = field(default_factory=list)  # as the job named them under the node's root
    spec_codes: np.ndarray = field(default=None)  # type: ignore[assignment]
    local_file: np.ndarray = field(default=None)  # type: ignore[assignment]
    bounds: dict = field(default_factory=dict)  # the most a sample, a step part and decoding take (limits.py)
    refused: str | None = None  # why the node stopped serving the job (its dataset changed under the root)
    guard_reply: str = "raw"  # under the CPU guard: "raw" sample bytes, or "defer" (the client reads them itself)
    prefetch: Any = None  # a bucket root's JobPrefetch (node.bucket_root): fetches the plan's next steps ahead
    extent_sources: list = field(default_factory=list)  # what steps' extents are looked up in (bucket: maps only)
    last_seen: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, req: dict, *, token: str, node: str, served_shards: Callable[[str], Any],
             decode_threads: int | None, open_cache: Callable[[str, str], Any],
             limits: WorkLimits | None = None) -> "NodeJob":
        datasets = [open_cache("dataset", name) for name in req["datasets"]]
        plan = open_cache("plan", req["plan"])
        if plan.digest != req["plan_digest"]:
            raise ProtocolError("plan on the node has another digest", plan=req["plan"], node_digest=plan.digest,
                                requested=req["plan_digest"])
        if plan.kind != "samples":
            raise ProtocolError("the node serves media (samples) plans only", plan=req["plan"], kind=plan.kind)
        try:
            plan.check_sources(datasets)
        except ValueError as e:
            raise ProtocolError(f"datasets do not match the plan: {e}") from None
        if plan.global_batch_size % req["world_size"]:
            raise ProtocolError("global batch size is not divisible by world_size", world_size=req["world_size"])
        specs = {k: TransformSpec.from_dict(v) for k, v in req["specs"].items()}
        if req["spec_digest"] is not None and req["spec_digest"] != spec_digest(specs):
            raise ProtocolError("transform specs or decode library versions differ between host and node: "
                                "the tensors would not match", node_digest=spec_digest(specs),
                                requested=req["spec_digest"])
        bounds = check_job(limits or WorkLimits(), specs, datasets,
                           samples_per_step=plan.global_batch_size // req["world_size"],
                           decode_threads=decode_threads or os.cpu_count() or 1)
        served = [served_shards(str(ds.fingerprint)) for ds in datasets]
        files = FileTable(datasets, open_file)
        local = np.zeros(len(files.paths), dtype=bool)
        for d, shards in enumerate(served):
            n = int(files.base[d + 1] - files.base[d])
            if shards is None:
                local[files.base[d]: files.base[d + 1]] = True
            else:
                idx = np.asarray([s for s in shards if 0 <= s < n], dtype=np.int64)
                local[files.base[d] + idx] = True
        stage = MediaDecodeStage(datasets, specs, seed=req["seed"], threads=decode_threads)
        return cls(job=req["job"], token=token, rank=req["rank"], world_size=req["world_size"], plan=plan,
                   datasets=datasets, specs=specs, seed=req["seed"], lead=req["lead"],
                   queue_bytes=req["queue_bytes"], served=served, stage=stage, files=files, node=node,
                   dataset_names=list(req["datasets"]),
                   spec_codes=np.asarray(sorted(spec_codes(specs).values()), dtype=np.int16),
                   local_file=local, bounds=bounds, guard_reply=req.get("guard_reply", "raw"),
                   extent_sources=extents_without_fetching(datasets))

    def check_token(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def describe(self) -> dict:
        return {"job": self.job, "rank": self.rank, "world_size": self.world_size, "lead": self.lead,
                "queue_bytes": self.queue_bytes, "node": self.node,
                "served_shards": [None if s is None else list(s) for s in self.served],
                "num_steps": self.plan.num_steps}

    def prepare(self, step: int, engine, *, raw: bool, decode_seconds: Callable[[str, float], None],
                corrupt: Callable[[str, np.ndarray], None] | None = None) -> StepPart:
        """Read (and unless ``raw``, decode) this node's part of ``step``; see the module docstring. With ``raw``
        and a job that asked for ``guard_reply="defer"`` the node reads nothing: it names the positions.

        Every sample read is checked against its xxh3 in the shard map first (one native call for the part); a
        sample that fails is neither decoded nor sent: its position travels in the part's ``corrupt`` metadata so
        the client decodes it itself, and ``corrupt(dataset_name, sample_ids)`` reports it."""
        start, stop = self.plan.rank_items(step, self.rank, self.world_size)
        ext = step_extents(self.plan, self.extent_sources, self.files, start, stop)
        codes = modality_codes(self.datasets, ext.dataset, ext.sample)
        sel = np.flatnonzero(self.local_file[ext.file] & np.isin(codes, self.spec_codes))
        kind = KIND_RAW if raw else KIND_DECODED
        names = {code: name for name, code in spec_codes(self.specs).items()}
        if raw and self.guard_reply == "defer":
            modalities = [names[int(c)] for c in codes[sel]]
            schema, batches, copied = encode_deferred(sel, modalities, step=step, node=self.node)
            return StepPart(step, KIND_DEFERRED, schema, batches, 0, len(sel), copied)
        if len(sel) == 0:
            schema, batches, copied = encode_tensors(kind, [], step=step, node=self.node)
            return StepPart(step, kind, schema, batches, 0, 0, copied)
        self._fetch_missing(ext.dataset[sel], ext.sample[sel])
        # a fresh region per step: raw parts hand it to Arrow without a copy, and lead steps are queued at once
        part = read_extents(engine, self.files, ext.file[sel], ext.offset[sel], ext.length[sel])
        region, x_dest, lengths = part.region, part.offsets, part.lengths
        bad = self._failed_checksums(ext.dataset[sel], ext.sample[sel], region, x_dest, lengths)
        if bad.any():
            for d in np.unique(ext.dataset[sel][bad]):
                if corrupt is not None:
                    corrupt(self.dataset_names[int(d)], ext.sample[sel][bad & (ext.dataset[sel] == d)])
            ok = ~bad
            bad_positions, sel, x_dest, lengths = sel[bad], sel[ok], x_dest[ok], lengths[ok]
        else:
            bad_positions = None
        if raw:
            by_code = np.empty(int(codes.max()) + 1, dtype=object)
            for c, name in names.items():
                if c < len(by_code):
                    by_code[c] = name
            modalities = by_code[codes[sel]].tolist()
            schema, batches, copied = encode_raw(region, x_dest, lengths, sel, modalities, step=step, node=self.node,
                                                 corrupt=bad_positions)
        elif len(sel) == 0:  # every sample of the part failed its checksum
            schema, batches, copied = encode_tensors(kind, [], step=step, node=self.node, corrupt=bad_positions)
        else:
            part.offsets, part.lengths = x_dest, lengths  # without the samples that failed their checksum
            blocks = decode_part(self.stage, part, step=step, dataset=ext.dataset[sel], samples=ext.sample[sel],
                                 positions=sel, first_item=start, stats=_DecodeTimes(decode_seconds),
                                 modalities=self.specs)
            stacked, rows = {}, []
            for name, positions, tensors in blocks:
                if isinstance(tensors, list):  # shapes differ within the step
                    rows.extend((int(p), name, t) for p, t in zip(positions, tensors))
                else:
                    stacked[name] = (positions, tensors)
            schema, batches, copied = encode_tensors(kind, rows, step=step, node=self.node, stacked=stacked,
                                                     corrupt=bad_positions)
        nbytes = sum(b.nbytes for b in batches)
        return StepPart(step, kind, schema, batches, nbytes, len(sel), copied,
                        0 if bad_positions is None else len(bad_positions))

    def node_samples(self, d: int) -> np.ndarray:
        """Bool per sample of dataset ``d``: those this node reads for the job (a shard it serves, a modality the
        job decodes); a bucket dataset's prefetch fetches these alone."""
        ds = self.datasets[d]
        shard = sample_shards(self.extent_sources[d])
        return self.local_file[self.files.base[d] + shard] & np.isin(dataset_modality_codes(ds), self.spec_codes)

    def _fetch_missing(self, dataset: np.ndarray, samples: np.ndarray) -> None:
        """The samples of bucket datasets this part reads, made present in their caches (one coalesced fetch per
        dataset, of these samples only: not the step's others, which other nodes or the client read)."""
        for d in np.unique(dataset):
            ds = self.datasets[int(d)]
            if isinstance(ds, BucketDataset):
                ds.cache.ensure(samples[dataset == d])

    def _failed_checksums(self, dataset: np.ndarray, samples: np.ndarray, region: np.ndarray, x_dest: np.ndarray,
                          lengths: np.ndarray) -> np.ndarray:
        """True where the bytes read at ``region[x_dest:][:lengths]`` are not the packed sample's (xxh3 of the
        shard map): one native hash call for the whole part, then a compare per dataset the part touches."""
        got = xxh3_many(region, x_dest, lengths)
        bad = np.zeros(len(samples), dtype=bool)
        for d in np.unique(dataset):
            want = self.datasets[int(d)].checksums()
            if want is None:  # a format without checksums (never a media dataset): nothing to check against
                continue
            mask = dataset == d
            bad[mask] = got[mask] != np.asarray(want)[samples[mask]]
        return bad

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self.stage.close()
        self.files.close()


__all__ = ["NodeJob", "StepPart", "resolve_under", "spec_digest"]
