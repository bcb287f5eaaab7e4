"""``ArraySource``: a plan source made of plain numpy arrays (no files).

Anything with ``num_samples``, ``token_dtype``, ``fingerprint``, ``token_counts()`` and
``sample_bytes()`` can be planned over; ``foresight.format.Dataset`` is the usual one. This one
serves benchmarks, tests, and data whose sizes you already hold in memory.

Example::

    src = ArraySource(np.array([120, 7, 4000]), tokens=True)       # tokens per document
    plan = build_plan([(src, 1.0)], seed=0, global_batch_size=2, seq_len=64, num_steps=10)
"""
from __future__ import annotations

import hashlib

import numpy as np


class ArraySource:
    """Sizes per sample (tokens for ``tokens=True``, else bytes) as a plan source."""

    def __init__(self, sizes: np.ndarray, *, tokens: bool, token_dtype: str = "uint16",
                 fingerprint: str | None = None, path: str | None = None, modality: int = 0) -> None:
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        if sizes.ndim != 1:
            raise ValueError("sizes must be 1-D")
        self._sizes = sizes
        self.num_samples = int(sizes.shape[0])
        self.token_dtype = np.dtype(token_dtype) if tokens else None
        self.fingerprint = fingerprint or "sha256:" + hashlib.sha256(sizes.data).hexdigest()
        self.path = path
        self._modality = modality

    def token_counts(self) -> np.ndarray:
        if self.token_dtype is None:
            raise ValueError("not token data")
        return self._sizes

    def sample_bytes(self) -> np.ndarray:
        if self.token_dtype is None:
            return self._sizes
        return self._sizes * self.token_dtype.itemsize

    def modality_codes(self) -> np.ndarray:
        return np.full(self.num_samples, self._modality, dtype=np.uint8)
