"""Replication: every copy of a checkpoint beyond the one the Checkpointer writes.

Two kinds, one room (it builds on :mod:`foresight.checkpoint` and :mod:`foresight.cluster`; the node daemon mounts
its handlers, never the other way round):

* **Restart replication** inside a cluster: :mod:`.hints` (which files a restart reads, and by how many ranks),
  :mod:`.hint_client` (send hints, watch copies, :class:`ReplicaReader`), :mod:`.replica_plan` (how many copies pay
  off), :mod:`.replica_manager` (the node's side: tasks in etcd, copies, TTL reclaim), :mod:`.hot_layout` (hot
  tensors in files of their own), :mod:`.host_share` (one read per host, shared through /dev/shm),
  :mod:`.restore_schedule` (the hint sent without holding the ranks; new copies join the reads).
* **Predictive replication** to an evaluation site: :mod:`.policy` (:class:`Replication`, the Checkpointer's
  hooks), :mod:`.units` (32 MiB checksummed units), :mod:`.scheduler` (:class:`PriorityLane`: urgent first, bulk
  never starved), :mod:`.service` (the node-side sender and receiver), :mod:`.resolver` (nearest complete copy),
  :mod:`.source` (local or remote coalesced reads), :mod:`.merge` (``foresight ckpt merge``: safetensors per module
  group), :mod:`.node_options` (``foresight node serve --site``), :mod:`.cli`; :mod:`.bucket_site` when the site is
  a bucket (``Replication(site="s3://...")``: multipart parts sent while saving, the marker last after the commit).

Each name loads its module on first use: the modules need torch, safetensors and pyarrow.flight.

Example::

    from foresight.replication import Replication, set_replication_hints
    ckpt = Checkpointer("/ckpt/job", replicate=Replication(every=1000, site="eval-b", node="grpc://10.0.0.2:8815",
                                                           job="job"))
"""
from __future__ import annotations

from foresight._lazy import lazy_attributes

_EXPORTS = {
    "Replication": "policy",
    "PriorityLane": "scheduler",
    "priority_of": "scheduler",
    "merge_checkpoint": "merge",
    "Resolver": "resolver",
    "FileHint": "hints",
    "derive_dcp_hints": "hints",
    "plan_replicas": "replica_plan",
    "set_replication_hints": "hint_client",
    "replication_progress": "hint_client",
    "wait_for_replicas": "hint_client",
    "ReplicaReader": "hint_client",
    "ReplicaManager": "replica_manager",
    "HotFileStorageWriter": "hot_layout",
    "HostShare": "host_share",
    "HintedRestore": "restore_schedule",
    "ReplicationService": "service",
}

__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())

__all__ = sorted(_EXPORTS)
