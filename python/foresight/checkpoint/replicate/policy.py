"""A job's replication policy: which checkpoints an evaluation site will read, and the hooks that ship them.

``Replication(every=1000, site="eval-b", node=..., job=...)`` is handed to the checkpoint writer, which calls
three hooks from its background thread: :meth:`Replication.data_written` once a checkpoint's data files are on
disk (the training site's node starts sending units while the writer is still committing),
:meth:`Replication.committed` after the atomic commit (only now may the replica be published), and
:meth:`Replication.aborted` when the save failed (the partial replica is never published). Steps the schedule
does not name are not sent, unless :meth:`Replication.urgent` asks for one (an anomaly: evaluate now), which
also raises the priority of a transfer already in flight.

The checkpoint directory must lie under the training site's node ``--root`` (the node reads the data files
itself and refuses paths outside its root); the replica's name is ``<job>/<directory name>``.

For ``torch.distributed.checkpoint``, :class:`ReplicatingStorageWriter` wraps foresight's DCP writer: the
coordinator starts the replica when every rank's data file is written (``finish``, before ``.metadata``) and
commits it once ``.metadata`` is in place.

Example::

    rep = Replication(every=1000, site="eval-b", node="grpc://train-node:8815", job="llm-7b", importance=2.0)
    ckpt = Checkpointer("/data/ckpt/llm-7b", replicate=rep)
    ...
    rep.urgent(step, severity=0.8)          # a loss spike: this step's evaluation jumps the queue
    rep.wait(step)                          # {"path": ..., "ready_at": ...}
"""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from foresight.checkpoint import store
from foresight.checkpoint.replicate.scheduler import priority_of
from foresight.checkpoint.replicate.units import check_name
from foresight.errors import CheckpointError


@dataclass
class Replication:
    """Replicate every ``every``-th step to ``site`` through the training site's node at ``node``."""

    every: int
    site: str
    node: str
    job: str
    importance: float = 1.0
    token: str = ""
    unit_bytes: int | None = None
    _started: dict[int, str] = field(default_factory=dict, repr=False)
    _paths: dict[int, str] = field(default_factory=dict, repr=False)
    _sizes: dict[int, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _client: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        check_name(self.job)

    def name(self, step: int, leaf: str | None = None) -> str:
        return f"{self.job}/{leaf or store.step_name(step)}"

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def _call(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        from foresight.checkpoint.replicate.service import call
        from pyarrow import flight

        with self._lock:
            if self._client is None:
                self._client = flight.connect(self.node)
        try:
            return call(self.node, action, {**body, "token": self.token}, client=self._client)
        except flight.FlightError as e:
            raise CheckpointError(f"replication {action} failed: {e}", node=self.node) from e

    def _priority(self, step: int, severity: float = 0.0) -> float:
        return priority_of(model_bytes=self._sizes.get(step, 0), importance=self.importance, severity=severity)

    # -- hooks called by the writer --------------------------------------------------------------
    def data_written(self, step: int, directory: str, *, nbytes: int = 0, leaf: str | None = None) -> None:
        """The data files of ``step`` are written in ``directory`` (not yet committed)."""
        self._sizes[step] = nbytes
        if not self.wants(step):
            return
        name = self.name(step, leaf)
        self._call("replicate.start", {"name": name, "src": os.path.abspath(directory), "site": self.site,
                                       "priority": self._priority(step), "unit_bytes": self.unit_bytes})
        self._started[step] = name

    def committed(self, step: int, path: str) -> None:
        """``step`` is committed at ``path``: the replica may be published once its units arrived."""
        self._paths[step] = os.path.abspath(path)
        for old in sorted(self._paths)[:-8]:  # remember a few recent steps for urgent evaluations
            del self._paths[old]
        name = self._started.get(step)
        if name is not None:
            self._call("replicate.commit", {"name": name, "path": self._paths[step]})

    def aborted(self, step: int) -> None:
        name = self._started.pop(step, None)
        if name is not None:
            self._call("replicate.abort", {"name": name})

    # -- API for the training loop ---------------------------------------------------------------
    def urgent(self, step: int, severity: float = 1.0) -> str:
        """Evaluate ``step`` now: raise its transfer's priority, or start one for an unscheduled committed step."""
        prio = self._priority(step, severity)
        name = self._started.get(step)
        if name is not None:
            self._call("replicate.urgent", {"name": name, "priority": prio})
            return name
        path = self._paths.get(step)
        if path is None:
            raise CheckpointError("step is not committed here (or too old to evaluate urgently)", step=step)
        name = self.name(step, os.path.basename(path))
        self._call("replicate.start", {"name": name, "src": path, "site": self.site, "priority": prio,
                                       "unit_bytes": self.unit_bytes})
        self._started[step] = name
        self._call("replicate.commit", {"name": name, "path": path})
        return name

    def wait(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        """Block until ``step``'s replica is published; returns where and when."""
        name = self._started.get(step)
        if name is None:
            raise CheckpointError("step is not being replicated", step=step)
        return self._call("replicate.wait", {"name": name, "timeout": timeout})

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


@functools.cache
def _dcp_writer_class() -> type:
    from foresight.checkpoint.dcp import ForesightStorageWriter

    class ReplicatingStorageWriter(ForesightStorageWriter):
        """:class:`~foresight.checkpoint.dcp.ForesightStorageWriter` that replicates per a :class:`Replication`.

        ``step`` names the checkpoint for the schedule; the replica's name is ``<job>/<directory name>``.
        """

        def __init__(self, path: str | os.PathLike, *, replicate: Replication, step: int, **kwargs: Any) -> None:
            super().__init__(path, **kwargs)
            self.replicate, self.step = replicate, step

        def finish(self, metadata: Any, results: Any) -> None:
            leaf = os.path.basename(os.path.normpath(self.path))
            nbytes = sum(wr.size_in_bytes for wrs in results for wr in wrs)
            self.replicate.data_written(self.step, self.path, nbytes=nbytes, leaf=leaf)
            try:
                super().finish(metadata, results)
            except BaseException:
                self.replicate.aborted(self.step)
                raise
            self.replicate.committed(self.step, self.path)

    return ReplicatingStorageWriter


def __getattr__(name: str) -> Any:  # the DCP writer imports torch.distributed: only on use
    if name == "ReplicatingStorageWriter":
        return _dcp_writer_class()
    raise AttributeError(name)
