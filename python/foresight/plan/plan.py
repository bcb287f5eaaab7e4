"""The :class:`Plan`: a global sequence of items, each a short run of pieces, and its rank view.

Item i is the pieces ``item_ptr[i]:item_ptr[i+1]`` of the flat arrays ``piece_dataset`` (uint16),
``piece_sample``, ``piece_offset`` and ``piece_length`` (int64; tokens for token data, bytes
otherwise). Step s is items ``[s*B, (s+1)*B)``; rank r of W takes ``B/W`` consecutive items of it.
The rank view is arithmetic on the global plan, so resuming at step k with any world size
continues the same global sequence of samples.

Example::

    plan = load_plan("plan/")
    start, stop = plan.rank_items(step=10, rank=0, world_size=8)
    p = plan.pieces(start, stop)         # zero-copy views of the piece arrays
    first_item = slice(p.item_ptr[0], p.item_ptr[1])
    print(plan.step_json(10))
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from foresight.errors import PlanError
from foresight.plan.files import compute_digest, save_plan

#: The arrays of a plan, in digest order, with their on-disk dtypes (little-endian).
ARRAY_DTYPES: dict[str, str] = {
    "item_ptr": "<i8",
    "piece_dataset": "<u2",
    "piece_sample": "<i8",
    "piece_offset": "<i8",
    "piece_length": "<i8",
}
FORMAT_NAME = "foresight-plan"
FORMAT_VERSION = 1


class Pieces(NamedTuple):
    """The pieces of items ``[start, stop)``: ``item_ptr`` (length stop-start+1, starting at 0)
    indexes the other four, which are views into the plan's arrays."""

    item_ptr: np.ndarray
    dataset: np.ndarray
    sample: np.ndarray
    offset: np.ndarray
    length: np.ndarray


class Plan:
    """A built or loaded plan. Build with :func:`foresight.plan.build_plan`, open with
    :func:`foresight.plan.load_plan`; ``plan.save(dir)`` writes it atomically."""

    array_dtypes = ARRAY_DTYPES  # the files of this plan kind (the compact kind has its own)

    def __init__(
        self,
        *,
        inputs: dict[str, Any],
        summary: dict[str, Any],
        arrays: dict[str, np.ndarray],
        digest: str | None = None,
        path: str | None = None,
    ) -> None:
        self.inputs = inputs
        self.summary = summary
        self.arrays = arrays
        self.path = path
        self._digest = digest
        self.item_ptr: np.ndarray = arrays["item_ptr"]
        self.piece_dataset: np.ndarray = arrays["piece_dataset"]
        self.piece_sample: np.ndarray = arrays["piece_sample"]
        self.piece_offset: np.ndarray = arrays["piece_offset"]
        self.piece_length: np.ndarray = arrays["piece_length"]

    # ---- scalar facts -------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``"tokens"`` (items are packed sequences) or ``"samples"`` (items are whole samples)."""
        return self.summary["kind"]

    @property
    def seq_len(self) -> int | None:
        return self.inputs["seq_len"]

    @property
    def global_batch_size(self) -> int:
        return self.inputs["global_batch_size"]

    @property
    def num_steps(self) -> int:
        return self.summary["num_steps"]

    @property
    def num_items(self) -> int:
        return self.summary["num_items"]

    @property
    def num_pieces(self) -> int:
        return self.summary["num_pieces"]

    @property
    def seed(self) -> int:
        return self.inputs["seed"]

    @property
    def dataset_fingerprints(self) -> list[str]:
        return [s["fingerprint"] for s in self.inputs["sources"]]

    @property
    def digest(self) -> str:
        """``"sha256:<hex>"`` over the canonical inputs, summary and array bytes."""
        if self._digest is None:
            self._digest = compute_digest(self.header(), self.arrays, ARRAY_DTYPES)
        return self._digest

    def header(self) -> dict[str, Any]:
        """Everything in plan.json except the digest."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "inputs": self.inputs,
            "summary": self.summary,
            "arrays": {
                name: {"dtype": ARRAY_DTYPES[name], "shape": [int(self.arrays[name].shape[0])]}
                for name in ARRAY_DTYPES
            },
        }

    # ---- lookups ------------------------------------------------------------------------------
    def step_items(self, step: int) -> tuple[int, int]:
        """Items ``(start, stop)`` of the global batch of ``step``."""
        step = self._check_step(step)
        b = self.global_batch_size
        return step * b, (step + 1) * b

    def rank_items(self, step: int, rank: int, world_size: int) -> tuple[int, int]:
        """Items ``(start, stop)`` of ``rank`` out of ``world_size`` at ``step``: a pure function of
        the global plan, so any world size sees the same global sequence."""
        step = self._check_step(step)
        b = self.global_batch_size
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise PlanError("world_size must be a positive integer", world_size=world_size)
        if b % world_size:
            raise PlanError(
                "global_batch_size must be divisible by world_size",
                global_batch_size=b, world_size=world_size,
            )
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise PlanError(f"rank must be in [0, {world_size})", rank=rank)
        per_rank = b // world_size
        start = step * b + int(rank) * per_rank
        return start, start + per_rank

    def pieces(self, start: int, stop: int) -> Pieces:
        """The pieces of items ``[start, stop)`` as zero-copy views (``item_ptr`` is rebased to 0)."""
        if not (0 <= start <= stop <= self.num_items):
            raise PlanError(f"item range must lie within [0, {self.num_items}]", start=start, stop=stop)
        ptr = np.asarray(self.item_ptr[start : stop + 1])
        lo, hi = int(ptr[0]), int(ptr[-1])
        return Pieces(
            ptr - lo,
            self.piece_dataset[lo:hi],
            self.piece_sample[lo:hi],
            self.piece_offset[lo:hi],
            self.piece_length[lo:hi],
        )

    def max_rank_pieces(self, end_step: int, world_size: int) -> int:
        """Most pieces in one rank's share (``global_batch_size / world_size`` items) of one step, over steps
        ``[0, end_step)``: what a loader sizes its buffers for. Exact here, read from ``item_ptr`` a chunk of steps
        at a time (bounded memory); :class:`~foresight.plan.CompactPlan` gives an upper bound without a walk."""
        b = self.global_batch_size
        per_rank = b // world_size
        steps = max(1, (1 << 20) // b)  # steps per chunk: about a million items
        most = 0
        for lo in range(0, min(int(end_step), self.num_steps), steps):
            hi = min(lo + steps, int(end_step), self.num_steps)
            ptr = np.asarray(self.item_ptr[lo * b : hi * b + 1], dtype=np.int64)
            most = max(most, int((ptr[per_rank::per_rank] - ptr[:-1:per_rank]).max()))
        return most

    def leading_piece_lengths(self, limit: int = 1 << 20) -> np.ndarray:
        """``piece_length`` of the plan's first pieces (at most ``limit``): a sample of piece sizes, e.g. to pick
        a transfer size."""
        return np.asarray(self.piece_length[: min(self.num_pieces, limit)], dtype=np.int64)

    def step_dict(self, step: int, *, rank: int | None = None, world_size: int | None = None) -> dict[str, Any]:
        """Step ``step`` (or one rank's share of it) as plain Python data, for debugging."""
        if (rank is None) != (world_size is None):
            raise PlanError("give both rank and world_size, or neither", rank=rank, world_size=world_size)
        start, stop = self.step_items(step) if rank is None else self.rank_items(step, rank, world_size)
        p = self.pieces(start, stop)
        items = []
        for i in range(stop - start):
            a, b = int(p.item_ptr[i]), int(p.item_ptr[i + 1])
            items.append({
                "item": start + i,
                "pieces": [
                    {"dataset": int(d), "sample": int(s), "offset": int(o), "length": int(n)}
                    for d, s, o, n in zip(p.dataset[a:b], p.sample[a:b], p.offset[a:b], p.length[a:b])
                ],
            })
        out: dict[str, Any] = {"step": int(step), "kind": self.kind, "digest": self.digest}
        if rank is not None:
            out.update(rank=int(rank), world_size=int(world_size))
        out.update(items=items)
        return out

    def step_json(self, step: int, *, rank: int | None = None, world_size: int | None = None,
                  indent: int | None = 1) -> str:
        """:meth:`step_dict` as JSON text."""
        return json.dumps(self.step_dict(step, rank=rank, world_size=world_size), indent=indent)

    def describe(self) -> dict[str, Any]:
        """Inputs, summary and digest: what ``foresight inspect`` prints for a plan."""
        return {"path": self.path, "digest": self.digest, "inputs": self.inputs, "summary": self.summary}

    def check_sources(self, datasets: Sequence[Any]) -> None:
        """Raise :class:`PlanError` unless ``datasets`` are the plan's sources, in order (same
        fingerprints and sample counts)."""
        sources = self.inputs["sources"]
        if len(datasets) != len(sources):
            raise PlanError("plan was built over a different number of datasets",
                            expected=len(sources), given=len(datasets))
        for i, (ds, src) in enumerate(zip(datasets, sources)):
            if str(ds.fingerprint) != src["fingerprint"] or int(ds.num_samples) != src["num_samples"]:
                raise PlanError("dataset does not match the one the plan was built over", source=i,
                                expected=src["fingerprint"], given=str(ds.fingerprint),
                                path=getattr(ds, "path", None))

    def save(self, path: str, *, overwrite: bool = False) -> str:
        """Write the plan directory atomically (temp dir, fsync, rename); returns ``path``."""
        return save_plan(self, path, overwrite=overwrite)

    def _check_step(self, step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < self.num_steps:
            raise PlanError(f"step must be in [0, {self.num_steps})", step=step)
        return int(step)

    def __repr__(self) -> str:
        return (f"Plan(kind={self.kind!r}, num_steps={self.num_steps}, global_batch_size={self.global_batch_size}, "
                f"seq_len={self.seq_len}, num_pieces={self.num_pieces}, path={self.path!r})")
