"""Replication under faults (issue 20, item 7), real site processes on loopback: a receiving site that restarts
mid-transfer is waited for and the transfer resumes by unit; replication trouble never fails a DCP save; every
control action checks the token."""
from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from pyarrow import flight

from foresight.checkpoint import store
from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.replication.flight_calls import call
from foresight.testing.processes import free_port
from foresight.errors import CheckpointError

from node_helpers import NodeProc
from replication_helpers import Site, wait_until, write_checkpoint_phases

UNIT = 64 << 10
TOKEN = "repl-token-7"


def files_of(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def test_a_restarting_site_is_waited_for_and_the_transfer_resumes_by_unit(tmp_path):
    eval_root, train_root = str(tmp_path / "eval"), str(tmp_path / "train")
    ev = Site("eval-b", eval_root, unit_bytes=UNIT)
    tr = Site("train-a", train_root, routes={"eval-b": ev.url}, unit_bytes=UNIT)
    plain = ev2 = None
    try:
        tr.call("replicate.pause")
        rep = Replication(every=1, site="eval-b", node=tr.url, job="job")
        phases = write_checkpoint_phases(os.path.join(train_root, "job"), 5, 600_000)
        rep.data_written(5, next(phases), nbytes=600_000)
        final = next(phases)
        rep.committed(5, final)
        tr.call("replicate.resume", {"units": 4})
        wait_until(lambda: len(tr.call("replicate.log")["sent"]) == 4, "4 units sent")
        ev.kill()  # the evaluation site dies mid-transfer ...
        # ... and restarts: its node answers before replication is mounted (a node without --site here, so the
        # sender meets that window every time), then the real site takes the port over
        os.makedirs(tmp_path / "plain")
        plain = NodeProc(str(tmp_path / "plain"), str(tmp_path / "plain-work"), "--port", str(ev.port), name="plain")
        tr.call("replicate.resume")
        wait_until(lambda: "no DoPut for 'replica." in tr.log(), "the sender met the unmounted site")
        assert tr.call("replicate.log")["sent"][4:] == []
        plain.terminate()
        plain = None
        ev2 = Site("eval-b", eval_root, unit_bytes=UNIT, port=ev.port)
        info = rep.wait(5, timeout=120)
        assert files_of(info["path"]) == files_of(final)
        assert info["bytes_sent"] == 600_000 and info["units_put"] == info["units"]  # no unit went twice
        assert store.committed_steps(os.path.join(eval_root, "job")) == [5]
        rep.close()
    finally:
        if plain is not None:
            plain.terminate()
        for s in (ev2, tr, ev):
            if s is not None:
                s.stop()


def test_a_site_that_stays_down_fails_the_transfer_after_the_bound(tmp_path):
    ev = Site("eval-b", str(tmp_path / "eval"), unit_bytes=UNIT)
    tr = Site("train-a", str(tmp_path / "train"), routes={"eval-b": ev.url}, unit_bytes=UNIT, retry_s=2)
    try:
        ev.kill()
        rep = Replication(every=1, site="eval-b", node=tr.url, job="job")
        phases = write_checkpoint_phases(os.path.join(tr.root, "job"), 1, 200_000)
        rep.data_written(1, next(phases))
        rep.committed(1, next(phases))
        with pytest.raises(CheckpointError, match="replication failed"):
            rep.wait(1, timeout=120)
        assert "site unreachable or starting, retrying" in tr.log()
        rep.close()
    finally:
        tr.stop()
        ev.stop()


def test_a_dcp_save_commits_when_the_replication_node_is_down_and_is_replicated_later(tmp_path):
    train_root, eval_root = str(tmp_path / "train"), str(tmp_path / "eval")
    port = free_port()  # nothing listens here yet: the training site's node is down
    rep = Replication(every=10, site="eval-b", node=f"grpc://127.0.0.1:{port}", job="dcpjob", retry_every_s=3600)
    state = {"w": torch.randn(64, 64), "b": torch.arange(10)}
    path = os.path.join(train_root, "dcpjob", "step-00000010")
    dcp.save(state, storage_writer=ReplicatingStorageWriter(path, replicate=rep, step=10), no_dist=True)
    assert os.path.exists(os.path.join(path, ".metadata"))  # committed
    assert rep.stats["hook_failures"] >= 1 and rep._pending == {10: "start"}
    ev = Site("eval-b", eval_root, unit_bytes=UNIT)
    tr = Site("train-a", train_root, routes={"eval-b": ev.url}, unit_bytes=UNIT, port=port)
    try:
        assert rep.retry_pending() == 0  # the node is back: the committed checkpoint is sent
        info = rep.wait(10, timeout=60)
        assert files_of(info["path"]) == files_of(path) and rep.stats["retried"] == 1
        rep.close()
    finally:
        tr.stop()
        ev.stop()


def test_every_control_action_checks_the_token(tmp_path):
    ev = Site("eval-b", str(tmp_path / "eval"), unit_bytes=UNIT, token=TOKEN)
    tr = Site("train-a", str(tmp_path / "train"), routes={"eval-b": ev.url}, unit_bytes=UNIT, token=TOKEN)
    try:
        bodies = {"replicate.start": {"name": "j/s", "src": tr.root, "site": "eval-b"},
                  "replicate.commit": {"name": "j/s", "path": tr.root}, "replicate.abort": {"name": "j/s"},
                  "replicate.urgent": {"name": "j/s", "priority": 1.0}, "replicate.wait": {"name": "j/s"},
                  "replicate.pause": {}, "replicate.resume": {}, "replicate.log": {}, "replica.status": {"name": "j/s"}}
        for action, body in bodies.items():
            for bad in ({}, {"token": "wrong"}):
                with pytest.raises(flight.FlightServerError, match="bad or missing replication token"):
                    call(tr.url, action, {**body, **bad})
        assert call(tr.url, "replication.ping") == {"site": "train-a"}  # tells only the site's name
        # with the token the pair works end to end (the sender carries it to the receiver)
        rep = Replication(every=1, site="eval-b", node=tr.url, job="job", token=TOKEN)
        phases = write_checkpoint_phases(os.path.join(tr.root, "job"), 1, 200_000)
        rep.data_written(1, next(phases))
        final = next(phases)
        rep.committed(1, final)
        assert files_of(rep.wait(1, timeout=60)["path"]) == files_of(final)
        assert tr.call("replica.status", {"name": "job/step-00000001"}) == {"units": [], "extents": []}
        rep.close()
    finally:
        tr.stop()
        ev.stop()


def test_etcd_down_at_the_commit_delays_the_replica_and_it_is_published_and_registered_when_etcd_is_back(tmp_path):
    """etcd killed between the units and the commit: the sender's commit failed on registering its source copy
    (an advertisement) and the receiving site's on registering the replica it had just published (an internal
    error; the transfer failed). Now the commit goes on, the site answers 'unavailable' until etcd is back, the
    commit sent again finds the replica in place and registers it."""
    from foresight.replication.resolver import Resolver
    from foresight.testing.etcd import EtcdProcess

    etcd = EtcdProcess(str(tmp_path / "etcd"))
    port = int(etcd.endpoint.rsplit(":", 1)[1])
    ev = Site("eval-b", str(tmp_path / "eval"), etcd=etcd.endpoint, unit_bytes=UNIT)
    tr = Site("train-a", str(tmp_path / "train"), etcd=etcd.endpoint, routes={"eval-b": ev.url}, unit_bytes=UNIT)
    try:
        rep = Replication(every=1, site="eval-b", node=tr.url, job="job", unit_bytes=UNIT)
        phases = write_checkpoint_phases(os.path.join(tr.root, "job"), 1, 300_000)
        rep.data_written(1, next(phases))
        final = next(phases)
        name = "job/" + os.path.basename(final)
        wait_until(lambda: tr.call("replicate.log")["sent"], "the units to reach the site")
        etcd.proc.kill()
        etcd.proc.wait(30)
        committing = threading.Thread(target=rep.committed, args=(1, final))  # publishes, retrying, meanwhile
        committing.start()
        wait_until(lambda: "replica not registered" in tr.log(), "the site to answer unavailable", timeout=120)
        etcd.close()
        etcd = EtcdProcess(str(tmp_path / "etcd"), port=port)  # back on the same endpoint, its data kept
        committing.join(120)
        assert rep.stats["hook_failures"] == 0  # the commit did not fail on etcd
        info = rep.wait(1, timeout=120)
        assert files_of(info["path"]) == files_of(final)
        with Resolver(etcd.endpoint, site="eval-b") as res:
            assert [c["site"] for c in res.copies(name) if c["site"] == "eval-b"] == ["eval-b"]
        assert not os.path.exists(os.path.join(ev.root, "job", ".replica-" + os.path.basename(final)))
        assert tr.call("replicate.log")["sending"]["register_failures"] == 1
        rep.close()
    finally:
        tr.stop()
        ev.stop()
        etcd.close()
