"""torch.distributed.checkpoint through foresight's writer/reader: 2 gloo ranks, async save, resharding."""
from __future__ import annotations

import os

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
from torch.distributed.checkpoint.api import CheckpointException

WORLD = 2


def full_weight() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _worker(rank: int, init_file: str, ckpt: str, ckpt_async: str, durable: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        small = {f"s{i}": torch.full((i + 1,), float(i), dtype=torch.bfloat16) for i in range(300)}
        state = {
            "w": distribute_tensor(full_weight(), mesh, [Shard(0)]),
            "bias": torch.arange(5, dtype=torch.int64),
            "flag": torch.tensor([True, False]),
            "meta": {"epoch": 3, "name": "run"},
            **small,
        }
        writer = ForesightStorageWriter(ckpt, drain_to=durable)
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
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_dcp_round_trip_two_gloo_ranks_with_resharding(tmp_path):
    ckpt, ckpt_async = str(tmp_path / "dcp"), str(tmp_path / "dcp_async")
    durable = str(tmp_path / "durable")
    tmp_mp.spawn(_worker, args=(str(tmp_path / "init"), ckpt, ckpt_async, durable), nprocs=WORLD, join=True)
    # the coordinator drained the finished checkpoint to the durable tier; it loads from there too
    drained = os.path.join(durable, "dcp")
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
