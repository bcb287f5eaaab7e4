"""``foresight ckpt merge``: a DCP checkpoint written by 2 gloo ranks -> safetensors equal to a non-distributed save."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp_mp
from safetensors.torch import load_file

from foresight.checkpoint import Checkpointer, ForesightStorageWriter
from foresight.replication.merge import group_of, merge_checkpoint
from foresight.replication.source import LocalSource
from foresight.distributed import run_then_end
from foresight.errors import CheckpointError

WORLD = 2


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {
        "vision.patch.w": torch.randn(8, 6, generator=g),  # split by rows across ranks
        "vision.norm": torch.randn(6, generator=g),  # plain tensor on every rank: stored once
        "text.embed": torch.randn(4, 10, generator=g).to(torch.bfloat16),  # split by columns
        "text.head": torch.randn(10, 3, generator=g),  # DTensor replicated on both ranks
        "text.step": torch.tensor(5, dtype=torch.int64),
    }
    for i in range(50):
        state[f"text.small.{i}"] = torch.full((i % 7 + 1,), float(i), dtype=torch.float16)
    return state


def _worker(rank: int, init_file: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def save() -> None:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = full_state()
        state = dict(full)
        state["vision.patch.w"] = distribute_tensor(full["vision.patch.w"], mesh, [Shard(0)])
        state["text.embed"] = distribute_tensor(full["text.embed"], mesh, [Shard(1)])
        state["text.head"] = distribute_tensor(full["text.head"], mesh, [Replicate()])
        state["meta"] = {"epoch": 3}
        dcp.save(state, storage_writer=ForesightStorageWriter(path))

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    run_then_end(save)  # the DTensors and mesh are freed before gloo ends (foresight.distributed)


@pytest.fixture(scope="module")
def dist_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge")
    path = str(tmp / "dcp")
    tmp_mp.spawn(_worker, args=(str(tmp / "init"), path), nprocs=WORLD, join=True)
    return tmp, path


def test_merge_equals_non_distributed_save(dist_ckpt):
    tmp, path = dist_ckpt
    assert sorted(n for n in os.listdir(path) if n.endswith(".bin")) == ["__0_data.bin", "__1_data.bin"]
    single = str(tmp / "single")
    dcp.save(full_state(), storage_writer=ForesightStorageWriter(single), no_dist=True)
    a = merge_checkpoint(LocalSource(path), tmp / "out_dist")
    b = merge_checkpoint(LocalSource(single), tmp / "out_single")
    assert sorted(a) == sorted(b) == ["text", "vision"]
    full = full_state()
    for g in a:
        got, want = load_file(a[g][0]), load_file(b[g][0])
        assert sorted(got) == sorted(want) == sorted(n for n in full if n.startswith(g + "."))
        for n in got:
            assert got[n].dtype == want[n].dtype == full[n].dtype and torch.equal(got[n], want[n]), n
            assert torch.equal(got[n], full[n]), n


def test_merge_reshards_for_an_eval_world_size(dist_ckpt):
    tmp, path = dist_ckpt
    out = merge_checkpoint(LocalSource(path), tmp / "out_w3", groups={"vision.": "vit", "text.": "lm"}, reshard=3)
    full = full_state()
    assert sorted(out) == ["lm", "vit"] and all(len(v) == 3 for v in out.values())
    parts = [load_file(p) for p in out["vit"]]
    assert torch.equal(torch.cat([p["vision.patch.w"] for p in parts]), full["vision.patch.w"])
    assert [p["vision.patch.w"].shape[0] for p in parts] == [3, 3, 2]
    lm = [load_file(p) for p in out["lm"]]
    assert all(torch.equal(p["text.step"], full["text.step"]) for p in lm)  # scalar: whole on every rank
    assert all(torch.equal(p["text.small.0"], full["text.small.0"]) for p in lm)  # 1 row < 3: whole


def test_merge_cli(dist_ckpt, tmp_path):
    _, path = dist_ckpt
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "foresight", "ckpt", "merge", path, str(out),
                           "--group", "vision.=vision", "--group", "text.=text"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(report["written"]) == ["text", "vision"]
    assert torch.equal(load_file(str(out / "text.safetensors"))["text.head"], full_state()["text.head"])


def test_merge_of_a_foresight_checkpoint_and_a_corrupt_one(tmp_path):
    state = full_state()
    with Checkpointer(str(tmp_path / "ck")) as ck:
        path = ck.save(state, 10).wait().path
    out = merge_checkpoint(LocalSource(path), tmp_path / "m")
    assert torch.equal(load_file(out["vision"][0])["vision.norm"], state["vision.norm"])
    with open(os.path.join(path, "data-00000.bin"), "r+b") as f:
        f.seek(3)
        f.write(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="checksum mismatch while merging.*data-00000.bin"):
        merge_checkpoint(LocalSource(path), tmp_path / "m2")


def test_group_of():
    assert group_of("vision.blocks.0.w", None, 1) == "vision"
    assert group_of("vision.blocks.0.w", None, 2) == "vision.blocks"
    assert group_of("w", None, 1) == "root"
    assert group_of("lm.head", {"lm.": "text", "lm.head": "head"}, 1) == "head"
    assert group_of("other", {"lm.": "text"}, 1) == "rest"


@pytest.mark.parametrize("reshard", [None, 2, 3])
def test_a_merge_laid_out_up_front_loads_as_merge_checkpoint(dist_ckpt, reshard):
    """MergePlan lays the safetensors files out from the chunk list alone (headers first); copying every stored
    byte through its segments, in pieces that cut tensors (rows split by ranks, columns split by ranks, a
    replicated tensor) anywhere, gives what merge_checkpoint writes after reading everything."""
    from foresight.replication.merge import chunks_of
    from foresight.replication.merge_plan import MergePlan
    from replication_helpers import assert_same_merged

    tmp, path = dist_ckpt
    groups = {"vision.": "vit", "text.": "lm"}
    want = merge_checkpoint(LocalSource(path), tmp / f"want-{reshard}", groups=groups, reshard=reshard)
    chunks, meta = chunks_of(LocalSource(path))
    plan = MergePlan(chunks, meta, groups=groups, reshard=reshard)
    out = tmp / f"plan-{reshard}"
    out.mkdir()
    bufs = [bytearray(f.size) for f in plan.files]
    for b, f in zip(bufs, plan.files):
        b[:len(f.header)] = f.header
    copied = 0
    for name in ("__0_data.bin", "__1_data.bin"):
        data = open(os.path.join(path, name), "rb").read()
        for pos in range(0, len(data), 97):  # odd pieces: segments are clipped to each
            for s, fi, d, n in zip(*(a.tolist() for a in plan.segments_in(name, pos, 97))):
                bufs[fi][d:d + n] = data[s:s + n]
                copied += n
    assert copied == plan.total_segment_bytes()
    got = {}
    for g, names in plan.groups.items():
        got[g] = []
        for n in names:
            (out / n).write_bytes(bufs[[f.name for f in plan.files].index(n)])
            got[g].append(str(out / n))
    assert_same_merged(got, want)
