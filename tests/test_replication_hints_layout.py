"""The hot-file layout: 2 gloo ranks save a DTensor-sharded weight beside replicated tensors; with
HotFileStorageWriter the replicated ones sit in a file of their own (a hint copies no cold bytes), with the plain
writer they share a file with a shard (the planner reports it as wasteful). Both load back the same tensors."""
from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp_mp

from foresight.checkpoint.dcp import ForesightStorageWriter
from foresight.checkpoint.dcp_reader import ForesightStorageReader
from foresight.replication.hints import derive_dcp_hints
from foresight.replication.hot_layout import HotFileStorageWriter
from foresight.replication.replica_plan import plan_replicas
from foresight.distributed import run_then_end

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORLD = 2
NODES = {f"n{i}": 0.0 for i in range(4)}


def _weight() -> torch.Tensor:
    return torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)  # 64 KiB: 32 KiB per rank


def _replicated() -> dict:
    return {"emb": torch.ones(16, 16), "norm": torch.arange(8.0), "meta": {"step": 100}}


def _worker(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    def save_both() -> None:
        mesh = init_device_mesh("cpu", (WORLD,))
        state = {"w": distribute_tensor(_weight(), mesh, [Shard(0)]), **_replicated()}
        dcp.save(state, storage_writer=HotFileStorageWriter(os.path.join(root, "hot")))
        dcp.save(state, storage_writer=ForesightStorageWriter(os.path.join(root, "plain")))

    try:
        run_then_end(save_both)  # the DTensors and mesh are freed before gloo ends (foresight.distributed)
    except BaseException:
        with open(os.path.join(root, f"rank{rank}.failed"), "w") as f:
            f.write(traceback.format_exc())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("hot_layout"))
    tmp_mp.spawn(_worker, args=(root,), nprocs=WORLD, join=True)
    failures = [open(os.path.join(root, f)).read() for f in os.listdir(root) if f.endswith(".failed")]
    assert not failures, "\n".join(failures)
    return root


def test_replicated_tensors_get_a_file_of_their_own(saved):
    hints = {h.path: h for h in derive_dcp_hints(os.path.join(saved, "hot"), world_size=WORLD)}
    hot = [h for p, h in hints.items() if "hot_" in p]
    assert len(hot) == 1 and hot[0].readers == WORLD and hot[0].granularity_waste < hot[0].size / 2
    shards = [h for p, h in hints.items() if p.endswith("_data.bin") and "hot_" not in p]
    assert len(shards) == WORLD and all(h.readers == 1 for h in shards)  # each rank's shard: its owner reads it
    plan = plan_replicas(list(hints.values()), NODES, safe_readers=1, base_replicas=1)
    assert plan.wasteful() == []


def test_the_plain_layout_mixes_them_and_the_planner_says_so(saved):
    hints = derive_dcp_hints(os.path.join(saved, "plain"), world_size=WORLD)
    mixed = [h for h in hints if h.path != ".metadata" and h.readers == WORLD]
    assert len(mixed) == 1 and mixed[0].granularity_waste > mixed[0].size / 2  # a 32 KiB shard rides along
    plan = plan_replicas(hints, NODES, safe_readers=1, base_replicas=1)
    assert [f.path for f in plan.wasteful()] == [mixed[0].path]


def test_the_hot_layout_loads_back_the_same_tensors(saved):
    target = {"w": torch.zeros(256, 64), "emb": torch.zeros(16, 16), "norm": torch.zeros(8), "meta": {"step": 0}}
    dcp.load(target, storage_reader=ForesightStorageReader(os.path.join(saved, "hot")), no_dist=True)
    assert torch.equal(target["w"], _weight()) and target["meta"] == {"step": 100}
    assert all(torch.equal(target[k], v) for k, v in _replicated().items() if k != "meta")
