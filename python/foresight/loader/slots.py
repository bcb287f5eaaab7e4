"""Arena slots: how large one step's slot is (from the plan, stated up front), and the engine, files and arena a
loader reads with.

A slot holds one rank's share of one step: the transfer region (the step's coalesced reads, alignment slack
included) and, for token plans, the rows region the pieces are gathered into. ``prefetch + 2`` slots are
allocated, pre-touched and pinned once.

Example::

    transfer, rows = slot_layout(plan, datasets, world_size=1, end_step=plan.num_steps, verify=False)
    io = LoaderIO.open(datasets, round_up(transfer + rows), slots=4, backend="auto", queue_depth=128, direct=False)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from foresight.io import IOEngine, open_file
from foresight.io.arena import Arena
from foresight.io.coalesce import DEFAULT_MAX_TRANSFER, transfer_limit_for
from foresight.source import ALIGN, FileTable, round_up

log = logging.getLogger("foresight.loader")

ALIGN_ALLOWANCE_CAP = 16 << 20  # most alignment slack a slot is sized for (see slot_layout)


def token_dtypes(datasets: Sequence) -> tuple[list[np.dtype], np.dtype]:
    """Each dataset's token dtype and the rows' (the widest): a mixture may hold uint16 and uint32 datasets (the
    packer picks the narrowest per dataset), narrower pieces are widened while they are gathered."""
    dtypes = [np.dtype(ds.token_dtype) for ds in datasets]
    return dtypes, np.result_type(*dtypes)


def slot_layout(plan: Any, datasets: Sequence, *, world_size: int, end_step: int, verify: bool,
                source: Any = None) -> tuple[int, int]:
    """Bytes of one slot's transfer region and rows region, from the plan (stated up front)."""
    n = plan.global_batch_size // world_size
    if plan.kind == "tokens":
        rows = n * (plan.seq_len + 1) * token_dtypes(datasets)[1].itemsize
        requested = max_whole_sample_bytes(plan, datasets, world_size, end_step) if verify else rows
        # the plan's own figure: exact from a materialized plan's item_ptr, a bound from a compact plan (whose
        # item_ptr would be computed from item 0: never walked here)
        max_pieces = plan.max_rank_pieces(end_step, world_size)
    else:
        rows = 0
        item_ptr = np.asarray(plan.item_ptr[: end_step * plan.global_batch_size + 1], dtype=np.int64)
        lengths = np.asarray(plan.piece_length[: int(item_ptr[-1])], dtype=np.int64)
        if source is not None:  # its samples are never read here: the slots need no room for them
            count = int(item_ptr[-1])
            lengths = np.where(source.decodes(np.asarray(plan.piece_dataset[:count]),
                                              np.asarray(plan.piece_sample[:count])), 0, lengths)
        per_item = np.add.reduceat(lengths, item_ptr[:-1]) if len(lengths) else np.zeros(0, np.int64)
        per_item[np.diff(item_ptr) == 0] = 0
        requested = max_rank_count(plan, world_size, per_item)
        max_pieces = max_rank_count(plan, world_size, np.diff(item_ptr))
    # Alignment costs at most 2*ALIGN per transfer (max_pieces transfers at max_gap=0), which for pieces far
    # smaller than ALIGN is many times the bytes requested; the allowance is that bound up to
    # ALIGN_ALLOWANCE_CAP (beyond it, a pathological step of thousands of tiny pieces reads into a one-off
    # buffer and says so, rather than every slot carrying that worst case). Coalescing across holes is
    # budgeted by the pipeline, which falls back to max_gap=0 for a step that would not fit.
    allowance = min(max_pieces * 2 * ALIGN, max(requested + 2 * ALIGN, ALIGN_ALLOWANCE_CAP))
    transfer = round_up(requested + allowance + ALIGN)
    return transfer, round_up(rows)


def max_whole_sample_bytes(plan: Any, datasets: Sequence, world_size: int, end_step: int) -> int:
    """Most bytes of whole samples one rank's share of one step reads, counting a sample once while consecutive
    pieces of the share repeat it (a long document cut into several rows), as
    ``step_extents(whole_samples=True)`` reads it. Repeats that are not consecutive are counted again: the
    bound stays an upper bound. Walks the steps the loader runs a chunk at a time through ``plan.pieces``
    (bounded memory; computed on demand from a compact plan)."""
    b = plan.global_batch_size
    n = b // world_size
    sample_bytes: dict[int, np.ndarray] = {}
    steps = max(1, (1 << 16) // b)
    most = 0
    for lo in range(0, end_step, steps):
        hi = min(lo + steps, end_step)
        p = plan.pieces(lo * b, hi * b)
        item_ptr = np.asarray(p.item_ptr, dtype=np.int64)
        p_dataset, p_sample = np.asarray(p.dataset), np.asarray(p.sample, dtype=np.int64)
        count = int(item_ptr[-1])
        sizes = np.zeros(count, dtype=np.int64)
        for d in np.unique(p_dataset):
            if int(d) not in sample_bytes:
                sample_bytes[int(d)] = np.asarray(datasets[int(d)].sample_bytes(), dtype=np.int64)
            mask = p_dataset == d
            sizes[mask] = sample_bytes[int(d)][p_sample[mask]]
        repeat = np.zeros(count, dtype=bool)
        repeat[1:] = (p_dataset[1:] == p_dataset[:-1]) & (p_sample[1:] == p_sample[:-1])
        share_starts = item_ptr[:-1][::n]
        repeat[share_starts[share_starts < count]] = False
        sizes[repeat] = 0
        cumulative = np.concatenate(([0], np.cumsum(sizes)))
        shares = cumulative[item_ptr[n::n]] - cumulative[item_ptr[:-1:n]]
        most = max(most, int(shares.max()) if shares.size else 0)
    return most


def max_rank_count(plan: Any, world_size: int, per_item: np.ndarray) -> int:
    """Largest sum of ``per_item`` over one rank's share of one step, across the steps ``per_item`` covers."""
    b = plan.global_batch_size
    steps = len(per_item) // b
    if steps == 0:
        return 0
    shares = per_item[: steps * b].reshape(steps, world_size, b // world_size).sum(axis=2)
    return int(shares.max())


def auto_max_transfer(plan: Any, datasets: Sequence) -> int:
    """``max_transfer`` from the mean piece size in bytes (the first million pieces stand for the plan)."""
    lengths = plan.leading_piece_lengths(1 << 20)
    if lengths.size == 0:
        return DEFAULT_MAX_TRANSFER
    mean = float(lengths.mean())
    if plan.kind == "tokens":
        mean *= token_dtypes(datasets)[1].itemsize
    return transfer_limit_for(mean, align=ALIGN)


@dataclass(eq=False)
class LoaderIO:
    """What one loader reads with: its engine (one per pipeline thread), the shard files, the arena of slots."""

    engine: Any
    files: FileTable
    arena: Any

    @classmethod
    def open(cls, datasets: Sequence, slot_bytes: int, *, slots: int, backend: str, queue_depth: int,
             direct: bool) -> "LoaderIO":
        """Open all three (closing what was opened if one fails) and register files and buffers with the engine
        where it can (an optimisation, never a requirement)."""
        engine = IOEngine(backend=backend, queue_depth=queue_depth)
        try:
            files = FileTable(datasets, open_file, direct=direct)
            try:
                # Huge pages: a 1 MiB transfer into 4 KiB pages needs 256 scatter-gather segments, more than a
                # virtio disk takes (max_segments 254), so the block layer splits it; 2 MiB pages keep large
                # transfers whole (bench/read_path.py: 1 MiB O_DIRECT 1.2 -> 2.1 GB/s). Ignored where THP is off.
                arena = Arena(slot_bytes, slots, hugepages=True)
            except BaseException:
                files.close()
                raise
        except BaseException:
            engine.close()
            raise
        io = cls(engine, files, arena)
        io.register()
        return io

    def register(self) -> None:
        try:
            self.engine.register_files(self.files.fds)
        except (AttributeError, OSError) as e:  # registration is an optimisation, never a requirement
            log.debug("file registration unavailable: %s", e)
        try:
            self.engine.register_buffers(self.arena.buffers())
        except (AttributeError, OSError) as e:
            log.debug("buffer registration unavailable: %s", e)

    def close(self) -> None:
        self.files.close()
        self.engine.close()
        self.arena.close()


class SlotLease:
    """Returns one arena slot to the pool, once."""

    def __init__(self, arena: Any, slot: int) -> None:
        self.arena, self.slot = arena, slot

    def __call__(self) -> None:
        self.arena.release(self.slot)


def size_text(n: int) -> str:
    """``n`` bytes for a log line: MiB from 1 MiB up, else KiB."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


__all__ = ["ALIGN_ALLOWANCE_CAP", "LoaderIO", "SlotLease", "auto_max_transfer", "max_rank_count",
           "max_whole_sample_bytes", "size_text", "slot_layout", "token_dtypes"]
