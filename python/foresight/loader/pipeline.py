"""The loader's pipeline thread: steps N+1..N+prefetch in flight while the consumer works on step N.

Per unit (a step, or one of its micro-batches): wait for a free arena slot (feeding the engine meanwhile), turn the
plan's items into extents and coalesced transfers (:mod:`foresight.source`), start their reads; once the oldest
unit's reads are in, verify, collate (token rows, or sample views), run the decode stage (the media stage wiring:
``decode`` and ``meta_fields``) and queue the batch for the consumer.

:class:`StepPipeline` is the thread's half of :class:`~foresight.loader.Loader` (which inherits it): the Loader
sets up the state it works on (plan, datasets, engine, files, arena, stats, options) and runs :meth:`_run` on its
thread; the consumer's half (iteration, device handoff, resume) is in ``loader.py``.

Example::

    loader = Loader(plan, datasets=ds)      # StepPipeline._run runs on the "foresight-loader" thread once iterated
"""
from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from foresight.loader.batch import Batch
from foresight.loader.collate import document_boundaries, gather_tokens, position_ids
from foresight.loader.slots import SlotLease, size_text
from foresight.source import Reads, StepExtents, anonymous_region, coalesce_extents, step_extents
from foresight.source.reads import ALIGN, CACHED_ALIGN
from foresight.source.meta import meta_fields as pick_meta_fields, sample_metas

log = logging.getLogger("foresight.loader")

END = object()  # queued after the last batch


@dataclass
class Failure:
    """An error of the pipeline thread, queued: it surfaces in the consumer's ``next()``."""

    error: BaseException


class Stopped(Exception):
    """The consumer stopped the pipeline (``_stop`` set) while it waited for a slot."""


@dataclass
class Job:
    """One unit in flight: its items, slot, extents, where they land and the engine ticket."""

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
    submit_s: float = 0.0  # timings kept with the unit and added to the stats once, when it completes
    io_wait_s: float = 0.0


class StepPipeline:
    """The pipeline thread's methods of :class:`~foresight.loader.Loader`; see the module docstring."""

    def _acquire_slot(self, busy: Job | None = None) -> int | None:
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
        raise Stopped()

    def _submit(self, unit: int, busy: Job | None = None) -> Job | None:
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
        if 0 <= step < self.end_step:
            first, size, batch = self._rank_share
            start = first + step * batch + micro * size
        else:  # not a step the loader yields: the plan's checks say why
            first, stop = self.plan.rank_items(step, self.rank, self.world_size)
            size = (stop - first) // k
            start = first + micro * size
        return step, micro, start, start + size

    @functools.cached_property
    def _rank_share(self) -> tuple[int, int, int]:
        """``(first item of step 0's share, items per unit, items per step)``: the plan's ``rank_items(step)`` is
        step 0's shifted by ``step`` global batches, so the per-step argument checks run once, not per step."""
        start, stop = self.plan.rank_items(0, self.rank, self.world_size)
        return start, (stop - start) // self.micro_batches, self.plan.global_batch_size

    @functools.cached_property
    def _fetch_probes(self) -> list[tuple[int, Any]]:
        """``(dataset index, lookup_would_wait)`` of the datasets whose lookup may wait on a fetch (a bucket
        dataset's samples not yet in its cache); empty for local datasets, which never wait."""
        return [(d, ds.lookup_would_wait) for d, ds in enumerate(self.datasets) if hasattr(ds, "lookup_would_wait")]

    def _lookup_would_wait(self, start: int, stop: int) -> bool:
        """Whether looking up items ``[start, stop)`` would wait on a fetch."""
        if not self._fetch_probes:
            return False
        pieces = self.plan.pieces(start, stop)
        dataset, sample = np.asarray(pieces.dataset), np.asarray(pieces.sample)
        return any(probe(sample[dataset == d]) for d, probe in self._fetch_probes)

    def _prepare(self, unit: int, busy: Job | None = None) -> Job | None:
        """Everything before the engine call: done while earlier steps' reads run, so that when one of them
        completes the next step's reads go in at once instead of after a Python gap with a draining ring.
        None when no slot came free before ``busy``'s reads completed, or when ``unit``'s lookup would wait on a
        fetch while ``busy`` is read: that step goes to the consumer first (the first batch waits on its own
        samples' fetch, not on the next steps')."""
        step, micro, start, stop = self._unit_items(unit)
        if busy is not None and self._fetch_probes and self._lookup_would_wait(start, stop):
            return None
        t0 = time.perf_counter()
        slot = self._acquire_slot(busy)
        if slot is None:
            return None
        t_slot = time.perf_counter()
        try:
            ext = step_extents(self.plan, self.datasets, self._files, start, stop,
                               whole_samples=self.verify and self._tokens)
            t1 = time.perf_counter()
            region = self._arena.slot(slot)[: self._transfer_bytes]
            # with a source, the samples its nodes decode are not read here
            read = None if self.source is None else ~self.source.decodes(ext.dataset, ext.sample)
            max_gap, align = self._step_coalescing()
            tr = self._coalesce(ext, max_gap, align, read)
            overflow = None
            if tr.total_bytes > self._transfer_bytes and max_gap > 0:
                tr = self._coalesce(ext, 0, align, read)
            if tr.total_bytes > self._transfer_bytes:  # rare: a step larger than the plan-derived bound
                overflow = anonymous_region(tr.total_bytes)
                region = overflow
                if not self.stats.slot_overflows:
                    log.warning("step %d needs %s of reads, more than an arena slot (%s): read into a one-off "
                                "buffer (further ones are counted in stats.slot_overflows)",
                                step, size_text(tr.total_bytes), size_text(self._transfer_bytes))
                self.stats.add(slot_overflows=1)
        except BaseException:
            self._arena.release(slot)
            raise
        x_dest = tr.x_dest
        if read is not None:  # -1: not read here (the source delivers it)
            x_dest = np.full(len(ext.offset), -1, dtype=np.int64)
            x_dest[read] = tr.x_dest
        job = Job(step, micro, start, stop, slot, ext, x_dest, region, None, overflow)
        job.reads = Reads.into(self._files, tr, region)
        t2 = time.perf_counter()
        self.stats.add(  # the coalescer counted the extents it was given (those read here) and its transfers
            slot_wait_s=t_slot - t0, plan_s=t1 - t_slot, coalesce_s=t2 - t1, extents=len(tr.x_length),
            ios=tr.io_count, bytes_requested=tr.requested_bytes, bytes_read=tr.read_bytes,
            page_cache_steps=int(align == CACHED_ALIGN),  # one add per step: each is a lock round trip
        )
        return job

    def _start_reads(self, job: Job) -> Job:
        t0 = time.perf_counter()
        job.ticket = job.reads.submit(self._engine)
        job.reads = None
        job.submit_s = time.perf_counter() - t0  # added with the unit's other figures in _complete
        return job

    def _step_coalescing(self) -> tuple[int, int]:
        """``(max_gap, align)`` for the next step: the options (``ALIGN``: O_DIRECT's), or, while the page cache
        serves every read of buffered files, no holes (``max_gap`` at most 0) and ``CACHED_ALIGN``: a hole or an
        alignment pad read from the page cache is a copy that saves no device read (warm random reads got faster
        without holes; warm token pieces copied 1.5x their bytes with 4 KiB pads), while cold holes save I/Os.
        Decided from the reads completed since the last step was coalesced (none: the last decision stands)."""
        if self.direct:
            return self.max_gap, ALIGN
        requests, hits = self._engine.page_cache_counts()
        seen_requests, seen_hits = self._cache_seen
        if requests > seen_requests:
            self._page_cache_only = hits - seen_hits == requests - seen_requests
            self._cache_seen = (requests, hits)
        if self._page_cache_only:  # counted in stats.page_cache_steps by _prepare
            return min(self.max_gap, 0), CACHED_ALIGN
        return self.max_gap, ALIGN

    def _coalesce(self, ext: StepExtents, max_gap: int, align: int, read: np.ndarray | None = None):
        """The step's transfers; ``read`` (a mask over its extents) limits them to those samples."""
        file, offset, length = ext.file, ext.offset, ext.length
        if read is not None:
            file, offset, length = file[read], offset[read], length[read]
        return coalesce_extents(file, offset, length, max_gap=max_gap, max_transfer=self.max_transfer, align=align)

    def _complete(self, job: Job) -> Batch:
        """Verify and collate a step whose reads are done (waited for by the caller)."""
        if self.verify:
            with self.stats.timed("verify"):
                self._verify(job)
        t0 = time.perf_counter()
        fields = self._collate(job)
        last_part = job.micro_batch == self.micro_batches - 1  # a step counts once, with its last micro-batch
        self.stats.add(collate_s=time.perf_counter() - t0, steps=int(last_part), samples=job.stop - job.start,
                       submit_s=job.submit_s, io_wait_s=job.io_wait_s)
        job.submit_s = job.io_wait_s = 0.0  # counted: should the rest fail, _run adds nothing of them again
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

    def _collate(self, job: Job) -> dict:
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

    def _verify(self, job: Job) -> None:
        """Hash every extent read for ``job`` (whole samples) in one native call per dataset."""
        ext = job.extents
        whole = ext.read_sample is not None  # token pieces widened to whole samples
        dataset, sample = (ext.read_dataset, ext.read_sample) if whole else (ext.dataset, ext.sample)
        here = job.x_dest >= 0  # with a source, only what was read here (nodes' raw bytes are checked by it)
        for d in np.unique(dataset):
            mask = (dataset == d) & (here if not whole else True)
            if mask.any():
                self.datasets[int(d)].verify_packed(sample[mask], job.region, job.x_dest[mask])

    def _releaser(self, slot: int) -> SlotLease:
        return SlotLease(self._arena, slot)

    def _run(self, first: int, end: int) -> None:
        """Read and collate units ``range(first, end, stride)`` (steps, or micro-batches: see ``_next_unit``)."""
        inflight: deque[Job] = deque()
        ready: Job | None = None  # the next step, prepared while the oldest one's reads run
        completing: Job | None = None  # a step out of the ring whose batch is being made (its slot is ours)
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
                t0 = time.perf_counter()
                try:
                    self._engine.wait(job.ticket)
                finally:
                    job.io_wait_s = time.perf_counter() - t0
                completing = inflight.popleft()
                if ready is not None:  # refill the ring before the Python work of collating
                    inflight.append(self._start_reads(ready))
                    ready = None
                self._queue.put(self._complete(job))  # the batch holds the slot's lease from here
                completing = None
            self._queue.put(END)
        except Stopped:
            pass
        except BaseException as e:  # surfaces in the consumer's next()
            self._queue.put(Failure(e))
        finally:
            if completing is not None:  # its batch was never made (a failed verify, decode, collate)
                self.stats.add(submit_s=completing.submit_s, io_wait_s=completing.io_wait_s)
                self._arena.release(completing.slot)
            for job in inflight:  # drain the ring before the slots go back
                self.stats.add(submit_s=job.submit_s, io_wait_s=job.io_wait_s)  # its reads were started
                try:
                    self._engine.wait(job.ticket)
                except BaseException:
                    pass
                self._arena.release(job.slot)
            if ready is not None:
                self._arena.release(ready.slot)


__all__ = ["END", "Failure", "Job", "StepPipeline", "Stopped"]
