"""foresight.distributed: a worker's gloo groups end while its interpreter is whole, with what held them freed first."""
from __future__ import annotations

import json
import os
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp

from foresight.distributed import end_process_groups, run_then_end

WORLD = 2


def _worker(rank: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    held = {}

    def train() -> None:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        fully_shard(model)  # FSDP's hooks put the module (and through it the group) in reference cycles
        model(torch.randn(4, 8)).sum().backward()
        held["model"] = weakref.ref(model)

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=WORLD)
    run_then_end(train)
    report = {"initialized_after": dist.is_initialized(), "model_alive_after": held["model"]() is not None}
    end_process_groups()  # none left: a no-op, not an error
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def test_run_then_end_frees_the_cycles_and_destroys_the_group(tmp_path):
    tmp_mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)  # an abort at exit fails the join
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {"initialized_after": False, "model_alive_after": False}
