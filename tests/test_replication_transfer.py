"""Replication between two sites (two real processes, a delaying WAN link between them, etcd)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foresight.checkpoint import store
from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.replication.resolver import Resolver
from foresight.replication.units import data_files, plan_units, unit_ends
from foresight.testing.wan import WanLink
from foresight.errors import CheckpointError

from replication_helpers import Etcd, Site, wait_until, write_checkpoint_phases

UNIT = 64 << 10


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sites")
    etcd = Etcd(str(tmp_path / "etcd"))
    train_root, eval_root = str(tmp_path / "train"), str(tmp_path / "eval")
    made = []
    made_later = []
    try:
        ev = Site("eval-b", eval_root, etcd=etcd.endpoint, unit_bytes=UNIT)
        made.append(ev)
        link = WanLink(("127.0.0.1", ev.port), rtt_ms=20)
        made.append(link)
        tr = Site("train-a", train_root, etcd=etcd.endpoint, routes={"eval-b": link.url}, unit_bytes=UNIT)
        made.append(tr)
        yield {"etcd": etcd, "train": tr, "eval": ev, "link": link, "tmp": tmp_path, "later": made_later}
    finally:
        for m in reversed(made + made_later):
            m.close() if isinstance(m, WanLink) else m.stop()
        etcd.close()


def n_units(*sizes):
    """Units of data files of these sizes (full units, then smaller ones near each file's end)."""
    return sum(len(unit_ends(n, UNIT)) for n in sizes)


def files_of(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def test_replica_is_bit_identical_and_invisible_before_the_source_commit(sites):
    tr, ev = sites["train"], sites["eval"]
    rep = Replication(every=100, site="eval-b", node=tr.url, job="job1")
    phases = write_checkpoint_phases(os.path.join(tr.root, "job1"), 200, 700_000)
    tmp = next(phases)
    rep.data_written(200, tmp, nbytes=700_000)
    # every unit crosses the link before the source commits ...
    wait_until(lambda: sum(n == "job1/step-00000200" for n, *_ in tr.call("replicate.log")["sent"]) ==
               n_units(700_000), "all units sent")
    # ... but nothing is visible at the evaluation site, and etcd knows no copy
    assert store.committed_steps(os.path.join(ev.root, "job1")) == []
    with Resolver(sites["etcd"].endpoint, site="eval-b") as res:
        assert res.copies("job1/step-00000200") == []
        with pytest.raises(CheckpointError, match="no complete copy"):
            res.resolve("job1/step-00000200")
        final = next(phases)
        rep.committed(200, final)
        info = rep.wait(200, timeout=60)
        assert info["path"] == os.path.join(ev.root, "job1", "step-00000200")
        assert info["bytes_sent"] == 700_000
        assert files_of(info["path"]) == files_of(final)
        loc = res.resolve("job1/step-00000200")
        assert loc.local and loc.path == info["path"]
    # a step the schedule does not name is not replicated
    phases = write_checkpoint_phases(os.path.join(tr.root, "job1"), 250, 10_000)
    rep.data_written(250, next(phases))
    rep.committed(250, next(phases))
    with pytest.raises(CheckpointError, match="not being replicated"):
        rep.wait(250)
    rep.close()


def test_an_aborted_save_never_becomes_a_replica(sites):
    tr, ev = sites["train"], sites["eval"]
    rep = Replication(every=1, site="eval-b", node=tr.url, job="job2")
    phases = write_checkpoint_phases(os.path.join(tr.root, "job2"), 3, 200_000)
    rep.data_written(3, next(phases))
    rep.aborted(3)
    from pyarrow import flight

    with pytest.raises(flight.FlightServerError, match="aborted"):
        tr.call("replicate.wait", {"name": "job2/step-00000003", "timeout": 30})
    assert store.committed_steps(os.path.join(ev.root, "job2")) == []


def test_urgent_replication_overtakes_bulk_in_progress(sites):
    tr = sites["train"]
    tr.call("replicate.pause")
    before = len(tr.call("replicate.log")["sent"])
    bulk = Replication(every=1, site="eval-b", node=tr.url, job="bulk")
    urgent = Replication(every=1000, site="eval-b", node=tr.url, job="urgent", importance=1.0)
    pb = write_checkpoint_phases(os.path.join(tr.root, "bulk"), 1, 12 * UNIT)
    bulk.data_written(1, next(pb), nbytes=12 * UNIT)
    bulk.committed(1, next(pb))
    tr.call("replicate.resume", {"units": 3})  # bulk is under way ...
    wait_until(lambda: len(tr.call("replicate.log")["sent"]) == before + 3, "3 bulk units sent")
    pu = write_checkpoint_phases(os.path.join(tr.root, "urgent"), 7, 3 * UNIT, seed=1)
    urgent.data_written(7, next(pu), nbytes=3 * UNIT)  # not a scheduled step: not sent ...
    urgent.committed(7, next(pu))
    urgent.urgent(7, severity=0.9)  # ... until an anomaly asks for its evaluation
    tr.call("replicate.resume")
    urgent.wait(7, timeout=60)
    bulk.wait(1, timeout=60)
    order = [name.split("/")[0] for name, *_ in tr.call("replicate.log")["sent"][before:]]
    assert order == ["bulk"] * 3 + ["urgent"] * n_units(3 * UNIT) + ["bulk"] * (n_units(12 * UNIT) - 3)


def test_dcp_writer_replicates_after_metadata(sites):
    tr = sites["train"]
    rep = Replication(every=10, site="eval-b", node=tr.url, job="dcpjob")
    state = {"w": torch.randn(64, 64), "b": torch.arange(10)}
    path = os.path.join(tr.root, "dcpjob", "step-00000010")
    dcp.save(state, storage_writer=ReplicatingStorageWriter(path, replicate=rep, step=10), no_dist=True)
    info = rep.wait(10, timeout=60)
    assert files_of(info["path"]) == files_of(path)
    from foresight.checkpoint import ForesightStorageReader

    target = {"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.int64)}
    dcp.load(target, storage_reader=ForesightStorageReader(info["path"]), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])


def test_a_cut_transfer_leaves_no_replica_and_resumes_when_the_site_is_back(sites):
    tr, ev, etcd = sites["train"], sites["eval"], sites["etcd"]
    tr.call("replicate.pause")
    before = len(tr.call("replicate.log")["sent"])
    rep = Replication(every=1, site="eval-b", node=tr.url, job="job3")
    phases = write_checkpoint_phases(os.path.join(tr.root, "job3"), 5, 600_000)
    tmp = next(phases)
    rep.data_written(5, tmp, nbytes=600_000)
    final = next(phases)
    rep.committed(5, final)
    tr.call("replicate.resume", {"units": 4})
    wait_until(lambda: len(tr.call("replicate.log")["sent"]) == before + 4, "4 units sent")
    ev.kill()  # the evaluation site dies mid-transfer
    tr.call("replicate.resume")
    wait_until(lambda: "site unreachable or starting, retrying" in tr.log(), "the sender waiting for the site")
    assert store.committed_steps(os.path.join(ev.root, "job3")) == []  # only the hidden temp dir
    assert os.path.isdir(os.path.join(ev.root, "job3", ".replica-step-00000005"))
    # the site comes back on the same port: the sender, still retrying, resumes with the missing units only
    ev2 = Site("eval-b", ev.root, etcd=etcd.endpoint, unit_bytes=UNIT, port=ev.port)
    sites["later"].append(ev2)
    sites["eval"] = ev2
    info = rep.wait(5, timeout=120)
    assert info["bytes_sent"] == 600_000 and info["units_put"] == info["units"]  # the 4 journaled ones not again
    assert files_of(info["path"]) == files_of(final)


def test_checkpointer_replicates_scheduled_steps_and_the_eval_site_loads_them(sites):
    from foresight.checkpoint import Checkpointer, load

    tr = sites["train"]
    rep = Replication(every=2, site="eval-b", node=tr.url, job="ckptjob")
    state = {"w": torch.randn(300, 300), "layers": [{"b": torch.arange(7)} for _ in range(30)]}
    with Checkpointer(os.path.join(tr.root, "ckptjob"), replicate=rep) as ck:
        ck.save(state, 2).wait()
        ck.save(state, 3).wait()  # not on the schedule
        src = ck.save(state, 4).wait().path
    info = rep.wait(4, timeout=60)
    assert files_of(info["path"]) == files_of(src)
    with pytest.raises(CheckpointError, match="not being replicated"):
        rep.wait(3)
    assert rep.wait(2, timeout=60)["path"].endswith("step-00000002")
    got = load(4, root=os.path.dirname(info["path"]))  # the evaluation site loads its replica
    assert torch.equal(got.state_dict["w"], state["w"])
    with Resolver(sites["etcd"].endpoint, site="eval-b") as res:  # ... or by name, through etcd
        got = res.load("ckptjob/step-00000004", sites["eval"].root)
        assert got.path == info["path"] and torch.equal(got.state_dict["w"], state["w"])
    assert torch.equal(got.state_dict["layers"][29]["b"], state["layers"][29]["b"])
    rep.close()


def test_bad_requests_get_clear_errors(sites):
    import numpy as np
    from pyarrow import flight

    from foresight.replication.source import RemoteSource

    tr = sites["train"]
    with pytest.raises(flight.FlightServerError, match="outside this node's root"):
        tr.call("replicate.start", {"name": "x/step-1", "src": "/etc", "site": "eval-b"})
    with pytest.raises(flight.FlightServerError, match="bad checkpoint name"):
        tr.call("replicate.start", {"name": "../x", "src": tr.root, "site": "eval-b"})
    with pytest.raises(flight.FlightServerError, match="lacks fields"):
        tr.call("replicate.commit", {"name": "x/y"})
    with pytest.raises(flight.FlightServerError, match="no replication of this checkpoint"):
        tr.call("replicate.wait", {"name": "nobody/step-00000001"})
    phases = write_checkpoint_phases(os.path.join(tr.root, "badreq"), 1, 10_000)
    next(phases)
    next(phases)
    src = RemoteSource(tr.url, "badreq/step-00000001")
    with pytest.raises(CheckpointError, match="range outside the checkpoint file.*data-00000.bin"):
        src.read_extents(["data-00000.bin"], np.zeros(1, np.int32), np.array([9_000]), np.array([5_000]))
    with pytest.raises(CheckpointError, match="bad file name"):
        src.read_file("../../etc/passwd")
    with pytest.raises(CheckpointError, match="remote read failed.*No such file.*file=.metadata"):
        src.read_file(".metadata")  # a foresight-format checkpoint has none: the merge then reads index.json
    from foresight.replication.merge import read_tensors

    tensors, _ = read_tensors(src)
    assert len(tensors) > 10
    with pytest.raises(CheckpointError, match="bad checkpoint name"):
        RemoteSource(tr.url, "../../etc")
    src.close()


def test_units_leave_as_their_bytes_are_written_and_publish_waits_for_the_commit(sites):
    tr, ev = sites["train"], sites["eval"]
    rep = Replication(every=1, site="eval-b", node=tr.url, job="stream1", unit_bytes=UNIT)
    phases = write_checkpoint_phases(os.path.join(tr.root, "stream1"), 1, 10 * UNIT)
    tmp = next(phases)  # the data file (here already whole; the writer reports it piece by piece)
    name = "stream1/step-00000001"
    answer = tr.call("replicate.start", {"name": name, "src": tmp, "site": "eval-b", "unit_bytes": UNIT,
                                         "files": [["data-00000.bin", 10 * UNIT]], "written": {}})
    ends = unit_ends(10 * UNIT, UNIT)  # small units first, whole ones, then smaller ones
    n = len(ends)
    assert answer == {"units": n, "bytes": 10 * UNIT}
    assert tr.call("replicate.written", {"name": name, "written": {"data-00000.bin": ends[1] + 5}}) == \
        {"released": 2, "held": n - 2}  # only whole units leave
    wait_until(lambda: sum(n == name for n, *_ in tr.call("replicate.log")["sent"]) == 2, "2 units sent")
    assert tr.call("replicate.written", {"name": name, "written": {"data-00000.bin": ends[6]}})["held"] == n - 7
    wait_until(lambda: sum(n == name for n, *_ in tr.call("replicate.log")["sent"]) == 7, "7 units sent")
    assert store.committed_steps(os.path.join(ev.root, "stream1")) == []  # nothing visible before the commit
    final = next(phases)
    rep._started[1] = name
    rep.committed(1, final)  # the commit says every byte is written: the held units leave, then it publishes
    info = rep.wait(1, timeout=60)
    assert files_of(info["path"]) == files_of(final) and info["units_put"] == n
    assert info["bytes_left_at_commit"] == 10 * UNIT - ends[6]
    rep.close()


def test_the_site_writes_a_saves_units_past_its_page_cache_until_the_commit(sites):
    """Units sent while the save is in progress go to the site's disk with O_DIRECT (buffered writes into fresh
    page-cache pages were slower than a 100 MB/s save: units piled up at the site and were still to arrive at the
    commit); those sent after the commit go through its page cache, which the verification then reads."""
    from foresight.io.direct_write import DIRECT_MIN

    from foresight.replication.send_windows import UNIT_WIRE_CHUNK

    tr, ev = sites["train"], sites["eval"]
    unit, size = 2 << 20, 8 << 20  # units of 128, 256, 512 KiB, 1, 1.53 MiB, then smaller ones
    phases = write_checkpoint_phases(os.path.join(tr.root, "direct1"), 1, size)
    tmp = next(phases)
    name = "direct1/step-00000001"
    ends = unit_ends(size, unit)
    lengths = [b - a for a, b in zip([0, *ends], ends)]
    before = ev.call("replicate.log")["received"]
    tr.call("replicate.start", {"name": name, "src": tmp, "site": "eval-b", "unit_bytes": unit,
                                "files": [["data-00000.bin", size]], "written": {}})
    tr.call("replicate.written", {"name": name, "written": {"data-00000.bin": ends[4]}})
    wait_until(lambda: sum(n == name for n, *_ in tr.call("replicate.log")["sent"]) == 5, "5 units sent")
    rep = Replication(every=1, site="eval-b", node=tr.url, job="direct1", unit_bytes=unit)
    final = next(phases)
    rep._started[1] = name
    rep.committed(1, final)  # the rest leaves now, after the commit
    info = rep.wait(1, timeout=60)
    assert files_of(info["path"]) == files_of(final)
    after = ev.call("replicate.log")["received"]
    got = {k: after[k] - before[k] for k in ("direct_bytes", "buffered_bytes", "direct_refused")}
    # a unit's body arrives in pieces of UNIT_WIRE_CHUNK: those large enough go O_DIRECT (all aligned here)
    pieces = [min(UNIT_WIRE_CHUNK, n - p) for n in lengths[:5] for p in range(0, n, UNIT_WIRE_CHUNK)]
    direct = sum(k for k in pieces if k >= DIRECT_MIN)
    assert direct >= 2 << 20
    if got["direct_refused"]:  # a file system without O_DIRECT: every unit buffered (logged)
        assert got["direct_bytes"] == 0 and got["buffered_bytes"] == size
    else:
        assert got == {"direct_bytes": direct, "buffered_bytes": size - direct, "direct_refused": 0}
    rep.close()


class _WaitsForUnits(Replication):
    """Holds the writer at ``data_written`` (after the data file is written, before the commit) until the node has
    sent every unit: only a sender that sends while the file is written gets them out before the commit."""

    units_out_before_commit = None

    def data_written(self, step, directory, **kw):
        from foresight.replication.flight_calls import call

        if self.wants(step):
            try:
                wait_until(lambda: step in self._started and
                           sum(n == self.name(step) for n, *_ in call(self.node, "replicate.log")["sent"]) ==
                           n_units(self._sizes[step]), "every unit sent before the commit", timeout=30)
                self.units_out_before_commit = True
            except AssertionError:  # the writer swallows hook errors: the test reads this flag
                self.units_out_before_commit = False
        super().data_written(step, directory, **kw)


def test_checkpointer_sends_while_saving(sites):
    from foresight.checkpoint import Checkpointer

    tr = sites["train"]
    rep = _WaitsForUnits(every=1, site="eval-b", node=tr.url, job="stream2", unit_bytes=UNIT)
    state = {"w": torch.randn(300, 300), "b": torch.arange(1000)}  # 368 KiB: 6 units
    with Checkpointer(os.path.join(tr.root, "stream2"), replicate=rep) as ck:
        src = ck.save(state, 1).wait().path
    assert rep.units_out_before_commit
    info = rep.wait(1, timeout=60)
    assert files_of(info["path"]) == files_of(src)
    assert info["bytes_left_at_commit"] == 0 and info["written_at"] <= info["committed_at"]
    assert rep.stats["hook_failures"] == 0
    # the site tells when each unit arrived (what had crossed the link at a given moment), each unit once
    arrived = sites["eval"].call("replicate.log", {"name": "stream2/step-00000001"})["arrived"]
    size = os.path.getsize(os.path.join(src, "data-00000.bin"))
    assert sorted(i for i, _, _ in arrived) == list(range(n_units(size)))
    assert sum(n for _, n, _ in arrived) == size and max(at for *_, at in arrived) <= info["ready_at"]
    # and when each piece of a body arrived (a unit received in part counts for the bytes received)
    pieces = sites["eval"].call("replicate.log", {"name": "stream2/step-00000001"})["arrived_pieces"]
    assert sum(n for _, n in pieces) == size and len(pieces) >= len(arrived)
    assert max(at for at, _ in pieces) <= max(at for *_, at in arrived)
    rep.close()


class _StartsAfterTheCommit(Replication):
    """The lane's start of a save being written reaches the node only once the save has committed (its temp
    directory renamed): what happens to a small save on a loaded machine (the demo's, 1.3 MB)."""

    def _start(self, step, directory, files=None, *args, **kw):
        if files is not None:
            wait_until(lambda: not os.path.isdir(directory), "the commit renaming the temp directory", timeout=30)
        super()._start(step, directory, files, *args, **kw)


def test_a_save_that_commits_before_its_start_reaches_the_node_is_sent_at_the_commit_without_a_warning(
        sites, caplog):
    """Was two WARNING lines and two hook failures (the node could not open the renamed files, then knew no
    transfer for the progress reports); the commit sends the committed directory either way."""
    from foresight.checkpoint import Checkpointer

    tr = sites["train"]
    rep = _StartsAfterTheCommit(every=1, site="eval-b", node=tr.url, job="racejob", unit_bytes=UNIT)
    state = {"w": torch.randn(300, 300), "b": torch.arange(1000)}  # several units: progress is reported
    with caplog.at_level("INFO", logger="foresight.replicate"):
        with Checkpointer(os.path.join(tr.root, "racejob"), replicate=rep) as ck:
            src = ck.save(state, 1).wait().path
        info = rep.wait(1, timeout=60)
    assert files_of(info["path"]) == files_of(src)
    assert rep.stats["hook_failures"] == 0, rep.stats
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "the save committed before its start reached the node" in caplog.text
    rep.close()


def test_a_window_of_units_shares_one_acknowledgement_and_one_sync_per_file(sites):
    tr, ev = sites["train"], sites["eval"]
    before = ev.call("replicate.log")["received"]
    rep = Replication(every=1, site="eval-b", node=tr.url, job="window1")
    phases = write_checkpoint_phases(os.path.join(tr.root, "window1"), 1, 12 * UNIT)
    rep.data_written(1, next(phases), nbytes=12 * UNIT)
    final = next(phases)
    rep.committed(1, final)
    info = rep.wait(1, timeout=60)
    n = n_units(12 * UNIT)
    assert files_of(info["path"]) == files_of(final) and info["units_put"] == n
    after = ev.call("replicate.log")["received"]
    # the units in one stream: one acknowledgement, one sync of the data file and one of the journal (was a sync
    # and an acknowledgement per unit)
    # (a checkpoint written whole before it is sent: through the site's page cache, which the verification reads)
    assert {k: after[k] - before[k] for k in after} == {"windows": 1, "units": n, "syncs": 2, "direct_bytes": 0,
                                                        "buffered_bytes": 12 * UNIT, "direct_refused": 0}
    rep.close()


DCP_NAME = "dcpstream/step-00000020"


def _dcp_stream_rank(rank: int, init_file: str, path: str, node: str, out: str) -> None:
    """One of 2 gloo ranks saving through ReplicatingStorageWriter. The coordinator's ``finish`` first waits
    (bounded) until the node has sent every unit of every rank's data file, and records whether that happened:
    only a writer that sends as each rank writes gets them out before ``finish``."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from foresight.replication.flight_calls import call
    from foresight.distributed import run_then_end

    class Waits(ReplicatingStorageWriter):
        def finish(self, metadata, results):
            def all_sent():
                want = len(plan_units(data_files(self.path), UNIT))
                return sum(n == DCP_NAME for n, *_ in call(node, "replicate.log")["sent"]) == want

            try:
                wait_until(all_sent, "every unit sent before finish", timeout=30)
                sent = True
            except AssertionError:
                sent = False
            with open(out, "w") as f:
                json.dump({"sent_before_finish": sent}, f)
            super().finish(metadata, results)

    def save() -> None:
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(3)
        state = {"w": distribute_tensor(torch.randn(512, 300, generator=g), mesh, [Shard(0)]),
                 "b": torch.arange(5000)}
        rep = Replication(every=20, site="eval-b", node=node, job="dcpstream", unit_bytes=UNIT)
        dcp.save(state, storage_writer=Waits(path, replicate=rep, step=20))
        rep.close()
        assert rep.stats["hook_failures"] == 0, rep.stats

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    run_then_end(save)


def test_a_dcp_save_sends_each_ranks_units_as_they_are_written_before_finish(sites):
    import json

    import torch.multiprocessing as tmp_mp

    tr = sites["train"]
    path = os.path.join(tr.root, "dcpstream", "step-00000020")
    out = str(sites["tmp"] / "dcpstream.json")
    tmp_mp.spawn(_dcp_stream_rank, args=(str(sites["tmp"] / "dcpstream-init"), path, tr.url, out), nprocs=2,
                 join=True)
    assert json.load(open(out)) == {"sent_before_finish": True}
    info = tr.call("replicate.wait", {"name": DCP_NAME, "timeout": 60})
    assert files_of(info["path"]) == files_of(path)  # both ranks' files, and .metadata
    assert sorted(n for n in os.listdir(path) if n.endswith("data.bin")) == ["__0_data.bin", "__1_data.bin"]
    assert info["bytes_left_at_commit"] == 0


def test_files_a_writer_never_declared_join_the_transfer_at_the_commit(sites):
    """Each rank declares its own file (``extend``); a rank whose call has not arrived when the coordinator
    commits is found on disk, and its late call is then ignored."""
    tr = sites["train"]
    phases = write_checkpoint_phases(os.path.join(tr.root, "extend1"), 1, 5 * UNIT)
    tmp = next(phases)
    name = "extend1/step-00000001"
    with open(os.path.join(tmp, "data-00001.bin"), "wb") as f:  # a second rank's file, never declared
        f.write(os.urandom(3 * UNIT))
    with open(os.path.join(tmp, "data-00000.bin"), "rb") as f:
        first = len(f.read())
    assert tr.call("replicate.start", {"name": name, "src": tmp, "site": "eval-b", "unit_bytes": UNIT,
                                       "files": [["data-00000.bin", first]], "written": {"data-00000.bin": first},
                                       "extend": True})["units"] == n_units(5 * UNIT)
    assert tr.call("replicate.start", {"name": name, "src": tmp, "site": "eval-b", "unit_bytes": UNIT,
                                       "files": [["data-00000.bin", first]], "extend": True})["units"] == 0
    with pytest.raises(Exception, match="another size"):
        tr.call("replicate.start", {"name": name, "src": tmp, "site": "eval-b", "unit_bytes": UNIT,
                                    "files": [["data-00000.bin", first + 1]], "extend": True})
    final = next(phases)
    tr.call("replicate.commit", {"name": name, "path": final})
    info = tr.call("replicate.wait", {"name": name, "timeout": 60})
    assert info["units"] == n_units(5 * UNIT, 3 * UNIT) and files_of(info["path"]) == files_of(final)
    late = tr.call("replicate.start", {"name": name, "src": tmp, "site": "eval-b", "unit_bytes": UNIT,
                                       "files": [["data-00001.bin", 3 * UNIT]], "extend": True})
    assert late["units"] == 0 and tr.call("replicate.wait", {"name": name, "timeout": 60})["path"] == info["path"]


def test_a_sender_streams_the_next_window_while_the_previous_one_is_acknowledged(sites):
    """One sending thread (the fixture's sites have one stream) keeps windows unacknowledged: the next one goes on
    the wire while the site syncs and acknowledges the previous one (the link never idles for a round trip and a
    sync per window); still every unit is journaled before the replica is published."""
    from foresight.node.server import NodeServer
    from foresight.replication.send_windows import WINDOW_UNITS
    from foresight.replication.service import ReplicationService

    ev = sites["eval"]
    # the training site in this process, so the test can hold the first window's acknowledgement until the next
    # window is put (a loaded host could deliver it first: the overlap is what is checked, not the scheduler)
    root = str(sites["tmp"] / "train-window")
    service = ReplicationService("train-w", root, routes={"eval-b": sites["link"].url}, unit_bytes=UNIT, streams=1)
    server = NodeServer(root, cpu_threshold=101)
    service.mount(server)
    settle = service._settle

    def settle_after_the_next_put(w):
        wait_until(lambda: service.sending["windows"] >= 2, "the next window put before the first acknowledgement")
        settle(w)

    service._settle = settle_after_the_next_put
    before_rx = ev.call("replicate.log")["received"]
    size = (2 * WINDOW_UNITS - 8) * UNIT  # three windows (the last units are smaller)
    n = n_units(size)
    assert 2 * WINDOW_UNITS < n <= 3 * WINDOW_UNITS
    rep = Replication(every=1, site="eval-b", node=server.location, job="window2")
    try:
        phases = write_checkpoint_phases(os.path.join(root, "window2"), 1, size)
        rep.data_written(1, next(phases), nbytes=size)
        final = next(phases)
        rep.committed(1, final)
        info = rep.wait(1, timeout=120)
        assert files_of(info["path"]) == files_of(final) and info["units_put"] == n
        rx = ev.call("replicate.log")["received"]
        assert rx["windows"] - before_rx["windows"] == 3 and rx["units"] - before_rx["units"] == n
        assert service.sending["windows"] == 3 and service.sending["in_flight_max"] >= 2
    finally:
        rep.close()
        server.stop()
        service.close()
