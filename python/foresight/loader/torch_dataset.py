"""``torch.utils.data`` adapter for users who keep their ``DataLoader``.

The dataset yields whole batches (one per step), already collated by foresight, so wrap it with
``batch_size=None``. With ``num_workers=k`` the steps are dealt round-robin to the workers, and the DataLoader's
round-robin collection yields them back in plan order.

Example::

    ds = ForesightIterableDataset(dataset, plan)           # rank/world from torch.distributed if initialised
    for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
        ...
"""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from foresight.loader.loader import Loader, _resolve_rank


class ForesightIterableDataset(IterableDataset):
    """An ``IterableDataset`` over this rank's steps of a plan; each item is one step's batch as a dict."""

    def __init__(self, datasets: Any, plan: Any, *, rank: int | None = None, world_size: int | None = None,
                 start_step: int = 0, **loader_options: Any) -> None:
        super().__init__()
        self.datasets, self.plan = datasets, plan
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        self.start_step = start_step
        self.loader_options = loader_options

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        with Loader(self.datasets, self.plan, rank=self.rank, world_size=self.world_size,
                    start_step=self.start_step + worker, step_stride=workers, **self.loader_options) as loader:
            for batch in loader:
                # Leave the arena: the tensors cross the worker boundary and outlive the slot.
                yield dict(batch.clone())


__all__ = ["ForesightIterableDataset"]
