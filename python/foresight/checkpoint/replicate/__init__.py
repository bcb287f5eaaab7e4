"""Predictive checkpoint replication to an evaluation site, a priority lane, a namespace resolver, and merge.

A job declares where and how often it is evaluated (:class:`Replication`); each checkpoint an evaluation will
read starts crossing the WAN as soon as its data file is written, in a few large checksummed units
(:mod:`.units`) sent by the training site's node in priority order (:mod:`.scheduler`: urgent evaluations
overtake bulk replication, bulk is never starved), and becomes visible at the evaluation site only after the
source commit. Readers find the nearest complete copy through etcd (:mod:`.resolver`), and
``foresight ckpt merge`` (:mod:`.merge`) turns it into one safetensors file per module group.
:mod:`.wan` is the test bed's delaying link.

Example::

    from foresight.checkpoint.replicate import Replication
    ckpt = Checkpointer("/ckpt/job", replicate=Replication(every=1000, site="eval-b", node="grpc://10.0.0.2:8815",
                                                           job="job"))
"""
from __future__ import annotations

__all__ = ["Replication", "PriorityLane", "priority_of", "merge_checkpoint", "Resolver"]


def __getattr__(name: str):  # submodules pull in pyarrow.flight, etcd3gw, safetensors: load on use
    if name == "Replication":
        from foresight.checkpoint.replicate.policy import Replication

        return Replication
    if name in ("PriorityLane", "priority_of"):
        from foresight.checkpoint.replicate import scheduler

        return getattr(scheduler, name)
    if name == "merge_checkpoint":
        from foresight.checkpoint.replicate.merge import merge_checkpoint

        return merge_checkpoint
    if name == "Resolver":
        from foresight.checkpoint.replicate.resolver import Resolver

        return Resolver
    raise AttributeError(name)
