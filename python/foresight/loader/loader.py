"""The plan-following loader: reads step N+1..N+prefetch while the model computes step N.

Example::

    from foresight import Loader, open_dataset, load_plan

    ds = open_dataset("data/")
    plan = load_plan("plan/")
    with Loader(ds, plan, prefetch=2, device="cuda") as loader:
        for batch in loader:
            loss = model(batch["input_ids"], labels=batch["labels"])
        ckpt = loader.state_dict()          # {"next_step": ..., "plan_digest": ...}

    with Loader("plan/") as loader: ...     # the datasets the plan recorded (plan/sources.json)

Per step the loader asks the plan for this rank's items, turns their pieces into file extents, coalesces them
into large aligned transfers, reads the transfers with one batch call of the native engine into a pinned arena
slot, and builds the batch as views of that slot (token rows need one gather pass). A background thread keeps
``prefetch`` steps in flight; memory is ``(prefetch + 2)`` slots, allocated and stated once at start-up.
"""
from __future__ import annotations

import logging
import numbers
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from foresight._closing import Closing
from foresight.errors import DeviceError, ForesightError, PlanError
from foresight.format import Modality
from foresight.io import IOEngine, open_file
from foresight.io.arena import Arena
from foresight.io.coalesce import DEFAULT_MAX_GAP, DEFAULT_MAX_TRANSFER, transfer_limit_for
from foresight.loader.batch import Batch
from foresight.loader.collate import document_boundaries, gather_tokens, position_ids
from foresight.loader.logs import ensure_default_logging
from foresight.loader.stats import LoaderStats
from foresight.plan import Plan, load_plan, open_plan_datasets
from foresight.source import (ALIGN, FileTable, Reads, StepExtents, anonymous_region, coalesce_extents, round_up,
                              step_extents)
from foresight.source.meta import meta_fields as pick_meta_fields, sample_metas

log = logging.getLogger("foresight.loader")

ALIGN_ALLOWANCE_CAP = 16 << 20  # most alignment slack a slot is sized for (see Loader._slot_layout)
STATE_VERSION = 1  # of state_dict(); a state without "version" was written before the field and is version 1

_END = object()


@dataclass
class _Failure:
    error: BaseException


@dataclass
class _Job:
    step: int
    micro_batch: int  # 0 without micro-batches
    start: int
    stop: int
    slot: int
    extents: StepExtents
    x_dest: np.ndarray
    region: np.ndarray
    ticket: Any
    overflow: np.ndarray | None
    reads: Reads | None = None  # engine arguments between _prepare and _start_reads


def check_state(state: Any, plan_digest: str, what: str) -> None:
    """Refuse a resume state this code cannot honour (resuming it would silently read the wrong steps).

    >>> check_state({"plan_digest": "ab", "next_step": 3}, "ab", "loader")  # no version: written as version 1
    """
    if not isinstance(state, dict):
        raise PlanError(f"{what} state must be a dict, got {type(state).__name__}")
    version = state.get("version", 1)
    if not _is_int(version) or version != STATE_VERSION:
        raise PlanError(f"{what} state has format version {version!r}; this foresight reads version "
                        f"{STATE_VERSION} (a state from a newer foresight, or not a {what} state)")
    if state.get("plan_digest") != plan_digest:
        raise PlanError(f"{what} state belongs to another plan", expected=plan_digest, found=state.get("plan_digest"))
    step = state.get("next_step")
    if not _is_int(step) or step < 0:
        raise PlanError(f"{what} state has a bad next_step {step!r} (a step number >= 0)")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy ints too; True is not a step


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the ones given, else ``torch.distributed``'s when it is initialised, else 0 and 1.

    Example::

        rank, world_size = resolve_rank(None, None)     # (0, 1) outside torch.distributed
    """
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    try:
        import torch.distributed as dist  # lazy: torch is an optional extra; asked only without rank/world_size

        if dist.is_available() and dist.is_initialized():
            return (
                dist.get_rank() if rank is None else int(rank),
                dist.get_world_size() if world_size is None else int(world_size),
            )
    except ImportError:
        pass
    return (0 if rank is None else int(rank)), (1 if world_size is None else int(world_size))


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


class Loader(Closing):
    """Yields this rank's batches in plan order; see the module docstring.

    Batch lifetime, one rule on every device: a batch is valid until the consumer asks for the next one (a new
    ``iter(loader)`` counts; with ``auto_release=False``: until ``batch.release()``; ``close()`` ends nothing).
    Its slot is then read into again, so host tensors that view it (``tokens``, ``data``) would show another
    step's bytes; instead every accessor of the old batch raises :class:`~foresight.errors.StaleBatchError`.
    Keep a batch longer with ``batch.clone()`` (or clone the tensors taken out of it: nothing can check those).
    CUDA batches follow the same rule, so code that runs on CPU runs unchanged on GPU. Do not start your own
    ``non_blocking`` copies out of a CPU batch's pinned views across steps: the slot may be refilled before
    they finish (``device="cuda"`` does this safely). A consumer that holds every slot (``auto_release=False``)
    gets an error from ``next()`` instead of waiting forever.

    Args:
        datasets: one dataset or the list the plan was built over (same order); or, with ``plan`` left out, the
            plan itself (``Loader("plan/")``): its datasets are then opened where the plan recorded them
            (:func:`foresight.plan.open_plan_datasets`; a moved dataset is looked for under ``search``, or
            refused with a :class:`~foresight.errors.PlanError` saying where it was expected), and closed with
            the loader.
        plan: a :class:`foresight.plan.Plan` or a plan directory.
        search: directories to look in for datasets the plan recorded but that moved (with ``FORESIGHT_DATA_PATH``).
        rank, world_size: default to ``torch.distributed`` when initialised, else 0 and 1.
        prefetch: steps kept in flight ahead of the consumer.
        device: ``"cpu"`` or a CUDA device; CUDA batches are copied with ``non_blocking=True`` from pinned memory.
        backend: I/O backend, ``"auto"``, ``"uring"`` or ``"pread"``.
        direct: open shard files with O_DIRECT (cold reads, no page cache).
        queue_depth: reads in flight at most; the engine's 64 MiB cap on bytes in flight lowers it for large
            extents (128 beat 64 by 9-10% and matched 256 at 4-64 KiB random reads, bench/read_path.py).
        max_gap, max_transfer: coalescing: merge extents across holes up to ``max_gap`` bytes into transfers of
            at most ``max_transfer`` bytes. ``max_gap=-1`` turns coalescing off (one read per extent).
            ``max_transfer=None`` sizes it from the plan's mean piece (4 MiB, more for samples over 256 KiB:
            :func:`foresight.io.coalesce.transfer_limit_for`).
        verify: check the xxh3 checksum (recorded at pack time) of every sample a step uses, in one native call
            per dataset and step; a mismatch raises :class:`~foresight.errors.ChecksumError` naming the shard
            file, the sample's offset and its id. Token plans use parts of samples, so with ``verify`` each
            sample a step touches is read whole (a long document cut over many steps is read and checked at
            each of them: more bytes read, same rows). Datasets without checksums (Megatron-LM ``.bin``/``.idx``)
            are refused with ``verify=True``.
        decode: optional stage ``(fields, *, stats, first_item) -> fields`` run on the loader thread once a
            step's reads complete, e.g. :class:`foresight.loader.MediaDecodeStage` (frame-selective decode).
        source: a :class:`foresight.node.NodeSource` (wrapping ``decode``'s stage) whose storage nodes read and
            decode the samples of the modalities it has specs for: the loader does not read those (it reads the
            other samples of the step as usual, into the arena), and the source reads here only what it must decode
            here (a node down, slow or deferring under its CPU guard). In the batch such samples have ``offsets``
            -1 and ``lengths`` 0 (none of their bytes are in ``data``); their tensors are ``batch[modality]``,
            bit for bit what ``decode`` alone gives. Sample plans only.
        auto_release: recycle a batch's slot when the consumer asks for the next one; ``False`` leaves it to
            ``batch.release()`` (the pipeline waits for a free slot once ``prefetch + 2`` are held).
        start_step, end_step, step_stride: the global steps to yield, ``range(start_step, end_step, step_stride)``
            (a stride deals steps to DataLoader workers).
        meta_fields: fields of each sample's meta JSON (recorded at pack time: ``caption`` from ``foresight pack
            media --captions``, labels, ids) to put in sample plans' batches: ``batch["caption"]`` is a list with
            one value per sample of the step (aligned with ``sample_ids``; None where a sample has no such
            field), and for each modality a decode stage produced, ``batch["image_caption"]`` is the values for
            ``batch["image"]``'s rows (``batch["image_index"]``'s positions). Looked up on the loader thread in
            one batch per shard (:mod:`foresight.source.meta`). Token plans are refused (rows cut documents).
        micro_batches: yield this rank's share of each step as this many batches of consecutive items, in plan
            order (Megatron's micro-batches of a global batch: gradient accumulation over them); each batch has
            ``batch.step`` and ``batch["micro_batch"]`` (0..k-1), and ``state_dict`` records the micro-batch to
            resume at. The share (``global_batch_size / world_size`` items) must divide by it. Not with
            ``step_stride`` > 1 or ``source``.
        on_step: called in the consumer's thread with a snapshot of :attr:`stats` (``stats.as_dict()`` plus
            ``"step"``, the batch's global step) each time a batch is handed out, before the consumer gets it:
            a metrics hook (log ``stall_s`` growth, export to Prometheus or TensorBoard). It should be quick.

    Logging: the loader logs one INFO line at start-up (backend, arena memory, fallbacks) and warns of runtime
    fallbacks (a step larger than its slot); with logging unconfigured the warnings go to stderr on their own and
    the start-up line with ``FORESIGHT_LOG=info`` (:mod:`foresight.loader.logs`: standard level names, default
    ``warning``).
    """

    def __init__(
        self,
        datasets: Any,
        plan: Any = None,
        *,
        search: Sequence[str] = (),
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        device: str = "cpu",
        backend: str = "auto",
        direct: bool = False,
        queue_depth: int = 128,
        max_gap: int = DEFAULT_MAX_GAP,
        max_transfer: int | None = None,
        verify: bool = False,
        decode: Callable[..., dict] | None = None,
        source: Any = None,
        auto_release: bool = True,
        start_step: int = 0,
        end_step: int | None = None,
        step_stride: int = 1,
        meta_fields: Sequence[str] = (),
        micro_batches: int = 1,
        on_step: Callable[[dict], Any] | None = None,
    ) -> None:
        ensure_default_logging()
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if plan is None:  # Loader("plan/"): the plan alone, its datasets from where it recorded them
            datasets, plan = None, datasets
        plan = _as_plan(plan)
        self._owned_datasets: list = []
        if datasets is None:
            datasets = self._owned_datasets = open_plan_datasets(plan, search=search)
        if not isinstance(datasets, (list, tuple)):
            datasets = [datasets]
        self.datasets: Sequence = list(datasets)
        self.plan = plan
        try:  # the datasets opened here are closed if set-up fails
            plan.check_sources(self.datasets)
            self.meta_fields = (meta_fields,) if isinstance(meta_fields, str) else tuple(meta_fields)
            if self.meta_fields and plan.kind == "tokens":
                raise ValueError("meta_fields needs a sample plan: token rows are cut across documents, so they "
                                 "have no per-sample meta (look documents up with batch['item_ptr'] instead)")
            _check_meta_fields(self.meta_fields)
            self.on_step = on_step
            if verify:
                _check_verifiable(self.datasets)
            self.rank, self.world_size = resolve_rank(rank, world_size)
            if plan.global_batch_size % self.world_size:
                raise PlanError(
                    "global batch size is not divisible by the world size",
                    global_batch_size=plan.global_batch_size,
                    world_size=self.world_size,
                )
            if not 0 <= self.rank < self.world_size:
                raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
            self.prefetch = int(prefetch)
            self.device = check_device(device)
            self.direct = bool(direct)
            self.max_gap = int(max_gap)
            self.verify = bool(verify)
            if source is None and callable(getattr(decode, "decodes", None)):
                source = decode  # Loader(decode=NodeSource(...)): the same as source=
            if source is not None:
                if plan.kind == "tokens":
                    raise ValueError("source= serves media of sample plans; token plans are read by the loader")
                if decode is not None and decode is not source and decode is not source.stage:
                    raise ValueError("source= wraps the decode stage: pass the same stage to both, or decode=None")
                decode = source
            self.source = source
            if source is not None and callable(getattr(source, "bind_rank", None)):
                source.bind_rank(self.rank, self.world_size)  # the source asks the nodes for this rank's share
            self.decode = decode
            self.auto_release = bool(auto_release)
            self.end_step = plan.num_steps if end_step is None else min(int(end_step), plan.num_steps)
            if step_stride < 1:
                raise ValueError(f"step_stride must be >= 1, got {step_stride}")
            self.step_stride = int(step_stride)
            self.micro_batches = _check_micro_batches(micro_batches, plan, self.world_size, self.step_stride,
                                                      self.source)
            # The pipeline runs over units: a step, or with micro-batches one of its k parts (unit = step*k + j).
            self._next_unit = int(start_step) * self.micro_batches
            self.stats = LoaderStats()

            self._tokens = plan.kind == "tokens"
            if self._tokens:
                # A mixture may hold uint16 and uint32 datasets (the packer picks the narrowest per dataset):
                # rows take the widest, narrower pieces are widened while they are gathered.
                self._dataset_dtypes = [np.dtype(ds.token_dtype) for ds in self.datasets]
                self._token_dtype = np.result_type(*self._dataset_dtypes)
            self._per_rank = plan.global_batch_size // self.world_size
            self._transfer_bytes, self._rows_bytes = self._slot_layout()
            self.max_transfer = self._auto_max_transfer() if max_transfer is None else int(max_transfer)
            slot_bytes = round_up(self._transfer_bytes + self._rows_bytes, ALIGN)
            nslots = self.prefetch + 2

            self._engine = IOEngine(backend=backend, queue_depth=queue_depth)
            try:
                self.stats.backend = self._engine.backend
                self._files = FileTable(self.datasets, open_file, direct=self.direct)
                try:
                    # Huge pages: a 1 MiB transfer into 4 KiB pages needs 256 scatter-gather segments, more than a
                    # virtio disk takes (max_segments 254), so the block layer splits it; 2 MiB pages keep large
                    # transfers whole (bench/read_path.py: 1 MiB O_DIRECT 1.2 -> 2.1 GB/s). Ignored where THP is off.
                    self._arena = Arena(slot_bytes, nslots, hugepages=True)
                except BaseException:
                    self._files.close()
                    raise
            except BaseException:
                self._engine.close()
                raise
            self._register()
            self._pending_events: deque = deque()
            fallback = getattr(self._engine, "fallback_reason", None)
            log.info(
                "loader rank %d/%d, backend=%s%s, %d slots x %s = %s host memory (%s), prefetch %d, "
                "transfers <= %s",
                self.rank, self.world_size, self._engine.backend,
                f" (io_uring unavailable: {fallback})" if fallback else "", nslots, _size(slot_bytes),
                _size(nslots * slot_bytes), "pinned" if self._arena.pinned else "not pinned", self.prefetch,
                _size(self.max_transfer),
            )
            self._thread: threading.Thread | None = None
            self._queue: queue.Queue = queue.Queue()
            self._stop = threading.Event()
            self._current: Batch | None = None
            self._held = 0  # host slots held by batches handed to the consumer and not yet released
            self._closed = False
        except BaseException:
            self._close_datasets()
            raise

    # -- set-up -------------------------------------------------------------------------------------------

    def _slot_layout(self) -> tuple[int, int]:
        """Bytes of one slot's transfer region and rows region, from the plan (stated up front)."""
        plan, n = self.plan, self._per_rank
        if self._tokens:
            rows = n * (plan.seq_len + 1) * self._token_dtype.itemsize
            requested = self._max_whole_sample_bytes() if self.verify else rows
            # the plan's own figure: exact from a materialized plan's item_ptr, a bound from a compact plan (whose
            # item_ptr would be computed from item 0: never walked here)
            max_pieces = plan.max_rank_pieces(self.end_step, self.world_size)
        else:
            rows = 0
            item_ptr = np.asarray(plan.item_ptr[: self._item_limit() + 1], dtype=np.int64)
            lengths = np.asarray(plan.piece_length[: int(item_ptr[-1])], dtype=np.int64)
            if self.source is not None:  # its samples are never read here: the slots need no room for them
                count = int(item_ptr[-1])
                lengths = np.where(self.source.decodes(np.asarray(plan.piece_dataset[:count]),
                                                       np.asarray(plan.piece_sample[:count])), 0, lengths)
            per_item = np.add.reduceat(lengths, item_ptr[:-1]) if len(lengths) else np.zeros(0, np.int64)
            per_item[np.diff(item_ptr) == 0] = 0
            requested = self._max_rank_count(per_item)
            max_pieces = self._max_rank_count(np.diff(item_ptr))
        # Alignment costs at most 2*ALIGN per transfer (max_pieces transfers at max_gap=0), which for pieces far
        # smaller than ALIGN is many times the bytes requested; the allowance is that bound up to
        # ALIGN_ALLOWANCE_CAP (beyond it, a pathological step of thousands of tiny pieces reads into a one-off
        # buffer and says so, rather than every slot carrying that worst case). Coalescing across holes is
        # budgeted below and falls back to max_gap=0 for a step that would not fit.
        allowance = min(max_pieces * 2 * ALIGN, max(requested + 2 * ALIGN, ALIGN_ALLOWANCE_CAP))
        transfer = round_up(requested + allowance + ALIGN, ALIGN)
        return transfer, round_up(rows, ALIGN)

    def _max_whole_sample_bytes(self) -> int:
        """Most bytes of whole samples one rank's share of one step reads, counting a sample once while consecutive
        pieces of the share repeat it (a long document cut into several rows), as
        ``step_extents(whole_samples=True)`` reads it. Repeats that are not consecutive are counted again: the
        bound stays an upper bound. Walks the steps this loader runs a chunk at a time through ``plan.pieces``
        (bounded memory; computed on demand from a compact plan)."""
        plan, b, n = self.plan, self.plan.global_batch_size, self._per_rank
        sample_bytes: dict[int, np.ndarray] = {}
        steps = max(1, (1 << 16) // b)
        most = 0
        for lo in range(0, self.end_step, steps):
            hi = min(lo + steps, self.end_step)
            p = plan.pieces(lo * b, hi * b)
            item_ptr = np.asarray(p.item_ptr, dtype=np.int64)
            p_dataset, p_sample = np.asarray(p.dataset), np.asarray(p.sample, dtype=np.int64)
            count = int(item_ptr[-1])
            sizes = np.zeros(count, dtype=np.int64)
            for d in np.unique(p_dataset):
                if int(d) not in sample_bytes:
                    sample_bytes[int(d)] = np.asarray(self.datasets[int(d)].sample_bytes(), dtype=np.int64)
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

    def _auto_max_transfer(self) -> int:
        """``max_transfer`` from the mean piece size in bytes (the first million pieces stand for the plan)."""
        lengths = self.plan.leading_piece_lengths(1 << 20)
        if lengths.size == 0:
            return DEFAULT_MAX_TRANSFER
        mean = float(lengths.mean())
        if self._tokens:
            mean *= self._token_dtype.itemsize
        return transfer_limit_for(mean, align=ALIGN)

    def _item_limit(self) -> int:
        return self.end_step * self.plan.global_batch_size

    def _max_rank_count(self, per_item: np.ndarray) -> int:
        """Largest sum of ``per_item`` over one rank's share of one step, across the steps this loader runs."""
        b, n = self.plan.global_batch_size, self._per_rank
        steps = len(per_item) // b
        if steps == 0:
            return 0
        shares = per_item[: steps * b].reshape(steps, self.world_size, n).sum(axis=2)
        return int(shares.max())

    def _register(self) -> None:
        try:
            self._engine.register_files(self._files.fds)
        except (AttributeError, OSError) as e:  # registration is an optimisation, never a requirement
            log.debug("file registration unavailable: %s", e)
        try:
            self._engine.register_buffers(self._arena.buffers())
        except (AttributeError, OSError) as e:
            log.debug("buffer registration unavailable: %s", e)

    # -- the pipeline thread -----------------------------------------------------------------------------

    def _acquire_slot(self, busy: _Job | None = None) -> int | None:
        """A free slot. While waiting, keep the engine fed with ``busy``'s reads (io_uring only moves new
        requests into the ring when the engine is called, so a pipeline blocked here would let it drain).
        None once ``busy``'s reads are done: that step goes to the consumer first, since the consumer may be
        the one holding the slots (``auto_release=False``) and would otherwise wait for it forever."""
        while not self._stop.is_set():
            while self._pending_events and self._pending_events[0][0].query():
                _, slot = self._pending_events.popleft()
                self._arena.release(slot)
            slot = self._arena.try_acquire(timeout=0.05 if busy is None else 0.002)
            if slot is not None:
                return slot
            if busy is not None and self._engine.poll(busy.ticket):
                return None
        raise _Stopped()

    def _submit(self, unit: int, busy: _Job | None = None) -> _Job | None:
        """Prepare ``unit`` (slot, extents, coalesced transfers) and start its reads; None as ``_prepare``."""
        job = self._prepare(unit, busy)
        return None if job is None else self._start_reads(job)

    @property
    def _unit_stride(self) -> int:
        return self.step_stride if self.micro_batches == 1 else 1

    def _unit_items(self, unit: int) -> tuple[int, int, int, int]:
        """``(step, micro_batch, start, stop)``: the plan items of this rank's part of ``unit``."""
        k = self.micro_batches
        step, micro = divmod(unit, k)
        start, stop = self.plan.rank_items(step, self.rank, self.world_size)
        size = (stop - start) // k
        return step, micro, start + micro * size, start + (micro + 1) * size

    def _prepare(self, unit: int, busy: _Job | None = None) -> _Job | None:
        """Everything before the engine call: done while earlier steps' reads run, so that when one of them
        completes the next step's reads go in at once instead of after a Python gap with a draining ring.
        None when no slot came free before ``busy``'s reads completed."""
        t0 = time.perf_counter()
        slot = self._acquire_slot(busy)
        if slot is None:
            return None
        t_slot = time.perf_counter()
        try:
            step, micro, start, stop = self._unit_items(unit)
            ext = step_extents(self.plan, self.datasets, self._files, start, stop,
                               whole_samples=self.verify and self._tokens)
            t1 = time.perf_counter()
            region = self._arena.slot(slot)[: self._transfer_bytes]
            # with a source, the samples its nodes decode are not read here
            read = None if self.source is None else ~self.source.decodes(ext.dataset, ext.sample)
            tr = self._coalesce(ext, self.max_gap, read)
            overflow = None
            if tr.total_bytes > self._transfer_bytes and self.max_gap > 0:
                tr = self._coalesce(ext, 0, read)
            if tr.total_bytes > self._transfer_bytes:  # rare: a step larger than the plan-derived bound
                overflow = anonymous_region(tr.total_bytes)
                region = overflow
                if not self.stats.slot_overflows:
                    log.warning("step %d needs %s of reads, more than an arena slot (%s): read into a one-off "
                                "buffer (further ones are counted in stats.slot_overflows)",
                                step, _size(tr.total_bytes), _size(self._transfer_bytes))
                self.stats.add(slot_overflows=1)
        except BaseException:
            self._arena.release(slot)
            raise
        x_dest = tr.x_dest
        if read is not None:  # -1: not read here (the source delivers it)
            x_dest = np.full(len(ext.offset), -1, dtype=np.int64)
            x_dest[read] = tr.x_dest
        job = _Job(step, micro, start, stop, slot, ext, x_dest, region, None, overflow)
        job.reads = Reads.into(self._files, tr, region)
        t2 = time.perf_counter()
        self.stats.add(
            slot_wait_s=t_slot - t0, plan_s=t1 - t_slot, coalesce_s=t2 - t1,
            extents=len(ext.offset) if read is None else int(read.sum()), ios=len(tr.t_offset),
            bytes_requested=int(ext.length.sum() if read is None else ext.length[read].sum()),
            bytes_read=int(tr.t_length.sum()),
        )
        return job

    def _start_reads(self, job: _Job) -> _Job:
        t0 = time.perf_counter()
        job.ticket = job.reads.submit(self._engine)
        job.reads = None
        self.stats.add(submit_s=time.perf_counter() - t0)
        return job

    def _coalesce(self, ext: StepExtents, max_gap: int, read: np.ndarray | None = None):
        """The step's transfers; ``read`` (a mask over its extents) limits them to those samples."""
        file, offset, length = ext.file, ext.offset, ext.length
        if read is not None:
            file, offset, length = file[read], offset[read], length[read]
        return coalesce_extents(file, offset, length, max_gap=max_gap, max_transfer=self.max_transfer)

    def _complete(self, job: _Job) -> Batch:
        """Verify and collate a step whose reads are done (waited for by the caller)."""
        if self.verify:
            with self.stats.timed("verify"):
                self._verify(job)
        t0 = time.perf_counter()
        fields = self._collate(job)
        last_part = job.micro_batch == self.micro_batches - 1  # a step counts once, with its last micro-batch
        self.stats.add(collate_s=time.perf_counter() - t0, steps=int(last_part), samples=job.stop - job.start)
        if self.decode is not None:
            fields = self.decode(fields, stats=self.stats, first_item=job.start)
        if self.meta_fields:
            with self.stats.timed("meta"):
                fields = self._add_meta_fields(fields)
        return Batch(job.step, fields, release=self._releaser(job.slot))

    def _add_meta_fields(self, fields: dict) -> dict:
        """``meta_fields`` per sample of the step, and per row of each decoded modality (``<name>_index``)."""
        metas = sample_metas(self.datasets, fields["dataset"], fields["sample_ids"])
        values = pick_meta_fields(metas, self.meta_fields)
        out = dict(fields)
        out.update(values)
        modalities = [k[: -len("_index")] for k in fields if k.endswith("_index") and k[: -len("_index")] in fields]
        for name in modalities:
            idx = np.asarray(fields[f"{name}_index"], dtype=np.int64)
            for field, per_sample in values.items():
                out[f"{name}_{field}"] = [per_sample[i] for i in idx.tolist()]
        return out

    def _collate(self, job: _Job) -> dict:
        ext = job.extents
        fields: dict[str, Any] = {
            "step": job.step,
            "dataset": ext.dataset if not self._tokens else None,
            "sample_ids": ext.sample,
        }
        if self.micro_batches > 1:
            fields["micro_batch"] = job.micro_batch
        if self._tokens:
            seq = self.plan.seq_len
            n_items = job.stop - job.start
            rows_region = self._arena.slot(job.slot)[self._transfer_bytes : self._transfer_bytes + self._rows_bytes]
            rows = rows_region[: n_items * (seq + 1) * self._token_dtype.itemsize].view(self._token_dtype)
            rows = rows.reshape(n_items, seq + 1)
            gather_tokens(job.region, ext.piece_positions(job.x_dest), ext.piece_tokens, rows,
                          piece_dataset=ext.dataset, dataset_dtypes=self._dataset_dtypes)
            cu = document_boundaries(ext.item_ptr, ext.piece_tokens, seq)
            fields.update(tokens=rows, cu_seqlens=cu, position_ids=position_ids(cu, n_items * seq).reshape(n_items, seq),
                          item_ptr=ext.item_ptr, dataset=ext.dataset)
        else:
            lengths = ext.length if self.source is None else np.where(job.x_dest >= 0, ext.length, 0)
            fields.update(data=job.region, offsets=job.x_dest, lengths=lengths, dataset=ext.dataset)
        return fields

    def _verify(self, job: _Job) -> None:
        """Hash every extent read for ``job`` (whole samples) in one native call per dataset."""
        ext = job.extents
        whole = ext.read_sample is not None  # token pieces widened to whole samples
        dataset, sample = (ext.read_dataset, ext.read_sample) if whole else (ext.dataset, ext.sample)
        here = job.x_dest >= 0  # with a source, only what was read here (nodes' raw bytes are checked by it)
        for d in np.unique(dataset):
            mask = (dataset == d) & (here if not whole else True)
            if mask.any():
                self.datasets[int(d)].verify_packed(sample[mask], job.region, job.x_dest[mask])

    def _releaser(self, slot: int) -> "_SlotLease":
        return _SlotLease(self._arena, slot)

    def _run(self, first: int, end: int) -> None:
        """Read and collate units ``range(first, end, stride)`` (steps, or micro-batches: see ``_next_unit``)."""
        inflight: deque[_Job] = deque()
        ready: _Job | None = None  # the next step, prepared while the oldest one's reads run
        stride = self._unit_stride
        try:
            unit = first
            while True:
                while unit < end and len(inflight) < self.prefetch and not self._stop.is_set():
                    job = self._submit(unit, inflight[0] if inflight else None)
                    if job is None:  # the oldest step is read: deliver it before waiting on for a slot
                        break
                    inflight.append(job)
                    unit += stride
                if not inflight or self._stop.is_set():
                    break
                if unit < end:
                    ready = self._prepare(unit, inflight[0])
                    if ready is not None:
                        unit += stride
                job = inflight[0]
                with self.stats.timed("io_wait"):
                    self._engine.wait(job.ticket)
                inflight.popleft()
                if ready is not None:  # refill the ring before the Python work of collating
                    inflight.append(self._start_reads(ready))
                    ready = None
                self._queue.put(self._complete(job))
            self._queue.put(_END)
        except _Stopped:
            pass
        except BaseException as e:  # surfaces in the consumer's next()
            self._queue.put(_Failure(e))
        finally:
            for job in inflight:  # drain the ring before the slots go back
                try:
                    self._engine.wait(job.ticket)
                except BaseException:
                    pass
                self._arena.release(job.slot)
            if ready is not None:
                self._arena.release(ready.slot)

    # -- the consumer side ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise ForesightError("loader is closed")
        self._start()
        try:
            while True:
                t0 = time.perf_counter()
                if self._current is not None and self.auto_release:
                    self._current.release()
                    self._current = None
                item = self._get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                self.stats.add(stall_s=time.perf_counter() - t0)
                batch = self._to_device(item)
                self._current = batch
                self._next_unit = batch.step * self.micro_batches + batch.get("micro_batch", 0) + self._unit_stride
                if self.on_step is not None:
                    self.on_step(dict(self.stats.as_dict(), step=batch.step))
                yield batch
        finally:
            self._stop_thread()

    def _get(self):
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._held >= self._arena.slots:  # nothing can free a slot but the consumer: never wait
                    return _Failure(ForesightError(
                        f"the consumer holds all {self._arena.slots} arena slots (auto_release=False and no "
                        f"batch released): release() a batch before asking for the next one"))
                if self._thread is None or not self._thread.is_alive():
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return _Failure(ForesightError("loader thread exited unexpectedly"))

    def _to_device(self, batch: Batch) -> Batch:
        import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

        t0 = time.perf_counter()
        fields = dict(batch._data)
        on_cuda = self.device.startswith("cuda")
        for key, value in list(fields.items()):
            if isinstance(value, np.ndarray):
                value = _tensor_of(value, self.device if on_cuda else None)
            elif on_cuda and isinstance(value, torch.Tensor):
                value = value.to(self.device, non_blocking=True)
            elif on_cuda and isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                value = [t.to(self.device, non_blocking=True) for t in value]
            fields[key] = value
        if self._tokens:
            wide = _widen_tokens(fields["tokens"])
            fields["input_ids"], fields["labels"] = wide[:, :-1], wide[:, 1:]
        release = batch._release
        batch._release = None
        if on_cuda and release is not None:
            event = torch.cuda.Event()
            event.record()
            self._pending_events.append((event, release.slot))
            release = _slot_freed_by_event  # the batch still goes stale at the next step: one rule everywhere
        elif release is not None:
            release = _ConsumerLease(self, release)
        self.stats.add(h2d_s=time.perf_counter() - t0)
        return Batch(batch.step, fields, release=release)

    def _start(self) -> None:
        self._stop_thread()
        if self.auto_release:  # a new iteration asks for the next batch: the last one goes stale only now
            self._release_current()
        self._stop.clear()
        self._queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(self._next_unit, self.end_step * self.micro_batches), name="foresight-loader",
            daemon=True
        )
        self._thread.start()

    def _stop_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        while thread.is_alive():  # unblock a pipeline waiting for a slot or the queue
            self._drain_queue()
            thread.join(timeout=0.05)
        self._drain_queue()

    def _release_current(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.release()

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Batch):
                item.release()

    # -- resume and lifetime -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the consumer is in the global plan; valid at any world size. With micro-batches, also the
        micro-batch of ``next_step`` to resume at (``micro_batch``, of ``micro_batches``)."""
        step, micro = divmod(self._next_unit, self.micro_batches)
        state = {"version": STATE_VERSION, "plan_digest": self.plan.digest, "next_step": int(step)}
        if self.micro_batches > 1:
            state.update(micro_batch=int(micro), micro_batches=self.micro_batches)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (of this plan and a state version this code knows, else PlanError).

        A state in the middle of a step (``micro_batch`` > 0) needs the same ``micro_batches``; one at a step
        boundary resumes with any."""
        check_state(state, self.plan.digest, "loader")
        micro, parts = state.get("micro_batch", 0), state.get("micro_batches", 1)
        if micro and parts != self.micro_batches:
            raise PlanError(f"loader state resumes at micro-batch {micro} of {parts} of step {state['next_step']}; "
                            f"this loader splits steps into {self.micro_batches} (pass micro_batches={parts})")
        if not _is_int(micro) or not 0 <= micro < max(parts, 1):
            raise PlanError(f"loader state has a bad micro_batch {micro!r} (of {parts})")
        self._stop_thread()
        self._next_unit = int(state["next_step"]) * self.micro_batches + int(micro)

    def __len__(self) -> int:
        """Batches left to yield (micro-batches, with ``micro_batches`` > 1)."""
        return len(range(self._next_unit, self.end_step * self.micro_batches, self._unit_stride))

    def close(self) -> None:
        if self._closed:
            return
        self._stop_thread()  # the batch the consumer holds stays valid: nothing reads into its slot any more
        for event, slot in self._pending_events:
            event.synchronize()
        self._pending_events.clear()
        self._closed = True
        self._files.close()
        self._engine.close()
        self._arena.close()
        self._close_datasets()

    def _close_datasets(self) -> None:
        """Close the datasets the loader opened itself (``Loader("plan/")``); the caller's stay open."""
        owned, self._owned_datasets = self._owned_datasets, []
        for ds in owned:
            ds.close()



def _as_plan(plan: Any):
    """A Plan from a Plan or a plan directory; anything else is refused with what to pass."""
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        return load_plan(plan)
    if isinstance(plan, Plan) or (hasattr(plan, "rank_items") and hasattr(plan, "digest")):
        return plan
    raise TypeError(f"Loader needs a plan: Loader(datasets, plan) or Loader(plan) with a Plan or a plan "
                    f"directory, got {type(plan).__name__}")


_BATCH_KEYS = {"step", "dataset", "sample_ids", "data", "offsets", "lengths", "items"}


def _check_meta_fields(names: Sequence[str]) -> None:
    """Meta fields become batch keys: refuse names the batch already uses (they would replace its data)."""
    taken = _BATCH_KEYS | {m.label for m in Modality}
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"meta_fields must be non-empty strings, got {name!r}")
        if name in taken or name.endswith("_index"):
            raise ValueError(f"meta field {name!r} would replace the batch's own {name!r}; the batch keeps "
                             f"{sorted(taken)} and <modality>_index")


def _check_micro_batches(k: Any, plan: Any, world_size: int, step_stride: int, source: Any) -> int:
    """``micro_batches`` checked against the rank's share of a step, and the options it cannot go with."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {k!r}")
    k = int(k)
    share = plan.global_batch_size // world_size
    if share % k:
        raise PlanError(f"a rank's share of a step ({share} items: global batch size {plan.global_batch_size} / "
                        f"world size {world_size}) does not split into {k} equal micro-batches",
                        micro_batches=k, share=share)
    if k > 1 and step_stride != 1:
        raise ValueError("micro_batches > 1 yields every step's parts in order: it takes no step_stride")
    if k > 1 and source is not None:
        raise ValueError("micro_batches > 1 is not available with source= (nodes serve whole steps)")
    return k


def _check_verifiable(datasets: Sequence) -> None:
    """``verify=True`` needs a checksum per sample: refuse datasets that have none rather than check nothing."""
    for i, ds in enumerate(datasets):
        if ds.checksums() is None:
            raise ValueError(
                f"verify=True but dataset {i} ({getattr(ds, 'path', ds)}) has no checksums to verify "
                f"({type(ds).__name__}); open the loader with verify=False, or repack it with foresight pack"
            )


def check_device(device: Any) -> str:
    """``device`` as a string, once checked: a CUDA device this torch cannot use is one clear :class:`DeviceError`
    here, before any memory is set aside (rather than an assertion deep in the first copy).

    >>> check_device("cpu")
    'cpu'
    """
    name = str(device)
    if not name.startswith("cuda"):
        return name
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None else
               "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)")
        raise DeviceError(f"Loader(device={name!r}): {why} (torch {torch.__version__}); pass device='cpu', or "
                          f"install a CUDA build of torch", device=name)
    index = name.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise DeviceError(f"Loader(device={name!r}): no such CUDA device; this machine has "
                          f"{torch.cuda.device_count()} (cuda:0..cuda:{torch.cuda.device_count() - 1})", device=name)
    return name


def _tensor_of(array: np.ndarray, device: str | None):
    """A tensor over ``array`` (no copy), moved to ``device`` with a non-blocking copy when given.

    torch's uint16/uint32 have few kernels (on CUDA not all copies), so those travel as the signed type of the
    same width and are viewed back as unsigned where they land: the bytes are the same.
    """
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    signed = {np.dtype(np.uint16): (np.int16, torch.uint16), np.dtype(np.uint32): (np.int32, torch.uint32)}
    as_signed = signed.get(array.dtype)
    tensor = torch.from_numpy(array.view(as_signed[0]) if as_signed else array)
    if device is not None:
        tensor = tensor.to(device, non_blocking=True)
    return tensor.view(as_signed[1]) if as_signed else tensor


def _widen_tokens(tokens):
    """int64 token ids from uint16/uint32/int64 tokens, on whatever device they are (signed view + mask)."""
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    masks = {torch.uint16: (torch.int16, 0xFFFF), torch.uint32: (torch.int32, 0xFFFFFFFF)}
    if tokens.dtype in masks:
        signed, mask = masks[tokens.dtype]
        return tokens.view(signed).to(torch.int64).bitwise_and_(mask)
    return tokens.to(torch.int64)


def _slot_freed_by_event() -> None:
    """A CUDA batch's lease: its slot goes back once the copies' event completes (``_acquire_slot``)."""


class _Stopped(Exception):
    pass


class _ConsumerLease:
    """A slot held by a batch the consumer has: counted, so that a consumer holding every slot gets an error
    instead of a pipeline waiting forever for one."""

    def __init__(self, loader: Loader, release: Callable[[], None]) -> None:
        self.loader, self.release = loader, release
        loader._held += 1

    def __call__(self) -> None:
        self.loader._held -= 1
        if not self.loader._closed:  # a closed loader's arena is gone; its memory lives while views do
            self.release()


class _SlotLease:
    """Returns one arena slot to the pool, once."""

    def __init__(self, arena, slot: int) -> None:
        self.arena, self.slot = arena, slot

    def __call__(self) -> None:
        self.arena.release(self.slot)


__all__ = ["Loader", "DEFAULT_MAX_GAP", "DEFAULT_MAX_TRANSFER", "resolve_rank"]
