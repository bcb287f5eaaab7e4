"""The storage node: a daemon that prepares each job's coming steps next to the data, and its client.

* :class:`NodeServer` (``server.py``): Arrow Flight daemon; actions, per-job queues, CPU guard, metrics.
* :class:`NodeSource` (``client.py``): a loader decode stage whose decoding runs on the nodes, with local fallback.
The etcd membership, auth and service limit it shares with replication live in :mod:`foresight.cluster`.

Example::

    stage = MediaDecodeStage([ds], specs, seed=1)
    source = NodeSource(stage, plan, nodes=["grpc://127.0.0.1:7000"], token="t0ken-123")
    with Loader(ds, plan, decode=stage, source=source) as ld:
        for batch in ld: ...
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {"NodeServer": "server", "NodeSource": "client"}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _EXPORTS:
        raise AttributeError(f"module 'foresight.node' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"foresight.node.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
