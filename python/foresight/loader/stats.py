"""Loader statistics: per-stage time, the stall the consumer saw, bytes and I/Os (every field explained in
docs/config.md, "Loader statistics").

Example::

    loader = Loader(plan, datasets=dataset)
    for batch in loader: ...
    print(loader.stats)             # a table
    loader.stats.as_dict()["io_wait_s"]
    Loader(plan, datasets=dataset, on_step=lambda s: metrics.log(s["step"], stall=s["stall_s"]))   # per step
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Iterator

STAGES = ("plan", "slot_wait", "coalesce", "submit", "io_wait", "verify", "collate", "decode", "meta", "h2d",
          "stall")


@dataclass
class LoaderStats:
    """Counters are cumulative since the loader was created; times are seconds of wall clock summed over steps.

    The pipeline thread runs ``plan``, ``slot_wait``, ``coalesce``, ``submit``, ``io_wait``, ``verify``,
    ``collate``, ``decode`` and ``meta`` for steps ahead of the consumer; ``h2d`` and ``stall`` are spent in the
    consumer's ``next()``. Only ``stall_s`` is time the training loop waited; the other stages overlap with it.

    Fields:
        backend: the I/O backend in use, ``"uring"`` or ``"pread"``.
        steps: steps collated (read, verified, collated; decoded when a decode stage is given).
        samples: items of those steps on this rank (token plans: rows; other plans: samples).
        extents: byte ranges asked for: one per plan piece, or per distinct sample with ``verify`` on token plans.
        ios: reads issued after coalescing (at most ``extents`` unless coalescing is off).
        bytes_requested: bytes of the extents (what the samples need).
        bytes_read: bytes of the reads, with alignment and the holes coalescing read across (>= requested).
        slot_overflows: steps larger than the arena slot sized at start-up, read into a one-off buffer instead.
        page_cache_steps: steps coalesced without reading holes (``max_gap`` 0) or O_DIRECT's 4 KiB pads (aligned
            to 8 bytes only) because every read completed since the step before was served from the page cache,
            where a hole or a pad costs a copy and saves no device read.
        plan_s: turning the plan's items into file extents.
        slot_wait_s: waiting for a free arena slot: the consumer holds every other slot (prefetch is full, or
            batches are kept with ``auto_release=False``) or CUDA copies out of them have not finished.
        coalesce_s: merging extents into aligned transfers (the slot wait excluded).
        submit_s: handing a step's reads to the engine.
        io_wait_s: waiting for a step's reads to complete.
        verify_s: hashing the samples read and comparing with the checksums (``verify=True``).
        collate_s: building the batch's fields (token rows: the gather pass, positions, boundaries).
        decode_s: the decode stage (media), waiting for its pool; ``decode_by_modality_s`` splits it.
        meta_s: looking up and parsing the samples' meta JSON for ``Loader(meta_fields=...)``.
        h2d_s: making tensors of the fields and, on CUDA, queuing their copies to the device.
        stall_s: the consumer waiting for the next batch (the loader did not keep up).
        decode_by_modality_s: ``decode_s`` per modality name (``"video"``, ``"image"``, ``"audio"``).
        amplification (property): ``bytes_read / bytes_requested``.
    """

    backend: str = "?"
    steps: int = 0
    samples: int = 0
    extents: int = 0
    ios: int = 0
    bytes_requested: int = 0
    bytes_read: int = 0
    slot_overflows: int = 0
    page_cache_steps: int = 0
    plan_s: float = 0.0
    slot_wait_s: float = 0.0
    coalesce_s: float = 0.0
    submit_s: float = 0.0
    io_wait_s: float = 0.0
    verify_s: float = 0.0
    collate_s: float = 0.0
    decode_s: float = 0.0
    meta_s: float = 0.0
    h2d_s: float = 0.0
    stall_s: float = 0.0
    decode_by_modality_s: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall time of the ``with`` block to ``<stage>_s``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{f"{stage}_s": time.perf_counter() - t0})

    def add(self, **amounts: float) -> None:
        """Add to counters by name, e.g. ``add(steps=1, io_wait_s=0.002)`` (thread-safe)."""
        counters = self.__dict__  # the fields' values: no getattr/setattr round trip per name
        with self._lock:
            for name, value in amounts.items():
                if name not in counters:
                    raise AttributeError(f"LoaderStats has no counter {name!r}")
                counters[name] += value

    def add_decode(self, modality: str, seconds: float) -> None:
        """Add ``seconds`` to ``decode_s`` and to ``decode_by_modality_s[modality]``."""
        with self._lock:
            self.decode_s += seconds
            self.decode_by_modality_s[modality] = self.decode_by_modality_s.get(modality, 0.0) + seconds

    @property
    def amplification(self) -> float:
        """Bytes read per byte requested (>= 1 with coalescing across gaps and alignment)."""
        return self.bytes_read / self.bytes_requested if self.bytes_requested else 1.0

    def as_dict(self) -> dict:
        """Every field above plus ``amplification``, as plain Python values (a consistent snapshot)."""
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            out["decode_by_modality_s"] = dict(self.decode_by_modality_s)
        out["amplification"] = self.amplification
        return out

    def __str__(self) -> str:
        d = self.as_dict()
        lines = [
            f"backend={d['backend']} steps={d['steps']} samples={d['samples']} extents={d['extents']} "
            f"ios={d['ios']} requested={_size(d['bytes_requested'])} read={_size(d['bytes_read'])} "
            f"amplification={d['amplification']:.3f}"
        ]
        lines.append("  ".join(f"{s}={d[s + '_s'] * 1e3:.1f}ms" for s in STAGES))
        return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes in the unit that keeps them readable: '612 B', '4.0 KiB', '1.50 GiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} B"


__all__ = ["LoaderStats", "STAGES"]
