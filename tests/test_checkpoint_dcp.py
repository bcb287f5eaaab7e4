"""torch.distributed.checkpoint through foresight's writer/reader: 2 gloo ranks, async save, resharding,
and saves without collectives. One launch of 2 ranks runs every scenario; each test checks one."""
from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp_mp
from foresight.checkpoint import (
    CheckpointError,
    ForesightStorageReader,
    ForesightStorageWriter,
)
from foresight.distributed import end_process_groups
from torch.distributed.checkpoint.api import CheckpointException

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORLD = 2


def full_weight() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _round_trip(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ckpt, ckpt_async = os.path.join(root, "dcp"), os.path.join(root, "dcp_async")
    mesh = init_device_mesh("cpu", (WORLD,))
    small = {f"s{i}": torch.full((i + 1,), float(i), dtype=torch.bfloat16) for i in range(300)}
    state = {
        "w": distribute_tensor(full_weight(), mesh, [Shard(0)]),
        "bias": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "meta": {"epoch": 3, "name": "run"},
        **small,
    }
    writer = ForesightStorageWriter(ckpt, drain_to=os.path.join(root, "durable"))
    dcp.save(state, storage_writer=writer)
    writer.wait_drain()
    fut = dcp.async_save(state, storage_writer=ForesightStorageWriter(ckpt_async))
    state["bias"].add_(100)  # after async_save returns: must not reach the checkpoint
    fut.result()

    # reshard on load: saved row-sharded, loaded column-sharded
    for path in (ckpt, ckpt_async):
        target = {
            "w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]),
            "bias": torch.zeros(5, dtype=torch.int64),
            "flag": torch.zeros(2, dtype=torch.bool),
            "meta": {"epoch": 0, "name": ""},
            **{k: torch.zeros_like(v) for k, v in small.items()},
        }
        dcp.load(target, storage_reader=ForesightStorageReader(path))
        assert torch.equal(target["w"].full_tensor(), full_weight())
        assert torch.equal(target["bias"], torch.arange(5)), target["bias"]
        assert target["flag"].tolist() == [True, False]
        assert target["meta"] == {"epoch": 3, "name": "run"}
        for k, v in small.items():
            assert torch.equal(target[k], v), k


def rank_state(rank: int) -> dict:
    return {f"only_rank{rank}": torch.full((3,), float(rank + 1)), "common": torch.arange(4) + 10 * rank}


def _without_collectives(rank: int, root: str) -> None:
    # every rank saves on its own (no plan exchange, no shared metadata): PyTorch's writer writes one
    # metadata file per rank, and dcp.load falls back to the rank's own when there is no global one
    path = os.path.join(root, "no_collectives")
    dcp.save(rank_state(rank), storage_writer=ForesightStorageWriter(path), use_collectives=False)
    dist.barrier()  # both ranks' files are in place before either loads
    target = {k: torch.zeros_like(v) for k, v in rank_state(rank).items()}
    dcp.load(target, storage_reader=ForesightStorageReader(path))
    for k, v in rank_state(rank).items():
        assert torch.equal(target[k], v), (rank, k, target[k])


SCENARIOS = {"round_trip": _round_trip, "without_collectives": _without_collectives}


def _worker(rank: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for name, scenario in SCENARIOS.items():
            try:
                scenario(rank, root)
                dist.barrier()
            except BaseException:
                with open(os.path.join(root, f"{name}.rank{rank}.failed"), "w") as f:
                    f.write(traceback.format_exc())
                break  # a rank out of step would block in the next collective
            open(os.path.join(root, f"{name}.rank{rank}.ok"), "w").close()
    finally:
        end_process_groups(barrier=False)  # the scenarios' frames are gone: their cycles are collected first


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("dcp_two_ranks"))
    tmp_mp.spawn(_worker, args=(root,), nprocs=WORLD, join=True)
    return root


def _passed(root: str, name: str) -> None:
    failures = [open(os.path.join(root, f)).read() for f in sorted(os.listdir(root))
                if f.startswith(f"{name}.rank") and f.endswith(".failed")]
    assert not failures, "\n".join(failures)
    for rank in range(WORLD):
        assert os.path.exists(os.path.join(root, f"{name}.rank{rank}.ok")), f"{name} did not run on rank {rank}"


def test_dcp_round_trip_two_gloo_ranks_with_resharding(two_ranks):
    _passed(two_ranks, "round_trip")
    ckpt = os.path.join(two_ranks, "dcp")
    # the coordinator drained the finished checkpoint to the durable tier; it loads from there too
    drained = os.path.join(two_ranks, "durable", "dcp")
    assert sorted(os.listdir(drained)) == sorted(n for n in os.listdir(ckpt) if not n.endswith(".tmp"))
    target = {"w": torch.zeros(8, 6)}
    dcp.load(target, storage_reader=ForesightStorageReader(drained), no_dist=True)
    assert torch.equal(target["w"], full_weight())
    assert os.path.exists(os.path.join(ckpt, ".metadata"))
    assert sorted(n for n in os.listdir(ckpt) if n.endswith("data.bin")) == ["__0_data.bin", "__1_data.bin"]
    # reshard 2 -> 1: a single process (no process group) loads the full tensor
    target = {"w": torch.zeros(8, 6), "bias": torch.zeros(5, dtype=torch.int64)}
    dcp.load(target, storage_reader=ForesightStorageReader(ckpt), no_dist=True)
    assert torch.equal(target["w"], full_weight()) and torch.equal(target["bias"], torch.arange(5))
    # corruption is reported with the file and the item
    data = os.path.join(ckpt, "__1_data.bin")
    with open(data, "r+b") as f:
        f.seek(8192)
        f.write(b"\x00" * 4096)
    f2 = os.path.join(ckpt, "__0_data.bin")
    with open(f2, "r+b") as f:
        blob = bytearray(f.read())
        for i in range(0, len(blob), 7):
            blob[i] ^= 0xFF
        f.seek(0)
        f.write(blob)
    # DCP wraps a rank's exception in its CheckpointException; ours (with file and item) is inside
    with pytest.raises((CheckpointError, CheckpointException), match=r"checksum mismatch.*__0_data.bin.*item=w"):
        dcp.load({"w": torch.zeros(8, 6), "bias": torch.zeros(5, dtype=torch.int64)},
                 storage_reader=ForesightStorageReader(ckpt), no_dist=True)


def test_dcp_save_without_collectives_writes_one_metadata_per_rank(two_ranks):
    _passed(two_ranks, "without_collectives")
    path = os.path.join(two_ranks, "no_collectives")
    names = sorted(os.listdir(path))
    assert names == ["__0.metadata", "__0_data.bin", "__1.metadata", "__1_data.bin"], names
    # a single process is rank 0: it finds rank 0's metadata and state
    target = {k: torch.zeros_like(v) for k, v in rank_state(0).items()}
    dcp.load(target, storage_reader=ForesightStorageReader(path), no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in rank_state(0).items())


def test_drain_without_collectives_is_refused(tmp_path):
    with pytest.raises((CheckpointError, CheckpointException), match="drain_to needs use_collectives=True"):
        dcp.save({"w": torch.ones(2)}, storage_writer=ForesightStorageWriter(tmp_path / "c", drain_to=tmp_path / "d"),
                 no_dist=True, use_collectives=False)
    assert not os.path.exists(tmp_path / "d")
