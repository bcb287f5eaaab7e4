"""``torch.utils.data`` adapter for users who keep their ``DataLoader`` (or torchdata's ``StatefulDataLoader``).

The dataset yields whole batches (one per step), already collated by foresight, so wrap it with
``batch_size=None``. With ``num_workers=k`` the steps are dealt round-robin to the workers (worker ``w`` reads
steps ``start + w, start + w + k, ...``), and the DataLoader's round-robin collection yields them back in plan
order. Each batch is cloned out of the worker's arena (it crosses a process boundary and outlives its slot).

Resume: the dataset is ``Stateful`` (``state_dict`` / ``load_state_dict``), so torchdata's ``StatefulDataLoader``
saves each worker's next step with every batch it hands out and restores them exactly: a loader resumed from
``dl.state_dict()`` yields exactly the batches an uninterrupted run would have yielded after that point (resume
with the same ``num_workers``). A plain ``DataLoader`` with workers cannot report the workers' progress; use
``StatefulDataLoader``, or ``num_workers=0`` and the dataset's own ``state_dict``.

Example::

    from torchdata.stateful_dataloader import StatefulDataLoader
    from foresight import ForesightIterableDataset

    ds = ForesightIterableDataset("plan/")          # datasets from the plan, rank from torch.distributed
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    for batch in dl:
        ...
        ckpt = {"data": dl.state_dict()}
    dl2 = StatefulDataLoader(ForesightIterableDataset("plan/"), batch_size=None, num_workers=2)
    dl2.load_state_dict(ckpt["data"])                                   # continues where dl was
"""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from foresight.loader.loader import Loader
from foresight.loader.options import STATE_VERSION, as_plan, check_state, old_form_arguments, resolve_rank


class ForesightIterableDataset(IterableDataset):
    """An ``IterableDataset`` over this rank's steps of a plan; each item is one step's batch as a dict.

    Args:
        plan: a Plan or a plan directory; each worker opens the datasets it recorded.
        datasets: as :class:`~foresight.loader.Loader`: only to override where the plan recorded them. (The older
            ``ForesightIterableDataset(datasets, plan)`` still works and warns.)
        rank, world_size: default to ``torch.distributed`` when initialised (resolved here, in the parent).
        start_step, end_step: the global steps to yield, ``range(start_step, end_step)``.
        loader_options: passed to each worker's :class:`~foresight.loader.Loader` (``prefetch``, ``decode``,
            ``meta_fields``, ``backend``, ``search`` ...).

    ``len(ds)`` is the number of steps (batches) it yields in one pass from ``start_step``.
    """

    def __init__(self, plan: Any, *old_form: Any, datasets: Any = None, rank: int | None = None,
                 world_size: int | None = None, start_step: int = 0, end_step: int | None = None,
                 **loader_options: Any) -> None:
        super().__init__()
        if old_form:
            datasets, plan = old_form_arguments("ForesightIterableDataset", plan, old_form, datasets)
        self.datasets, self.plan = datasets, plan
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.start_step, self.end_step = int(start_step), end_step
        if loader_options.get("micro_batches", 1) != 1:  # its workers and resume deal in whole steps
            raise ValueError("micro_batches is a Loader option: ForesightIterableDataset yields whole steps (split "
                             "a step's batch in the training loop, or use Loader(..., micro_batches=k))")
        self.loader_options = loader_options
        self._plan_info: tuple[str, int] | None = None  # (digest, num_steps), read once
        self._resume: dict | None = None  # a loaded state: this copy's next step
        self._next: int | None = None  # the next step of the iteration under way

    # -- what it yields ------------------------------------------------------------------------------

    def _info(self) -> tuple[str, int]:
        if self._plan_info is None:
            plan = as_plan(self.plan)
            self._plan_info = (plan.digest, plan.num_steps)
        return self._plan_info

    def _end(self) -> int:
        num_steps = self._info()[1]
        return num_steps if self.end_step is None else min(int(self.end_step), num_steps)

    def __len__(self) -> int:
        return max(0, self._end() - self.start_step)

    @staticmethod
    def _worker() -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def _first_step(self) -> int:
        worker, workers = self._worker()
        if self._resume is None:
            return self.start_step + worker
        if self._resume["step_stride"] != workers:
            raise ValueError(f"this state was saved with {self._resume['step_stride']} DataLoader workers, the "
                             f"loader now has {workers}: resume with the same num_workers")
        return int(self._resume["next_step"])

    def __iter__(self) -> Iterator[dict]:
        _, workers = self._worker()
        first = self._first_step()
        self._next = first
        with Loader(self.plan, datasets=self.datasets, rank=self.rank, world_size=self.world_size, start_step=first,
                    end_step=self.end_step, step_stride=workers, **self.loader_options) as loader:
            for batch in loader:
                # Before the yield: StatefulDataLoader asks for the state once this item is fetched.
                self._next = batch.step + workers
                # Leave the arena: the tensors cross the worker boundary and outlive the slot.
                yield dict(batch.clone())
        self._next = max(self._next, self._end())
        self._resume = None  # the next pass starts over

    # -- resume ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This copy's position: the next step it yields and the stride it deals steps with (its worker count).

        Called by ``StatefulDataLoader`` in each worker; without workers it is the whole loader's position.
        """
        _, workers = self._worker()
        next_step = self._next if self._next is not None else self._first_step()
        return {"version": STATE_VERSION, "plan_digest": self._info()[0], "next_step": int(next_step),
                "step_stride": workers}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; the state must belong to the same plan."""
        check_state(state, self._info()[0], "dataset")
        self._resume = {"next_step": int(state["next_step"]), "step_stride": int(state["step_stride"])}
        self._next = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_next"] = None  # a worker starts its own iteration
        return state


__all__ = ["ForesightIterableDataset", "STATE_VERSION"]
