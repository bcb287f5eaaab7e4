"""The storage node: a daemon that prepares each job's coming steps next to the data, and its client.

* :class:`NodeServer` (``server.py``): Arrow Flight daemon; actions, per-job queues, CPU guard, metrics.
* :class:`NodeSource` (``client.py``): a loader decode stage whose decoding runs on the nodes, with local fallback.
The etcd membership, auth and service limit it shares with replication live in :mod:`foresight.cluster`.

Example::

    stage = MediaDecodeStage([ds], specs, seed=1)
    source = NodeSource(stage, plan, nodes=["grpc://127.0.0.1:7000"], token="t0ken-123")
    with Loader(plan, datasets=ds, decode=stage, source=source) as ld:
        for batch in ld: ...
"""
from __future__ import annotations

from foresight._lazy import lazy_attributes

_EXPORTS = {"NodeServer": "server", "NodeSource": "client"}

__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())

__all__ = sorted(_EXPORTS)
