"""foresight.io: getting bytes from files into memory fast.

* :class:`IOEngine` (``engine.py``): batched reads/writes through the C engine, io_uring or a
  pread thread pool, GIL released, every failure named by file, offset and request.
* :func:`coalesce` (``coalesce.py``): one step's extents merged into few large aligned transfers.
* :class:`Arena` (``arena.py``): page-aligned, pre-touched (and pinned) host memory the reads land in.

Example::

    from foresight.io import IOEngine, open_file

    fd = open_file("data/shard-00000.bin", direct=True)
    with IOEngine(queue_depth=64) as eng:
        print(eng.backend)        # "uring" or "pread"
        got = eng.read_batch(fd, offsets, lengths, addrs)
"""
from __future__ import annotations

from typing import Any

from .durable import fsync_dir, fsync_path
from .engine import BACKENDS, ENV_BACKEND, IOEngine, fdatasync, fsync, get_backend, open_file

# coalesce/arena sit on foresight._core. Imported eagerly so that `foresight.io.coalesce` is the
# function, not the submodule; if they fail to import, the engine still works and the error
# surfaces on first use of their names.
_LAZY = {"coalesce": "coalesce", "Transfers": "coalesce", "Arena": "arena"}
try:
    from .coalesce import Transfers, coalesce
except ImportError:
    pass
try:
    from .arena import Arena
except ImportError:
    pass


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'foresight.io' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "IOEngine",
    "open_file",
    "fsync",
    "fdatasync",
    "fsync_dir",
    "fsync_path",
    "get_backend",
    "BACKENDS",
    "ENV_BACKEND",
    "coalesce",
    "Transfers",
    "Arena",
]
