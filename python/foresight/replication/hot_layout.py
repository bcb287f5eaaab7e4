"""A DCP storage writer that keeps the tensors every rank reads in their own file, so hints copy only them.

Replication is per file. :class:`~foresight.checkpoint.dcp.ForesightStorageWriter` packs each rank's items into one
``__{rank}_data.bin``, so the rank that saves the replicated (whole) tensors packs them with its shards of the
sharded ones, and a replication hint for the hot tensors copies those cold shards to every new replica as well
(:meth:`~foresight.replication.replica_plan.ReplicaPlan.wasteful` reports such files). :class:`HotFileStorageWriter`
writes the items every rank reads -- whole tensors and bytes items -- to ``__{rank}_hot_data.bin`` and the shards
of sharded tensors to ``__{rank}_data.bin``; the reader and the hints need nothing new.

Example::

    dcp.save(state, storage_writer=HotFileStorageWriter("ckpt/step-100"))
    hints = derive_dcp_hints("ckpt/step-100", world_size=2048)   # the hot file: hot_bytes == its size
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.futures import Future

from foresight.checkpoint.dcp import ForesightStorageWriter, _Prefix

HOT = "hot_"


def read_by_every_rank(item: WriteItem) -> bool:
    """A bytes item, or a tensor saved whole (its one chunk is the tensor): every rank that loads it reads it."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return True
    chunk, size = item.tensor_data.chunk, tuple(item.tensor_data.size)
    return all(o == 0 for o in chunk.offsets) and tuple(chunk.sizes) == size


class HotFileStorageWriter(ForesightStorageWriter):
    """:class:`~foresight.checkpoint.dcp.ForesightStorageWriter` with the hot items in a file of their own."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[Any]]:
        prefix = plan.storage_data.prefix if plan.storage_data is not None else f"__{self.rank or 0}_"
        hot = [i for i in plan.items if read_by_every_rank(i)]
        cold = [i for i in plan.items if not read_by_every_rank(i)]
        results: list[Any] = []
        for items, name in ((cold, prefix), (hot, prefix + HOT)):
            if items or (name == prefix and not hot):  # a rank with nothing still writes its (empty) data file
                sub = dataclasses.replace(plan, items=items, storage_data=_Prefix(name))
                results += super().write_data(sub, planner).wait()
        fut: Future[list[Any]] = Future()
        fut.set_result(results)
        return fut


__all__ = ["HotFileStorageWriter", "read_by_every_rank"]
