"""Merging at the evaluation site as units arrive (two real site processes, a delaying link between them)."""
from __future__ import annotations

import json
import os
import select
import shutil
import socket
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from pyarrow import flight

from foresight.replication.flight_calls import SCHEMA, binary_batch, put_body
from foresight.replication.merge import chunk_rows, chunks_of, merge_checkpoint
from foresight.replication.source import LocalSource
from foresight.replication.units import DCP_METADATA, data_files, plan_units
from foresight.testing.wan import WanLink

from replication_helpers import Site, assert_same_merged, wait_until

UNIT = 64 << 10
GROUPS = {"vision.": "vit", "text.": "lm"}
WORLD = 2


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    state = {
        "vision.big": torch.randn(256, 300, generator=g),  # 150 KiB per rank: split across 3 units each
        "vision.norm": torch.randn(6, generator=g),
        "text.embed": torch.randn(64, 1000, generator=g).to(torch.bfloat16),  # split by columns across ranks
        "text.head": torch.randn(10, 3, generator=g),
        "text.step": torch.tensor(5, dtype=torch.int64),
    }
    for i in range(1000):  # many tiny tensors: the chunk list outgrows an action's 64 KiB (it travels in a DoPut)
        state[f"text.small.{i}"] = torch.full((i % 7 + 1,), float(i), dtype=torch.float16)
    return state


def sharded_state() -> dict:
    """:func:`full_state` as a DCP rank of ``WORLD`` holds it (within an initialised process group): one tensor
    sharded by rows, one by columns, one replicated."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: inside the spawned rank only
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    state = full_state()
    state["vision.big"] = distribute_tensor(state["vision.big"], mesh, [Shard(0)])
    state["text.embed"] = distribute_tensor(state["text.embed"], mesh, [Shard(1)])
    state["text.head"] = distribute_tensor(state["text.head"], mesh, [Replicate()])
    return state


def _worker(rank: int, init_file: str, path: str) -> None:
    import torch.distributed as dist

    from foresight.checkpoint import ForesightStorageWriter
    from foresight.distributed import run_then_end

    def save() -> None:
        state = sharded_state()
        dcp.save(state, storage_writer=ForesightStorageWriter(path))

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    run_then_end(save)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A DCP checkpoint saved by 2 gloo ranks (tensors split by rows, by columns, replicated)."""
    import torch.multiprocessing as tmp_mp

    tmp = tmp_path_factory.mktemp("sharded")
    path = str(tmp / "dcp")
    tmp_mp.spawn(_worker, args=(str(tmp / "init"), path), nprocs=WORLD, join=True)
    return path


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sites")
    made = []
    try:
        ev = Site("eval-b", str(tmp / "eval"), unit_bytes=UNIT)
        made.append(ev)
        link = WanLink(("127.0.0.1", ev.port), rtt_ms=20)
        made.append(link)
        tr = Site("train-a", str(tmp / "train"), routes={"eval-b": link.url}, unit_bytes=UNIT)
        made.append(tr)
        yield tr, ev
    finally:
        for m in reversed(made):
            m.close() if isinstance(m, WanLink) else m.stop()


def _saving(tr, sharded: str, job: str) -> str:
    """The checkpoint being saved at the training site: its data files written, its ``.metadata`` not yet."""
    src = os.path.join(tr.root, job, "step-00000010")
    os.makedirs(src)
    for name, _ in data_files(sharded):
        shutil.copy(os.path.join(sharded, name), src)
    return src


def _start(tr, sharded: str, src: str, name: str, reshard) -> int:
    chunks, meta = chunks_of(LocalSource(sharded))
    tr.call("replicate.start", {"name": name, "src": src, "site": "eval-b", "unit_bytes": UNIT,
                                "merge": {"groups": GROUPS, "reshard": reshard}})
    files = [f for f, _ in data_files(src)]
    layout = {"rows": chunk_rows(chunks), "files": files, "files_expected": len(files), "meta": meta}
    c = flight.connect(tr.url)
    try:  # the chunk list goes in a DoPut body (an action is bounded to 64 KiB)
        put_body(c, "replicate.layout", {"name": name}, json.dumps(layout).encode())
    finally:
        c.close()
    assert len(json.dumps(layout)) > 64 << 10
    return len(plan_units(data_files(src), UNIT))


def _merge_state(ev, name: str) -> dict:
    return ev.call("replica.merged", {"name": name, "wait": False})


@pytest.mark.parametrize("reshard", [None, 2])
def test_the_site_merges_units_as_they_arrive_and_publishes_after_the_commit(sites, sharded, reshard):
    tr, ev = sites
    job = f"arrive{reshard or 0}"
    name = f"{job}/step-00000010"
    src = _saving(tr, sharded, job)
    tr.call("replicate.pause")
    units = _start(tr, sharded, src, name, reshard)
    assert units >= 8  # tensors of both ranks' files are cut across units
    wait_until(lambda: _merge_state(ev, name)["planned"], "the site laid the merged files out")
    tr.call("replicate.resume", {"units": 2})  # two units cross; the rest wait
    wait_until(lambda: sum(e[0] == "merged" for e in _merge_state(ev, name)["events"]) == 2, "2 units merged")
    tr.call("replicate.resume")
    wait_until(lambda: sum(n == name for n, *_ in tr.call("replicate.log")["sent"]) == units, "all units sent")
    wait_until(lambda: sum(e[0] == "merged" for e in _merge_state(ev, name)["events"]) == units, "all merged")
    # every unit is merged, but the source has not committed: nothing is published
    out = os.path.join(ev.root, ".merged", job, "step-00000010")
    assert not os.path.exists(out) and not os.path.exists(os.path.join(ev.root, job, "step-00000010"))
    st = _merge_state(ev, name)
    assert not st["done"] and st["paths"] is None
    shutil.copy(os.path.join(sharded, DCP_METADATA), src)  # the source commits
    tr.call("replicate.commit", {"name": name, "path": src})
    replica = tr.call("replicate.wait", {"name": name, "timeout": 60})["path"]
    st = ev.call("replica.merged", {"name": name, "timeout": 60})
    kinds = [e[0] for e in st["events"]]
    # the merge began before the last unit arrived, and was published only after the source commit
    assert kinds.index("merged") < len(kinds) - 1 - kinds[::-1].index("journaled")
    assert kinds.index("committed") < kinds.index("published") == len(kinds) - 1
    assert st["stats"]["bytes_filled_at_commit"] == 0 and st["stats"]["relayouts"] == 0
    assert sorted(st["paths"]) == ["lm", "vit"] and all(p.startswith(out + "/") for v in st["paths"].values()
                                                       for p in v)
    after = merge_checkpoint(LocalSource(replica), os.path.join(ev.root, f"after-{job}"), groups=GROUPS,
                             reshard=reshard)
    assert assert_same_merged(st["paths"], after) > 40


def test_a_unit_failing_verification_is_never_merged_and_the_unit_sent_again_is(sites, sharded):
    tr, ev = sites
    job, name = "arrivebad", "arrivebad/step-00000010"
    src = _saving(tr, sharded, job)
    tr.call("replicate.pause")
    units = _start(tr, sharded, src, name, 2)
    wait_until(lambda: _merge_state(ev, name)["planned"], "the site laid the merged files out")
    # unit 0 arrives corrupt (its header names the true xxh3): refused, its bad bytes reach the replica's file
    u = plan_units(data_files(src), UNIT)[0]
    with open(os.path.join(src, u.file), "rb") as f:
        f.seek(u.offset)
        body = bytearray(f.read(u.length))
    header = u.header(xxhash.xxh3_64_intdigest(bytes(body)))
    bad = min(4000, len(body) - 100)  # the first unit may be small (4 KiB here)
    body[100:100 + bad] = b"\xee" * bad
    c = flight.connect(ev.url)
    writer, reader = c.do_put(flight.FlightDescriptor.for_path("replica.units", json.dumps({"name": name})), SCHEMA)
    writer.write_with_metadata(binary_batch(memoryview(body)), json.dumps(header).encode())
    writer.done_writing()
    with pytest.raises(flight.FlightServerError, match="unit checksum mismatch"):
        reader.read()
        writer.close()
    c.close()
    assert [e for e in _merge_state(ev, name)["events"] if e[0] != "committed"] == []  # nothing merged
    tr.call("replicate.resume")  # the sender's units, unit 0 again among them
    shutil.copy(os.path.join(sharded, DCP_METADATA), src)
    tr.call("replicate.commit", {"name": name, "path": src})
    replica = tr.call("replicate.wait", {"name": name, "timeout": 60})["path"]
    st = ev.call("replica.merged", {"name": name, "timeout": 60})
    assert sum(e[0] == "merged" for e in st["events"]) == units
    after = merge_checkpoint(LocalSource(replica), os.path.join(ev.root, "after-bad"), groups=GROUPS, reshard=2)
    assert_same_merged(st["paths"], after)
    for paths in st["paths"].values():
        for p in paths:
            assert b"\xee" * 64 not in open(p, "rb").read()


def _replicating_worker(rank: int, init_file: str, path: str, node: str) -> None:
    import torch.distributed as dist

    from foresight.distributed import run_then_end
    from foresight.replication.policy import Replication, ReplicatingStorageWriter

    def save() -> None:
        state = sharded_state()
        rep = Replication(every=10, site="eval-b", node=node, job="dcpmerge", unit_bytes=UNIT,
                          merge={"groups": GROUPS, "reshard": 2})
        if rank == 1:  # a rank whose node calls lag (a loaded host): they must still precede the commit
            start = rep._start
            rep._start = lambda *a, **k: (time.sleep(1.5), start(*a, **k))[1]
        dcp.save(state, storage_writer=ReplicatingStorageWriter(path, replicate=rep, step=10))
        rep.close()
        assert rep.stats["hook_failures"] == 0, rep.stats

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    run_then_end(save)


def test_a_dcp_save_ships_each_ranks_layout_and_the_site_merges_its_units_on_arrival(sites, tmp_path):
    """Each rank of a DCP save through ReplicatingStorageWriter ships its file's chunks as it starts writing; the
    site plans once both ranks' files are described and merges every unit on arrival (nothing left to fill at the
    commit); the output loads equal to the saved state and to merging the replica afterwards."""
    import torch.multiprocessing as tmp_mp

    tr, ev = sites
    name = "dcpmerge/step-00000010"
    path = os.path.join(tr.root, "dcpmerge", "step-00000010")
    tmp_mp.spawn(_replicating_worker, args=(str(tmp_path / "init"), path, tr.url), nprocs=WORLD, join=True)
    replica = tr.call("replicate.wait", {"name": name, "timeout": 60})["path"]
    st = ev.call("replica.merged", {"name": name, "timeout": 60})
    assert st["stats"]["relayouts"] == 0 and st["stats"]["bytes_filled_at_commit"] == 0
    after = merge_checkpoint(LocalSource(replica), str(tmp_path / "after"), groups=GROUPS, reshard=2)
    assert_same_merged(st["paths"], after)
    from safetensors.torch import load_file

    full = full_state()
    parts = [load_file(p) for p in st["paths"]["vit"]]
    assert torch.equal(torch.cat([p["vision.big"] for p in parts]), full["vision.big"])
    lm = [load_file(p) for p in st["paths"]["lm"]]
    assert torch.equal(torch.cat([p["text.embed"] for p in lm]), full["text.embed"])


def test_a_wrong_layout_is_merged_again_from_the_metadata_and_no_layout_merges_at_the_commit(sites, sharded):
    tr, ev = sites
    # a layout whose two rows point at each other's bytes: the commit's metadata disagrees, the output is redone
    job, name = "arrivewrong", "arrivewrong/step-00000010"
    src = _saving(tr, sharded, job)
    chunks, meta = chunks_of(LocalSource(sharded))
    rows = chunk_rows(chunks)
    ones = [i for i, r in enumerate(rows) if r[0].startswith("text.small.") and r[5] == [1]]  # 1 element each
    a, b = next((i, j) for i in ones for j in ones if i < j and rows[i][1] == rows[j][1])  # one file, values differ
    rows[a][2], rows[b][2] = rows[b][2], rows[a][2]
    tr.call("replicate.start", {"name": name, "src": src, "site": "eval-b", "unit_bytes": UNIT,
                                "merge": {"groups": GROUPS}})
    files = [f for f, _ in data_files(src)]
    c = flight.connect(tr.url)
    put_body(c, "replicate.layout", {"name": name}, json.dumps(
        {"rows": rows, "files": files, "files_expected": len(files), "meta": meta}).encode())
    c.close()
    shutil.copy(os.path.join(sharded, DCP_METADATA), src)
    tr.call("replicate.commit", {"name": name, "path": src})
    replica = tr.call("replicate.wait", {"name": name, "timeout": 60})["path"]
    st = ev.call("replica.merged", {"name": name, "timeout": 60})
    assert st["stats"]["relayouts"] == 1
    assert_same_merged(st["paths"], merge_checkpoint(LocalSource(replica), os.path.join(ev.root, "after-wrong"),
                                                     groups=GROUPS))
    # no layout at all (a writer that ships none): merged at the commit, from the metadata
    job, name = "arrivenone", "arrivenone/step-00000010"
    src = _saving(tr, sharded, job)
    tr.call("replicate.start", {"name": name, "src": src, "site": "eval-b", "unit_bytes": UNIT,
                                "merge": {"groups": GROUPS}})
    shutil.copy(os.path.join(sharded, DCP_METADATA), src)
    tr.call("replicate.commit", {"name": name, "path": src})
    replica = tr.call("replicate.wait", {"name": name, "timeout": 60})["path"]
    st = ev.call("replica.merged", {"name": name, "timeout": 60})
    assert st["stats"]["relayouts"] == 0 and st["stats"]["units_merged"] == 0
    assert st["stats"]["bytes_filled_at_commit"] == sum(n for _, n in data_files(replica))
    assert_same_merged(st["paths"], merge_checkpoint(LocalSource(replica), os.path.join(ev.root, "after-none"),
                                                     groups=GROUPS))


class CorruptingLink:
    """A loopback TCP forwarder that flips one byte of the first occurrence of ``pattern`` in the stream towards
    ``target`` (a unit damaged on the way; gRPC over plain TCP has no checksum of its own)."""

    def __init__(self, target: tuple[str, int], pattern: bytes) -> None:
        self.target, self.pattern, self.flipped = target, pattern, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"grpc://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, towards_target: bool) -> None:
        keep = len(self.pattern) - 1
        carry = b""  # the stream's last bytes, held back while the pattern could still straddle two reads
        try:
            while True:
                ready, _, _ = select.select([src], [], [], 0.02)
                if not ready:
                    dst.sendall(carry)  # nothing more for now: never hold bytes a peer waits for
                    carry = b""
                    continue
                data = src.recv(1 << 16)
                if not data:
                    dst.sendall(carry)
                    break
                if not towards_target or self.flipped:
                    dst.sendall(carry + data)
                    carry = b""
                    continue
                buf = bytearray(carry + data)
                at = buf.find(self.pattern)
                if at >= 0:
                    buf[at + keep // 2] ^= 0xFF
                    self.flipped += 1
                dst.sendall(buf[:len(buf) - keep])
                carry = bytes(buf[len(buf) - keep:])
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_a_unit_damaged_on_the_way_is_sent_again_and_merged_only_once_verified(sites, sharded, tmp_path):
    """One byte of a unit flips on the link: the site refuses the unit (its xxh3), nothing of it is journaled or
    merged; the sender reads it again from the source and resends it; the merged output is the checkpoint's."""
    _, ev = sites
    job, name = "arrivedamaged", "arrivedamaged/step-00000010"
    pattern = open(os.path.join(sharded, "__0_data.bin"), "rb").read()[UNIT + 1000:UNIT + 1032]
    link = CorruptingLink(("127.0.0.1", ev.port), pattern)
    tr = Site("train-c", str(tmp_path / "train"), routes={"eval-b": link.url}, unit_bytes=UNIT)
    try:
        src = _saving(tr, sharded, job)
        units = _start(tr, sharded, src, name, 2)
        shutil.copy(os.path.join(sharded, DCP_METADATA), src)
        tr.call("replicate.commit", {"name": name, "path": src})
        replica = tr.call("replicate.wait", {"name": name, "timeout": 60})["path"]
        assert link.flipped == 1 and tr.call("replicate.log")["sending"]["resent_corrupt"] >= 1
        assert "unit checksum mismatch" in ev.log()
    finally:
        tr.stop()
        link.close()
    st = ev.call("replica.merged", {"name": name, "timeout": 60})
    merged = [e[1] for e in st["events"] if e[0] == "merged"]
    assert sorted(merged) == list(range(units))  # each unit merged once, the damaged one after it was resent
    after = merge_checkpoint(LocalSource(replica), os.path.join(ev.root, "after-damaged"), groups=GROUPS, reshard=2)
    assert_same_merged(st["paths"], after)
