"""Restarts that read each hot byte once per host (issue 20 item 6), with real processes.

Several ranks of one "host" are processes on this machine sharing a host-local directory; the checkpoint is read
from real storage-node processes (etcd on loopback) through ``SharedReplicaReader``, or from a real DCP checkpoint
through ``ForesightStorageReader(host_share=...)``. Checked: the nodes serve each hot file once for the host (and
each rank's own shard once), every rank gets the checkpoint's bytes, a fetcher killed mid-write leaves no file under
the final name and the next process takes over, and the last process out removes the shared files.

This file is also the rank process: ``python tests/test_restart_host_share.py <mode> <json args>``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

TOKEN = "host-share-token"
JOB = "jobH"
NAME = f"{JOB}/step-1"


# -- the rank process --------------------------------------------------------------------------------------------
def _wait_file(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.01)


def _rank(mode: str, a: dict) -> None:
    from foresight.replication.host_share import HostShare, SharedReplicaReader, xxh3_check

    share = HostShare(a["key"], directory=a["dir"])
    open(a["out"] + ".ready", "w").close()  # joined: the host's ranks overlap
    _wait_file(a["go"])
    out: dict = {}
    if mode == "replicas":
        from foresight.replication.hint_client import ReplicaReader

        with ReplicaReader(a["etcd"], job=JOB, token=TOKEN) as replicas:
            reader = SharedReplicaReader(replicas, share, hot=a["hot"])
            for f in [*a["hot"], a["shard"]]:
                out[f] = hashlib.sha256(bytes(reader.read(NAME, f))).hexdigest()
            out["node_reads"] = replicas.stats["reads"]
    elif mode == "dcp":
        import torch.distributed.checkpoint as dcp

        from foresight.checkpoint.dcp_reader import ForesightStorageReader

        state = {k: torch.zeros(v) for k, v in a["shapes"].items()}
        dcp.load(state, storage_reader=ForesightStorageReader(a["ckpt"], host_share=share))
        out = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in state.items()}
    elif mode in ("stall", "file"):
        path, size = a["file"], os.path.getsize(a["file"])

        def fill(buf: memoryview) -> None:
            with open(path, "rb", buffering=0) as f:
                if mode == "stall":  # half the bytes, then hang until killed: a fetcher dying mid-write
                    f.readinto(buf[:size // 2])
                    open(a["out"] + ".half", "w").close()
                    time.sleep(3600)
                f.readinto(buf)

        from foresight.checksum import file_xxh3

        view = share.get(os.path.basename(path), size, fill, xxh3_check(size, file_xxh3(path), file=path))
        out["sha"] = hashlib.sha256(bytes(view)).hexdigest()
    out["stats"] = dict(share.stats)
    share.close()
    out["stats_after_close"] = dict(share.stats)
    with open(a["out"] + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(a["out"] + ".tmp", a["out"])


# -- the tests -----------------------------------------------------------------------------------------------------
def _start(mode: str, args: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(HERE), "python"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, json.dumps(args)], env=env)


def _host(tmp_path, mode: str, n: int, common: dict, per_rank=lambda r: {}) -> list[dict]:
    """``n`` rank processes of one host: all join the share, then go at once; their outputs."""
    go = str(tmp_path / "go")
    args = [dict(common, go=go, out=str(tmp_path / f"rank-{r}.json"), **per_rank(r)) for r in range(n)]
    procs = [_start(mode, a) for a in args]
    try:
        for a in args:
            _wait_file(a["out"] + ".ready")
        open(go, "w").close()
        for p in procs:
            assert p.wait(timeout=300) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(open(a["out"]).read()) for a in args]


def _sha(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_nodes_serve_each_hot_file_once_per_host(tmp_path):
    import pyarrow.flight as flight

    import torch.distributed.checkpoint as dcp

    from foresight.replication.hint_client import publish_checkpoint
    from foresight.replication.hot_layout import HotFileStorageWriter
    from foresight.testing.etcd import EtcdProcess
    from node_helpers import NodeProc

    ranks = 4
    src = tmp_path / "ckpt"
    dcp.save({"emb": torch.randn(128, 256), "norm": torch.randn(256)}, storage_writer=HotFileStorageWriter(src))
    for r in range(ranks):
        (src / f"shard-{r}.bin").write_bytes(os.urandom(20000 + r))
    hot = [".metadata", "__0_hot_data.bin"]
    with EtcdProcess(str(tmp_path / "etcd")) as etcd:
        nodes = []
        try:
            for i in range(2):
                root = tmp_path / f"root-{i}"
                shutil.copytree(src, root / JOB / "step-1")
                nodes.append(NodeProc(str(root), str(tmp_path / f"work-{i}"), "--etcd", etcd.endpoint, "--ttl", "3",
                                      "--cpu-threshold", "101", "--node-id", f"h{i}", name=f"h{i}"))
                publish_checkpoint(nodes[-1].location, NAME, job=JOB, token=TOKEN)
            outs = _host(tmp_path, "replicas", ranks,
                         {"etcd": etcd.endpoint, "dir": str(tmp_path / "shm"), "key": NAME, "hot": hot},
                         lambda r: {"shard": f"shard-{r}.bin"})
            served = []
            for n in nodes:
                c = flight.FlightClient(n.location)
                reply = list(c.do_action(flight.Action("replicas.stats", b"{}")))[0]
                served.append(json.loads(reply.body.to_pybytes()))
                c.close()
        finally:
            for n in nodes:
                n.terminate()
    for r, out in enumerate(outs):  # every rank got the checkpoint's bytes
        assert {f: out[f] for f in hot} == {f: _sha(str(src / f)) for f in hot}
        assert out[f"shard-{r}.bin"] == _sha(str(src / f"shard-{r}.bin"))
    hot_bytes = sum(os.path.getsize(src / f) for f in hot)
    shard_bytes = sum(os.path.getsize(src / f"shard-{r}.bin") for r in range(ranks))
    # the nodes served each hot file once for the host, and each rank's shard once
    assert sum(s["reads"] for s in served) == len(hot) + ranks
    assert sum(s["bytes"] for s in served) == hot_bytes + shard_bytes
    assert sum(o["stats"]["fetched"] for o in outs) == len(hot)
    assert sum(o["stats"]["mapped"] for o in outs) == len(hot) * (ranks - 1)
    assert sum(o["node_reads"] for o in outs) == len(hot) + ranks
    assert sum(o["stats_after_close"]["cleaned"] for o in outs) == 1  # the last one out
    assert os.listdir(tmp_path / "shm") == []


def test_dcp_load_reads_the_hot_file_and_metadata_once_per_host(tmp_path):
    import torch.distributed.checkpoint as dcp

    from foresight.replication.hot_layout import HotFileStorageWriter

    torch.manual_seed(3)
    state = {"emb": torch.randn(300, 64), "norm": torch.randn(64), "head": torch.randn(64, 17)}
    src = tmp_path / "ckpt"
    dcp.save(state, storage_writer=HotFileStorageWriter(src))
    ranks = 3
    outs = _host(tmp_path, "dcp", ranks, {"ckpt": str(src), "dir": str(tmp_path / "shm"), "key": str(src),
                                          "shapes": {k: list(v.shape) for k, v in state.items()}})
    want = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in state.items()}
    for out in outs:  # identical tensors in every rank
        assert {k: out[k] for k in want} == want
    assert sum(o["stats"]["fetched"] for o in outs) == 2  # .metadata and the hot data file, once for the host
    assert sum(o["stats"]["fetched_bytes"] for o in outs) == (
        os.path.getsize(src / ".metadata") + os.path.getsize(src / "__0_hot_data.bin"))
    assert sum(o["stats"]["mapped"] for o in outs) == 2 * (ranks - 1)
    assert os.listdir(tmp_path / "shm") == []


def test_a_fetcher_killed_mid_write_is_taken_over_and_never_leaves_a_torn_file(tmp_path):
    data = tmp_path / "hot.bin"
    data.write_bytes(os.urandom(3 << 20))
    common = {"file": str(data), "dir": str(tmp_path / "shm"), "key": "killed", "go": str(tmp_path / "go")}
    open(common["go"], "w").close()
    staller = _start("stall", dict(common, out=str(tmp_path / "stall.json")))
    waiter_args = dict(common, out=str(tmp_path / "waiter.json"))
    waiter = None
    try:
        _wait_file(str(tmp_path / "stall.json.half"))
        share_dir = [d for d in (tmp_path / "shm").iterdir() if d.is_dir()][0]
        assert not (share_dir / "hot.bin").exists()  # half written: only under its temp name
        assert [p.name for p in share_dir.iterdir() if p.name.startswith(".tmp-") and p.name.endswith("-hot.bin")]
        waiter = _start("file", waiter_args)
        _wait_file(waiter_args["out"] + ".ready")
        assert waiter.poll() is None  # waiting on the fetch of the process that holds the lock
        staller.send_signal(signal.SIGKILL)
        staller.wait(timeout=60)
        assert waiter.wait(timeout=120) == 0
    finally:
        for p in (staller, waiter):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    out = json.loads(open(waiter_args["out"]).read())
    assert out["sha"] == _sha(str(data))
    assert out["stats"]["takeovers"] == 1 and out["stats"]["fetched"] == 1
    assert out["stats_after_close"]["cleaned"] == 1  # the killed process's lock went with it: the waiter was last
    assert os.listdir(tmp_path / "shm") == []


def test_a_stuck_fetch_times_out_naming_the_file_and_its_holder(tmp_path):
    import pytest

    from foresight.replication.host_share import HostShare
    from foresight.errors import CheckpointError

    data = tmp_path / "hot.bin"
    data.write_bytes(os.urandom(1 << 20))
    common = {"file": str(data), "dir": str(tmp_path / "shm"), "key": "stuck", "go": str(tmp_path / "go")}
    open(common["go"], "w").close()
    staller = _start("stall", dict(common, out=str(tmp_path / "stall.json")))
    try:
        _wait_file(str(tmp_path / "stall.json.half"))
        with HostShare("stuck", directory=common["dir"], timeout=0.2) as share:
            with pytest.raises(CheckpointError, match=f"hot.bin.*holder_pid={staller.pid}"):
                share.get("hot.bin", 1 << 20, lambda buf: None)
    finally:
        staller.kill()
        staller.wait()


def test_a_damaged_shared_copy_is_fetched_again(tmp_path):
    from foresight.replication.host_share import HostShare, xxh3_check
    from foresight.checksum import file_xxh3

    data = tmp_path / "hot.bin"
    data.write_bytes(os.urandom(100000))
    check = xxh3_check(100000, file_xxh3(data), file="hot.bin")
    reads = []

    def fill(buf):
        reads.append(1)
        buf[:] = data.read_bytes()

    with HostShare("dmg", directory=str(tmp_path / "shm")) as first:
        assert bytes(first.get("hot.bin", 100000, fill, check)) == data.read_bytes()
        copy = [p for p in (tmp_path / "shm").rglob("hot.bin")][0]
        with open(copy, "r+b") as f:  # a byte flipped in the host's copy
            f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
        with HostShare("dmg", directory=str(tmp_path / "shm")) as second:  # another rank of the host
            assert bytes(second.get("hot.bin", 100000, fill, check)) == data.read_bytes()
            assert second.stats["bad_copies"] == 1 and second.stats["fetched"] == 1 and len(reads) == 2
    assert os.listdir(tmp_path / "shm") == []


if __name__ == "__main__":
    _rank(sys.argv[1], json.loads(sys.argv[2]))
