"""Ending ``torch.distributed`` in a process so that its exit cannot abort.

A gloo process group lives as long as anything references it, and FSDP/DDP modules, DTensors and device meshes
reference it from reference cycles that only the garbage collector breaks. Left to interpreter finalization, the
group's destructor then frees tensors from gloo's worker threads, which need the GIL of an interpreter that is being
torn down: the thread is unwound by ``pthread_exit`` inside a ``noexcept`` frame and the process dies with
"terminate called without an active exception" (SIGABRT) after all its work succeeded (seen on CI under load;
pytorch/pytorch#179291 describes the mechanism). :func:`end_process_groups` ends the groups while the interpreter is
whole, and :func:`run_then_end` runs a worker body so that its locals are gone before that.

Example::

    def worker(rank):
        dist.init_process_group("gloo", init_method=..., rank=rank, world_size=2)
        run_then_end(train, rank)      # train's model and optimizer are freed before the group is destroyed
"""
from __future__ import annotations

import gc
from typing import Any, Callable


def end_process_groups(*, barrier: bool = True) -> None:
    """Barrier (every rank is past its last collective), destroy every process group, then collect the cycles that
    still hold them so their native destructors run now, in a live interpreter. A no-op when none is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        gc.collect()
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def run_then_end(body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``body(*args, **kwargs)``, then :func:`end_process_groups` once its frame (and every module, optimizer and
    tensor it held) is gone; without the barrier when ``body`` raised, so a failing rank does not wait for peers
    that will never come."""
    try:
        result = body(*args, **kwargs)
    except BaseException:
        end_process_groups(barrier=False)
        raise
    end_process_groups()
    return result


__all__ = ["end_process_groups", "run_then_end"]
