"""The namespace resolver through etcd: local replica first, the source when it is missing or expired, leases
that keep a read replica from being reclaimed, and merge / load / the DCP reader on top of it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from foresight.checkpoint import ForesightStorageReader
from foresight.replication.merge import merge_checkpoint
from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.replication.resolver import Resolver
from foresight.replication.source import LocalSource, RemoteSource
from foresight.errors import CheckpointError

from replication_helpers import Etcd, Site, wait_until

NAME = "lm/step-00000100"


def state():
    g = torch.Generator().manual_seed(1)
    s = {f"text.layer{i}.w": torch.randn(32, 16, generator=g) for i in range(3)}
    s.update({f"vision.block{i}.b": torch.randn(5, generator=g).to(torch.bfloat16) for i in range(20)})
    return s


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resolver")
    etcd = Etcd(str(tmp / "etcd"))
    ev = tr = None
    try:
        ev = Site("eval-b", str(tmp / "eval"), etcd=etcd.endpoint, replica_ttl=3)
        tr = Site("train-a", str(tmp / "train"), etcd=etcd.endpoint, routes={"eval-b": ev.url})
        rep = Replication(every=100, site="eval-b", node=tr.url, job="lm")
        src = os.path.join(tr.root, "lm", "step-00000100")
        dcp.save(state(), storage_writer=ReplicatingStorageWriter(src, replicate=rep, step=100), no_dist=True)
        replica = rep.wait(100, timeout=60)["path"]
        rep.close()
        yield {"etcd": etcd, "eval": ev, "train": tr, "src": src, "replica": replica, "tmp": tmp}
    finally:
        for s in (tr, ev):
            if s is not None:
                s.stop()
        etcd.close()


def test_local_replica_first_then_remote_when_expired_and_no_reclaim_while_held(world):
    with Resolver(world["etcd"].endpoint, site="eval-b") as res:
        loc = res.resolve(NAME)
        assert loc.local and loc.site == "eval-b" and loc.path == world["replica"]
        with res.open(NAME) as (loc, source):
            assert isinstance(source, LocalSource)
            local = merge_checkpoint(source, world["tmp"] / "m_local")
        with res.hold(NAME):
            # the replica's lease (TTL 3 s) runs out while a reader holds it
            wait_until(lambda: all(c["site"] != "eval-b" for c in res.copies(NAME)), "replica lease to expire")
            loc = res.resolve(NAME)
            assert not loc.local and loc.site == "train-a" and loc.path == world["src"]
            assert res.reclaim(world["eval"].root) == []  # held: kept
            assert os.path.isdir(world["replica"])
            with res.open(NAME) as (loc, source):
                assert isinstance(source, RemoteSource)
                remote = merge_checkpoint(source, world["tmp"] / "m_remote")
                assert source.requests <= 3  # .metadata, a probe, and one read for the one data file
        for g in local:
            a, b = load_file(local[g][0]), load_file(remote[g][0])
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert res.reclaim(world["eval"].root) == [NAME]  # released: reclaimed
        assert not os.path.exists(world["replica"])
        # fetched back on demand as a verified local copy, which the DCP reader loads
        path = res.pull(NAME, world["eval"].root, ttl=60)
        assert path == world["replica"] and res.resolve(NAME).local
        target = {k: torch.zeros_like(v) for k, v in state().items()}
        dcp.load(target, storage_reader=ForesightStorageReader(path), no_dist=True)
        assert all(torch.equal(target[k], v) for k, v in state().items())


def test_a_registered_copy_that_is_missing_on_disk_falls_back(world, tmp_path):
    with Resolver(world["etcd"].endpoint, site="eval-c") as res:
        res._etcd.put(f"/foresight/ckpt/{NAME}/copies/eval-c", json.dumps(
            {"site": "eval-c", "path": str(tmp_path / "gone"), "endpoint": "", "source": False}))
        loc = res.resolve(NAME)
        assert loc.site == "train-a" and not loc.local
        with pytest.raises(CheckpointError, match="no complete copy"):
            res.resolve("lm/step-00000999")
        with pytest.raises(CheckpointError, match="incomplete"):
            res.register("lm/step-00000999", str(tmp_path), "")


def test_merge_cli_resolves_a_name_through_etcd(world, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "foresight", "ckpt", "merge", NAME, str(out), "--etcd",
                           world["etcd"].endpoint, "--site", "eval-d"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["source"].startswith("train-a:")  # eval-d holds no copy: read from the source
    merged = load_file(str(out / "text.safetensors"))
    assert torch.equal(merged["text.layer2.w"], state()["text.layer2.w"])


def test_reclaim_removes_stale_partial_replicas_only(world, tmp_path):
    root = tmp_path / "site"
    old, fresh = root / "job" / ".replica-step-00000001", root / "job" / ".replica-step-00000002"
    for d in (old, fresh):
        d.mkdir(parents=True)
        (d / "data-00000.bin").write_bytes(b"partial")
    os.utime(old, (1, 1))  # a cut transfer nobody resumed
    with Resolver(world["etcd"].endpoint, site="eval-e") as res:
        assert res.reclaim(str(root), stale_after=3600) == ["job/.replica-step-00000001"]
    assert not old.exists() and fresh.exists()
