"""The plan-following loader: reads step N+1..N+prefetch while the model computes step N.

Example::

    from foresight import Loader, open_dataset, load_plan

    with Loader("plan/", prefetch=2, device="cuda") as loader:   # the datasets the plan recorded (sources.json)
        for batch in loader:
            loss = model(batch["input_ids"], labels=batch["labels"])
        ckpt = loader.state_dict()          # {"next_step": ..., "plan_digest": ...}

    ds = open_dataset("s3://data/wiki", cache_dir="/nvme/cache")
    with Loader(load_plan("plan/"), datasets=ds) as loader: ...     # datasets passed only to override

Per step the loader asks the plan for this rank's items, turns their pieces into file extents, coalesces them
into large aligned transfers, reads the transfers with one batch call of the native engine into a pinned arena
slot, and builds the batch as views of that slot (token rows need one gather pass). A background thread keeps
``prefetch`` steps in flight; memory is ``(prefetch + 2)`` slots, allocated and stated once at start-up.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator, Sequence


from foresight._closing import Closing
from foresight.errors import ForesightError, PlanError
from foresight.io.coalesce import DEFAULT_MAX_GAP, DEFAULT_MAX_TRANSFER
from foresight.loader.batch import Batch
from foresight.loader.device import ConsumerLease, cuda_event, slot_freed_by_event, to_device
from foresight.loader.logs import ensure_default_logging
from foresight.loader.options import (STATE_VERSION, ReadOptions, StepRange, as_plan, check_device, check_meta_fields,
                                      check_micro_batches, check_state, check_verifiable, is_int, old_form_arguments,
                                      resolve_rank)
from foresight.loader.pipeline import END, Failure, StepPipeline
from foresight.loader.slots import LoaderIO, auto_max_transfer, size_text, slot_layout, token_dtypes
from foresight.loader.stats import LoaderStats
from foresight.plan import open_plan_datasets
from foresight.source import round_up

log = logging.getLogger("foresight.loader")


class Loader(StepPipeline, Closing):
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

    One calling convention: ``Loader(plan, **options)``. The older ``Loader(datasets, plan)`` still works and
    warns (DeprecationWarning).

    Args:
        plan: a :class:`foresight.plan.Plan` or a plan directory.
        datasets: only to override where the plan recorded its datasets: one dataset or the list the plan was
            built over (same order), e.g. a dataset opened from a bucket. Left out, they are opened where the plan
            recorded them (:func:`foresight.plan.open_plan_datasets`; a moved dataset is looked for under
            ``search``, or refused with a :class:`~foresight.errors.PlanError` saying where it was expected), and
            closed with the loader.
        search: directories to look in for datasets the plan recorded but that moved (with ``FORESIGHT_DATA_PATH``).
        rank, world_size: default to ``torch.distributed`` when initialised, else 0 and 1.
        prefetch: steps kept in flight ahead of the consumer.
        device: ``"cpu"`` or a CUDA device; CUDA batches are copied with ``non_blocking=True`` from pinned memory.
        backend: I/O backend, ``"auto"``, ``"uring"`` or ``"pread"``.
        direct: open shard files with O_DIRECT (cold reads, no page cache).
        queue_depth: reads in flight at most; the engine's 64 MiB cap on bytes in flight lowers it for large
            extents (128 beat 64 by 9-10% and matched 256 at 4-64 KiB random reads, bench/read_path.py).
        max_gap, max_transfer: coalescing: merge extents across holes up to ``max_gap`` bytes into transfers of
            at most ``max_transfer`` bytes. ``max_gap=-1`` turns coalescing off (one read per extent). While the
            page cache serves every read (io_uring), steps are coalesced without holes or 4 KiB alignment pads
            (``stats.page_cache_steps``): there a hole or a pad is a wasted copy, not a saved device read.
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
        plan: Any,
        *old_form: Any,
        datasets: Any = None,
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
        if old_form:
            datasets, plan = old_form_arguments("Loader", plan, old_form, datasets)
        plan = as_plan(plan)
        self._owned_datasets: list = []
        if datasets is None:
            datasets = self._owned_datasets = open_plan_datasets(plan, search=search)
        if not isinstance(datasets, (list, tuple)):
            datasets = [datasets]
        self.datasets: Sequence = list(datasets)
        self.plan = plan
        # the settings a user sets together, grouped (the keyword arguments stay the API)
        self.read_options = ReadOptions(backend, bool(direct), queue_depth, int(max_gap), max_transfer, bool(verify))
        self.step_range = StepRange(start_step, end_step, step_stride, micro_batches)
        try:  # the datasets opened here are closed if set-up fails
            self._check_arguments(rank, world_size, meta_fields, on_step)
            self.prefetch = int(prefetch)
            self.device = check_device(device)
            self.direct, self.max_gap, self.verify = self.read_options.direct, self.read_options.max_gap, self.read_options.verify
            self._wire_source(decode, source)
            self.auto_release = bool(auto_release)
            self._set_steps(self.step_range)
            self.stats = LoaderStats()
            self._tokens = plan.kind == "tokens"
            if self._tokens:
                self._dataset_dtypes, self._token_dtype = token_dtypes(self.datasets)
            self._per_rank = plan.global_batch_size // self.world_size
            self._transfer_bytes, self._rows_bytes = slot_layout(plan, self.datasets, world_size=self.world_size,
                                                                 end_step=self.end_step, verify=self.verify,
                                                                 source=self.source)
            self.max_transfer = (auto_max_transfer(plan, self.datasets) if max_transfer is None
                                 else int(max_transfer))
            self._open_io()
            self._thread: threading.Thread | None = None
            self._queue: queue.SimpleQueue = queue.SimpleQueue()  # C put/get: no Python lock calls per step
            self._stop = threading.Event()
            self._current: Batch | None = None
            self._held = 0  # host slots held by batches handed to the consumer and not yet released
            self._closed = False
        except BaseException:
            self._close_datasets()
            raise

    # -- set-up -------------------------------------------------------------------------------------------

    def _check_arguments(self, rank: int | None, world_size: int | None, meta_fields: Sequence[str],
                         on_step: Callable[[dict], Any] | None) -> None:
        """The plan against the datasets, rank and world size, meta fields, ``verify``: refused before any memory
        is set aside."""
        plan = self.plan
        plan.check_sources(self.datasets)
        self.meta_fields = (meta_fields,) if isinstance(meta_fields, str) else tuple(meta_fields)
        if self.meta_fields and plan.kind == "tokens":
            raise ValueError("meta_fields needs a sample plan: token rows are cut across documents, so they "
                             "have no per-sample meta (look documents up with batch['item_ptr'] instead)")
        check_meta_fields(self.meta_fields)
        self.on_step = on_step
        if self.read_options.verify:
            check_verifiable(self.datasets)
        self.rank, self.world_size = resolve_rank(rank, world_size)
        if plan.global_batch_size % self.world_size:
            raise PlanError(
                "global batch size is not divisible by the world size",
                global_batch_size=plan.global_batch_size,
                world_size=self.world_size,
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    def _wire_source(self, decode: Callable[..., dict] | None, source: Any) -> None:
        """The decode stage and the node source (the media stage wiring): ``source`` wraps ``decode``."""
        if source is None and callable(getattr(decode, "decodes", None)):
            source = decode  # Loader(decode=NodeSource(...)): the same as source=
        if source is not None:
            if self.plan.kind == "tokens":
                raise ValueError("source= serves media of sample plans; token plans are read by the loader")
            if decode is not None and decode is not source and decode is not source.stage:
                raise ValueError("source= wraps the decode stage: pass the same stage to both, or decode=None")
            decode = source
        self.source = source
        if source is not None and callable(getattr(source, "bind_rank", None)):
            source.bind_rank(self.rank, self.world_size)  # the source asks the nodes for this rank's share
        self.decode = decode

    def _set_steps(self, steps: StepRange) -> None:
        plan = self.plan
        self.end_step = plan.num_steps if steps.end_step is None else min(int(steps.end_step), plan.num_steps)
        if steps.step_stride < 1:
            raise ValueError(f"step_stride must be >= 1, got {steps.step_stride}")
        self.step_stride = int(steps.step_stride)
        self.micro_batches = check_micro_batches(steps.micro_batches, plan, self.world_size, self.step_stride,
                                                 self.source)
        # The pipeline runs over units: a step, or with micro-batches one of its k parts (unit = step*k + j).
        self._next_unit = int(steps.start_step) * self.micro_batches

    def _open_io(self) -> None:
        """Engine, files and ``prefetch + 2`` slots, allocated once and stated in one log line."""
        slot_bytes = round_up(self._transfer_bytes + self._rows_bytes)
        nslots = self.prefetch + 2
        io = LoaderIO.open(self.datasets, slot_bytes, slots=nslots, backend=self.read_options.backend,
                           queue_depth=self.read_options.queue_depth, direct=self.direct)
        self._io = io
        self._engine, self._files, self._arena = io.engine, io.files, io.arena
        self.stats.backend = self._engine.backend
        self._pending_events: deque = deque()
        self._cache_seen = (0, 0)  # the engine's (requests, page-cache hits) when the last step was coalesced
        self._page_cache_only = False
        fallback = getattr(self._engine, "fallback_reason", None)
        log.info(
            "loader rank %d/%d, backend=%s%s, %d slots x %s = %s host memory (%s), prefetch %d, "
            "transfers <= %s",
            self.rank, self.world_size, self._engine.backend,
            f" (io_uring unavailable: {fallback})" if fallback else "", nslots, size_text(slot_bytes),
            size_text(nslots * slot_bytes), "pinned" if self._arena.pinned else "not pinned", self.prefetch,
            size_text(self.max_transfer),
        )

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
                if item is END:
                    return
                if isinstance(item, Failure):
                    raise item.error
                t1 = time.perf_counter()
                batch = self._to_device(item)
                self.stats.add(stall_s=t1 - t0, h2d_s=time.perf_counter() - t1)  # one lock round trip per step
                self._current = batch
                micro = batch._data.get("micro_batch", 0)  # the dict's get: Mapping.get raises and catches a KeyError
                self._next_unit = batch.step * self.micro_batches + micro + self._unit_stride
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
                    return Failure(ForesightError(
                        f"the consumer holds all {self._arena.slots} arena slots (auto_release=False and no "
                        f"batch released): release() a batch before asking for the next one"))
                if self._thread is None or not self._thread.is_alive():
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        return Failure(ForesightError("loader thread exited unexpectedly"))

    def _to_device(self, batch: Batch) -> Batch:
        """The device handoff (:mod:`foresight.loader.device`): tensors on ``device``, and the slot's lease: on CUDA
        the slot goes back once the copies' event completes; the batch still goes stale at the next step. Its time is
        the caller's ``h2d_s``."""
        fields = to_device(batch._data, self.device, tokens=self._tokens)
        release = batch._release
        batch._release = None
        if self.device.startswith("cuda") and release is not None:
            self._pending_events.append((cuda_event(), release.slot))
            release = slot_freed_by_event  # one rule everywhere: the batch goes stale at the next step
        elif release is not None:
            release = ConsumerLease(self, release)
        return Batch(batch.step, fields, release=release)

    def _start(self) -> None:
        self._stop_thread()
        if self.auto_release:  # a new iteration asks for the next batch: the last one goes stale only now
            self._release_current()
        self._stop.clear()
        self._queue = queue.SimpleQueue()
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
        if not is_int(micro) or not 0 <= micro < max(parts, 1):
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
        self._io.close()
        self._close_datasets()

    def _close_datasets(self) -> None:
        """Close the datasets the loader opened itself (``Loader("plan/")``); the caller's stay open."""
        owned, self._owned_datasets = self._owned_datasets, []
        for ds in owned:
            ds.close()


__all__ = ["Loader", "DEFAULT_MAX_GAP", "DEFAULT_MAX_TRANSFER", "STATE_VERSION", "ReadOptions", "StepRange",
           "check_state", "resolve_rank"]
