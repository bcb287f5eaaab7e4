"""Per-tensor xxh3_64 checksums over a staging or restore buffer.

Uses ``foresight._core.xxh3_batch`` (one native call, GIL released) when it exists, else the ``xxhash``
package, which releases the GIL on large inputs, so big tensors are hashed on a few threads at once.

Example::

    sums = checksums(memoryview(buf), offsets, nbytes)   # np.ndarray[uint64]
"""
from __future__ import annotations

import numpy as np
import xxhash

from foresight.checkpoint._workers import Workers

try:
    from foresight._core import xxh3_batch as _xxh3_batch
except Exception:  # noqa: BLE001 - optional native fast path
    _xxh3_batch = None

_PARALLEL_BYTES = 4 << 20
_pool: Workers | None = None  # started on first use (only without the native batch call)


def checksums(view: memoryview, offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """xxh3_64 of ``view[offsets[i] : offsets[i] + nbytes[i]]`` for every i, as uint64."""
    offsets = np.asarray(offsets, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if _xxh3_batch is not None:
        return np.asarray(_xxh3_batch(np.frombuffer(view, dtype=np.uint8), offsets, nbytes), dtype=np.uint64)
    global _pool
    if _pool is None:
        _pool = Workers(2, "xxh3")
    out = np.empty(len(offsets), dtype=np.uint64)
    digest = xxhash.xxh3_64_intdigest
    big = nbytes >= _PARALLEL_BYTES
    futures = {int(i): _pool.submit(digest, view[o:o + n])
               for i, o, n in zip(np.flatnonzero(big).tolist(), offsets[big].tolist(), nbytes[big].tolist())}
    small = np.flatnonzero(~big)
    out[small] = [digest(view[o:o + n]) for o, n in zip(offsets[small].tolist(), nbytes[small].tolist())]
    for i, f in futures.items():
        out[i] = f.result()
    return out
