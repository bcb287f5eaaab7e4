"""Loader statistics: per-stage time, the stall the consumer saw, bytes and I/Os.

Example::

    loader = Loader(dataset, plan)
    for batch in loader: ...
    print(loader.stats)             # a table
    loader.stats.as_dict()["io_wait_s"]
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Iterator

STAGES = ("plan", "coalesce", "submit", "io_wait", "collate", "decode", "h2d", "stall")


@dataclass
class LoaderStats:
    """Counters are cumulative since the loader started; times are seconds of wall clock per stage."""

    backend: str = "?"
    steps: int = 0
    samples: int = 0
    extents: int = 0
    ios: int = 0
    bytes_requested: int = 0
    bytes_read: int = 0
    slot_overflows: int = 0
    plan_s: float = 0.0
    coalesce_s: float = 0.0
    submit_s: float = 0.0
    io_wait_s: float = 0.0
    collate_s: float = 0.0
    decode_s: float = 0.0
    h2d_s: float = 0.0
    stall_s: float = 0.0
    decode_by_modality_s: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{f"{stage}_s": time.perf_counter() - t0})

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, value in amounts.items():
                setattr(self, name, getattr(self, name) + value)

    def add_decode(self, modality: str, seconds: float) -> None:
        with self._lock:
            self.decode_s += seconds
            self.decode_by_modality_s[modality] = self.decode_by_modality_s.get(modality, 0.0) + seconds

    @property
    def amplification(self) -> float:
        """Bytes read per byte requested (>= 1 with coalescing across gaps and alignment)."""
        return self.bytes_read / self.bytes_requested if self.bytes_requested else 1.0

    def as_dict(self) -> dict:
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            out["decode_by_modality_s"] = dict(self.decode_by_modality_s)
        out["amplification"] = self.amplification
        return out

    def __str__(self) -> str:
        d = self.as_dict()
        lines = [
            f"backend={d['backend']} steps={d['steps']} samples={d['samples']} extents={d['extents']} "
            f"ios={d['ios']} requested={d['bytes_requested'] / 1e6:.1f}MB read={d['bytes_read'] / 1e6:.1f}MB "
            f"amplification={d['amplification']:.3f}"
        ]
        lines.append("  ".join(f"{s}={d[s + '_s'] * 1e3:.1f}ms" for s in STAGES))
        return "\n".join(lines)


__all__ = ["LoaderStats", "STAGES"]
