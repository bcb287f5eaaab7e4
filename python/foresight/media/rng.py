"""Counter-based random draws keyed by (seed, epoch, sample id, purpose): no global state.

The same key gives the same numbers on every machine and in every process, in any order of
calls, which is what lets the storage node and the training host produce identical tensors.

Example::

    rng = keyed_rng(seed=1234, epoch=0, sample_id=42, purpose="crop")
    x = rng.random()
"""
from __future__ import annotations

import numpy as np
import xxhash

_MASK64 = (1 << 64) - 1


def _purpose_code(purpose: str) -> int:
    return xxhash.xxh3_64_intdigest(purpose.encode())


def keyed_rng(*, seed: int, epoch: int, sample_id: int, purpose: str) -> np.random.Generator:
    """Return a Philox generator keyed by (seed, sample_id) with counter (0, 0, purpose, epoch).

    The draws advance counter word 0, so streams of different epochs/purposes never overlap.
    """
    key = np.array([int(seed) & _MASK64, int(sample_id) & _MASK64], dtype=np.uint64)
    counter = np.array([0, 0, _purpose_code(purpose), int(epoch) & _MASK64], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


__all__ = ["keyed_rng"]
