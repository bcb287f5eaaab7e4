"""The Loader's arguments: the settings a user sets together, grouped in option objects, and every check of the
arguments and of a resume state (each refuses with a message that says what to pass instead).

Example::

    reads = ReadOptions(backend="pread", max_gap=-1)            # how steps are read
    steps = StepRange(start_step=10, end_step=100)              # which steps are yielded
    Loader(plan, datasets=ds, **reads.as_kwargs(), **steps.as_kwargs())  # the same as passing them one by one
"""
from __future__ import annotations

import numbers
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from foresight.errors import DeviceError, PlanError
from foresight.format import Modality
from foresight.io.coalesce import DEFAULT_MAX_GAP
from foresight.plan import Plan, load_plan

STATE_VERSION = 1  # of state_dict(); a state without "version" was written before the field and is version 1


@dataclass(frozen=True)
class ReadOptions:
    """How a step's bytes are read (the Loader's keyword arguments of the same names; see :class:`Loader`)."""

    backend: str = "auto"
    direct: bool = False
    queue_depth: int = 128
    max_gap: int = DEFAULT_MAX_GAP
    max_transfer: int | None = None
    verify: bool = False

    def as_kwargs(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepRange:
    """Which units the loader yields: ``range(start_step, end_step, step_stride)``, each step as
    ``micro_batches`` consecutive parts (the Loader's keyword arguments of the same names)."""

    start_step: int = 0
    end_step: int | None = None
    step_stride: int = 1
    micro_batches: int = 1

    def as_kwargs(self) -> dict:
        return asdict(self)


def check_state(state: Any, plan_digest: str, what: str) -> None:
    """Refuse a resume state this code cannot honour (resuming it would silently read the wrong steps).

    >>> check_state({"plan_digest": "ab", "next_step": 3}, "ab", "loader")  # no version: written as version 1
    """
    if not isinstance(state, dict):
        raise PlanError(f"{what} state must be a dict, got {type(state).__name__}")
    version = state.get("version", 1)
    if not is_int(version) or version != STATE_VERSION:
        raise PlanError(f"{what} state has format version {version!r}; this foresight reads version "
                        f"{STATE_VERSION} (a state from a newer foresight, or not a {what} state)")
    if state.get("plan_digest") != plan_digest:
        raise PlanError(f"{what} state belongs to another plan", expected=plan_digest, found=state.get("plan_digest"))
    step = state.get("next_step")
    if not is_int(step) or step < 0:
        raise PlanError(f"{what} state has a bad next_step {step!r} (a step number >= 0)")


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy ints too; True is not a step


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the ones given, else ``torch.distributed``'s when it is initialised, else 0 and 1.

    Example::

        rank, world_size = resolve_rank(None, None)     # (0, 1) outside torch.distributed
    """
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    try:
        import torch.distributed as dist  # lazy: torch is an optional extra; asked only without rank/world_size

        if dist.is_available() and dist.is_initialized():
            return (
                dist.get_rank() if rank is None else int(rank),
                dist.get_world_size() if world_size is None else int(world_size),
            )
    except ImportError:
        pass
    return (0 if rank is None else int(rank)), (1 if world_size is None else int(world_size))


def old_form_arguments(name: str, first: Any, rest: tuple, datasets: Any) -> tuple[Any, Any]:
    """``name(datasets, plan)``, the form before one calling convention: (datasets, plan), with a warning.

    The one convention is ``name(plan, datasets=...)``: a plan finds its datasets, so they are passed only to override.
    """
    if len(rest) != 1 or datasets is not None:
        raise TypeError(f"{name} takes one positional argument, the plan: {name}(plan, datasets=...) "
                        f"(got {1 + len(rest)} positional{' and datasets=' if datasets is not None else ''})")
    warnings.warn(f"{name}(datasets, plan) is the old form: use {name}(plan) (the plan finds its datasets) or "
                  f"{name}(plan, datasets=...) to override them", DeprecationWarning, stacklevel=3)
    return first, rest[0]


def as_plan(plan: Any):
    """A Plan from a Plan or a plan directory; anything else is refused with what to pass."""
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        return load_plan(plan)
    if isinstance(plan, Plan) or (hasattr(plan, "rank_items") and hasattr(plan, "digest")):
        return plan
    raise TypeError(f"Loader needs a plan: Loader(plan) or Loader(plan, datasets=...) with a Plan or a plan "
                    f"directory, got {type(plan).__name__}")


BATCH_KEYS = {"step", "dataset", "sample_ids", "data", "offsets", "lengths", "items"}


def check_meta_fields(names: Sequence[str]) -> None:
    """Meta fields become batch keys: refuse names the batch already uses (they would replace its data)."""
    taken = BATCH_KEYS | {m.label for m in Modality}
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"meta_fields must be non-empty strings, got {name!r}")
        if name in taken or name.endswith("_index"):
            raise ValueError(f"meta field {name!r} would replace the batch's own {name!r}; the batch keeps "
                             f"{sorted(taken)} and <modality>_index")


def check_micro_batches(k: Any, plan: Any, world_size: int, step_stride: int, source: Any) -> int:
    """``micro_batches`` checked against the rank's share of a step, and the options it cannot go with."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {k!r}")
    k = int(k)
    share = plan.global_batch_size // world_size
    if share % k:
        raise PlanError(f"a rank's share of a step ({share} items: global batch size {plan.global_batch_size} / "
                        f"world size {world_size}) does not split into {k} equal micro-batches",
                        micro_batches=k, share=share)
    if k > 1 and step_stride != 1:
        raise ValueError("micro_batches > 1 yields every step's parts in order: it takes no step_stride")
    if k > 1 and source is not None:
        raise ValueError("micro_batches > 1 is not available with source= (nodes serve whole steps)")
    return k


def check_verifiable(datasets: Sequence) -> None:
    """``verify=True`` needs a checksum per sample: refuse datasets that have none rather than check nothing."""
    for i, ds in enumerate(datasets):
        if ds.checksums() is None:
            raise ValueError(
                f"verify=True but dataset {i} ({getattr(ds, 'path', ds)}) has no checksums to verify "
                f"({type(ds).__name__}); open the loader with verify=False, or repack it with foresight pack"
            )


def check_device(device: Any) -> str:
    """``device`` as a string, once checked: a CUDA device this torch cannot use is one clear :class:`DeviceError`
    here, before any memory is set aside (rather than an assertion deep in the first copy).

    >>> check_device("cpu")
    'cpu'
    """
    name = str(device)
    if not name.startswith("cuda"):
        return name
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None else
               "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)")
        raise DeviceError(f"Loader(device={name!r}): {why} (torch {torch.__version__}); pass device='cpu', or "
                          f"install a CUDA build of torch", device=name)
    index = name.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise DeviceError(f"Loader(device={name!r}): no such CUDA device; this machine has "
                          f"{torch.cuda.device_count()} (cuda:0..cuda:{torch.cuda.device_count() - 1})", device=name)
    return name


__all__ = ["BATCH_KEYS", "STATE_VERSION", "ReadOptions", "StepRange", "as_plan", "check_device", "check_meta_fields",
           "check_micro_batches", "check_state", "check_verifiable", "is_int", "resolve_rank"]
