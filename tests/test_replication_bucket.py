"""Predictive replication to an evaluation site that is a bucket, against the real SeaweedFS of the test session:
a Checkpointer save and a 2-rank DCP save sent as multipart uploads while they are written, published (marker last)
after the commit and read back equal; an aborted save leaves nothing; the server killed mid-transfer; wrong keys."""
from __future__ import annotations

import logging
import os
import shutil
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp_mp
from torch.distributed.checkpoint.api import CheckpointException

import foresight.checkpoint as fc
from foresight.bucket import RetryPolicy
from foresight.bucket.multipart import MIN_PART_BYTES, MultipartClient, part_ends
from foresight.bucket.objects import BucketPrefix
from foresight.checkpoint import ForesightStorageReader, store
from foresight.checkpoint.bucket_tier import BucketTier
from foresight.checkpoint.background_writer import DATA_FILE
from foresight.errors import BucketError, CheckpointError
from foresight.replication.bucket_site import plan_parts
from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.replication.units import HEAD_UNITS, unit_ends

from replication_helpers import wait_until
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)
from test_checkpoint_bucket import assert_state_equal, make_bucket, objects_under, state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

UNIT = 2 << 20  # units of 2 MiB: the 12 MiB tensor of state() is cut into several, coalesced into 5 MiB parts
PATIENT = {"retry": RetryPolicy(attempts=400, budget_s=120, base_s=0.05, max_backoff_s=0.5)}
QUICK = {"retry": RetryPolicy(attempts=2, budget_s=5, base_s=0.01, max_backoff_s=0.05)}


def open_uploads(url: str) -> list:
    with BucketPrefix(url) as b:
        mp = MultipartClient(b.fetcher)
        try:
            return mp.open_uploads()
        finally:
            mp.close()


def test_parts_end_at_unit_ends_and_small_units_are_coalesced():
    size = (200 << 20) + 12345
    units = unit_ends(size, 32 << 20)
    parts = plan_parts(size, 32 << 20)
    assert set(parts) <= set(units) and parts[-1] == size
    assert parts[0] == units[1]  # the first unit (2 MiB, the head ramp's) travels with the second
    assert set(units[HEAD_UNITS:HEAD_UNITS + 4]) <= set(parts)  # full units: one part each
    assert all(b - a >= MIN_PART_BYTES for a, b in zip([0] + parts[:-2], parts[:-1]))  # all but the last
    assert len(parts) < len(units)  # the small tail units travel together
    assert part_ends([1 << 20, 2 << 20]) == [2 << 20]  # a file under 5 MiB: one part


def test_a_checkpointer_save_is_sent_while_saving_and_published_after_the_commit(s3_env, tmp_path):
    site = make_bucket("repl-ckpt") + "/eval"
    rep = Replication(every=5, site=site, job="llm", unit_bytes=UNIT, bucket_options=PATIENT)
    want = state(3)
    try:
        with fc.Checkpointer(str(tmp_path / "ckpt"), replicate=rep) as ck:
            ck.save(want, 5).wait()
            got = rep.wait(5, timeout=120)
            ck.save(state(4), 6).wait()  # not on the schedule: not sent
        assert got["path"].startswith(f"{site}/llm/step-00000005.seq-")
        stats = rep.bucket_site().stats
        assert stats["parts_while_saving"] >= 2 and stats["parts_at_publish"] == 0
        assert stats["files_sent_whole"] == 0 and stats["published"] == 1
    finally:
        rep.close()
    loaded = fc.load(root=f"{site}/llm")
    assert loaded.step == 5
    assert_state_equal(loaded.state_dict, want)
    names = objects_under(f"{site}/llm")
    assert sorted(n.split("/", 1)[1] for n in names) == [store.COMMIT, DATA_FILE, store.INDEX]
    with BucketTier(f"{site}/llm") as tier:
        assert [c.error for c in tier.commits()] == [None]
    assert open_uploads(site) == []


def test_a_save_under_one_unit_is_sent_whole_at_the_commit_and_survives_retention(s3_env, tmp_path):
    """A data file of one unit is announced only by ``data_written``: the commit sends it; with ``keep=1`` the next
    save deletes the local directory while that publish may still run (it reads what it opened)."""
    site = make_bucket("repl-small") + "/eval"
    rep = Replication(every=1, site=site, job="j", bucket_options=PATIENT)
    small = [{"a": torch.arange(1000) + s} for s in range(3)]
    try:
        with fc.Checkpointer(str(tmp_path / "ckpt"), keep=1, replicate=rep) as ck:
            for s, sd in enumerate(small):
                ck.save(sd, s + 1).wait()
        for s in range(3):
            rep.wait(s + 1, timeout=120)
        assert rep.bucket_site().stats["files_sent_whole"] == 3
    finally:
        rep.close()
    for s, sd in enumerate(small):
        assert torch.equal(fc.load(s + 1, root=f"{site}/j").state_dict["a"], sd["a"])


def test_the_marker_is_absent_until_the_source_commit(s3_env, tmp_path):
    """Hooks driven by hand around a real committed directory: every part is in the bucket before the commit,
    yet nothing is published until ``committed``."""
    site = make_bucket("repl-marker") + "/eval"
    src = tmp_path / "ckpt"
    with fc.Checkpointer(str(src)) as ck:
        path = ck.save(state(7), 9).wait().path
    marker = store.read_marker(path)
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT)
    try:
        rep.data_started(9, path, [(DATA_FILE, size)], seq=marker["seq"])
        rep.data_progress(9, {DATA_FILE: size})
        n_parts = len(plan_parts(size, UNIT))
        mp = MultipartClient(rep.bucket_site().objects.fetcher)
        wait_until(lambda: [len(mp.list_parts(u)) for u in mp.open_uploads()] == [n_parts], "every part stored")
        assert not any(n.endswith(store.COMMIT) for n in objects_under(site))  # complete data, no replica yet
        assert BucketTier(f"{site}/j").commits() == []
        rep.committed(9, path)
        rep.wait(9, timeout=120)
        mp.close()
    finally:
        rep.close()
    assert_state_equal(fc.load(root=f"{site}/j").state_dict, state(7))
    assert open_uploads(site) == []


def test_an_aborted_save_leaves_no_marker_and_no_open_upload(s3_env, tmp_path):
    """A DCP save whose commit fails (its .metadata cannot be put in place): the parts already sent are aborted."""
    site = make_bucket("repl-abort") + "/eval"
    path = tmp_path / "dcp"
    (path / ".metadata").mkdir(parents=True)  # the commit's rename onto it fails: the save aborts
    (path / ".metadata" / "x").write_bytes(b"x")
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT)
    try:
        with pytest.raises(CheckpointException, match="Is a directory"):
            dcp.save(state(1), storage_writer=ReplicatingStorageWriter(str(path), replicate=rep, step=4))
        assert rep.bucket_site().stats["parts_while_saving"] >= 2  # parts had left before the abort
    finally:
        rep.close()  # waits for the parts in flight and the abort
    assert objects_under(site) == {}
    assert open_uploads(site) == []


def test_the_server_killed_mid_transfer_is_retried_then_published_never_torn(s3_env, tmp_path):
    site = make_bucket("repl-kill") + "/eval"
    killed = threading.Event()
    restarted = threading.Event()

    class KillAfterFirstPart(Replication):
        def data_progress(self, step, written):
            super().data_progress(step, written)
            if killed.is_set() or self.bucket_site().stats["parts_while_saving"] == 0:
                return
            sent = self.bucket_site().stats
            wait_until(lambda: sent["parts_sent"] >= 1, "a part stored before the kill")
            s3_env.stop()  # SIGKILL: the other parts' requests now fail and are retried
            killed.set()
            fetcher = self.bucket_site().objects.fetcher

            def restart() -> None:
                try:
                    wait_until(lambda: fetcher.stats.retries >= 1, "a request retried while the server is down")
                finally:  # the session's server comes back whatever happened
                    s3_env.start()
                    restarted.set()

            threading.Thread(target=restart, daemon=True).start()

    rep = KillAfterFirstPart(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT)
    want = {"w": torch.randn(6 << 20, generator=torch.Generator().manual_seed(5))}  # 24 MiB: several parts
    try:
        with fc.Checkpointer(str(tmp_path / "ckpt"), replicate=rep) as ck:
            ck.save(want, 2).wait()
        assert killed.is_set()
        got = rep.wait(2, timeout=240)
        assert restarted.is_set()
        assert rep.bucket_site().objects.fetcher.stats.retries >= 1
    finally:
        restarted.wait(120)
        rep.close()
    with BucketTier(f"{site}/j") as tier:
        assert [(c.step, c.error) for c in tier.commits()] == [(2, None)]
        assert tier.commits()[0].path == got["path"]
    assert torch.equal(fc.load(root=f"{site}/j").state_dict["w"], want["w"])
    assert open_uploads(site) == []


def test_wrong_keys_fail_the_replica_in_one_line_and_the_save_still_commits(s3_env, tmp_path, monkeypatch, caplog):
    site = make_bucket("repl-keys") + "/eval"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-right-secret-42")
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=QUICK, retry_every_s=3600)
    try:
        with caplog.at_level(logging.WARNING, logger="foresight.replicate"):
            with fc.Checkpointer(str(tmp_path / "ckpt"), replicate=rep) as ck:
                path = ck.save(state(2), 3).wait().path  # committed all the same
            assert store.read_marker(path)["step"] == 3
            with pytest.raises(CheckpointError) as e:
                rep.wait(3, timeout=120)
        text = str(e.value)
        assert "repl-keys" in text and "access denied" in text and "\n" not in text
        assert "not-the-right-secret-42" not in text and s3_env.secret_key not in text
        assert rep.stats["hook_failures"] >= 1
        logged = " ".join(f"{r.getMessage()} {getattr(r, 'error', '')}" for r in caplog.records)
        assert "access denied" in logged and "not-the-right-secret-42" not in logged
    finally:
        rep.close()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    assert objects_under(site) == {} and open_uploads(site) == []


WORLD = 2


def _sharded(full: dict[str, torch.Tensor]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # lazy: inside the spawned rank only
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    return {"big": distribute_tensor(full["big"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "small": distribute_tensor(full["small"], mesh, [Replicate()])}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {"big": torch.randn(4096, 1024, generator=g),  # 16 MiB: 8 MiB per rank, 2 parts each
            "cols": torch.randn(64, 512, generator=g).to(torch.bfloat16), "small": torch.arange(10)}


def _dcp_rank(rank: int, init_file: str, path: str, site: str, env: dict) -> None:
    import torch.distributed as dist

    from foresight.distributed import run_then_end

    os.environ.update(env)
    rep = Replication(every=10, site=site, job="dcp", unit_bytes=UNIT, bucket_options=PATIENT)

    def save() -> None:
        dcp.save(_sharded(_full()), storage_writer=ReplicatingStorageWriter(path, replicate=rep, step=10))
        stats = rep.bucket_site().stats
        if rank == 0:
            rep.wait(10, timeout=240)
            assert stats["files_sent_whole"] == 0  # rank 1's own upload, completed by the coordinator
        assert stats["parts_while_saving"] >= 2
        rep.close()  # a rank's parts are sent before it exits
        assert rep.stats["hook_failures"] == 0

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    run_then_end(save)


def test_a_two_rank_dcp_save_is_replicated_to_a_bucket_and_loads_equal(s3_env, tmp_path):
    site = make_bucket("repl-dcp") + "/eval"
    path = str(tmp_path / "step-10")
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    tmp_mp.spawn(_dcp_rank, args=(str(tmp_path / "init"), path, site, env), nprocs=WORLD, join=True)
    names = objects_under(f"{site}/dcp/step-10")
    assert sorted(names) == [".metadata", "__0_data.bin", "__1_data.bin"]
    assert all(names[n] == os.path.getsize(os.path.join(path, n)) for n in names)
    from_bucket = {k: torch.empty_like(v) for k, v in _full().items()}
    dcp.load(from_bucket, storage_reader=ForesightStorageReader(f"{site}/dcp/step-10"))
    from_disk = {k: torch.empty_like(v) for k, v in _full().items()}
    dcp.load(from_disk, storage_reader=ForesightStorageReader(path))
    for k, v in _full().items():
        assert torch.equal(from_bucket[k], v) and torch.equal(from_disk[k], v), k
    assert open_uploads(site) == []


def committed_steps(url: str) -> list[int]:
    with BucketTier(url) as tier:
        return [c.step for c in tier.commits() if c.error is None]


def test_retention_keeps_the_newest_replicas_and_finishes_a_delete_cut_short(s3_env, tmp_path):
    """``keep=2``: after each publish the oldest committed replicas beyond two are deleted, marker first; a delete
    cut after the marker (the set left without COMMIT) is finished by the next publish's pass."""
    site = make_bucket("repl-keep") + "/eval"
    rep = Replication(every=1, site=site, job="j", keep=2, bucket_options=PATIENT)
    small = [{"a": torch.arange(1000) + s} for s in range(5)]
    try:
        with fc.Checkpointer(str(tmp_path / "ckpt"), replicate=rep) as ck:
            for s in (1, 2, 3):
                ck.save(small[s], s).wait()
                rep.wait(s, timeout=120)
            wait_until(lambda: committed_steps(f"{site}/j") == [2, 3], "retention after the publish of 3")
            cut = rep.wait(2)["path"].rsplit("/", 1)[1]
            with BucketPrefix(f"{site}/j") as b:  # a pass cut right after its first request
                b.delete([f"{cut}/{store.COMMIT}"])
            assert any(n.startswith(cut) for n in objects_under(f"{site}/j"))
            ck.save(small[4], 4).wait()
            kept = [rep.wait(s, timeout=120)["path"].rsplit("/", 1)[1] for s in (3, 4)]
        stats = rep.bucket_site().stats
    finally:
        rep.close()  # after the last publish's retention
    assert committed_steps(f"{site}/j") == [3, 4]
    assert sorted({n.split("/", 1)[0] for n in objects_under(f"{site}/j")}) == kept
    assert stats["deleted"] == 1 and stats["retention_failures"] == 0  # step 1; step 2 was a leftover
    assert torch.equal(fc.load(3, root=f"{site}/j").state_dict["a"], small[3]["a"])


def test_a_replica_ttl_never_deletes_the_newest_nor_a_save_still_uploading(s3_env, tmp_path):
    """``replica_ttl=0``: every replica but the newest is past its TTL at each pass; a save whose parts are in
    the bucket but not yet committed (hooks driven by hand) keeps its open upload and every part through them."""
    site = make_bucket("repl-ttl") + "/eval"
    with fc.Checkpointer(str(tmp_path / "other")) as ck:
        path = ck.save(state(7), 50).wait().path
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, replica_ttl=0, bucket_options=PATIENT)
    try:
        rep.data_started(50, path, [(DATA_FILE, size)], seq=store.read_marker(path)["seq"])
        rep.data_progress(50, {DATA_FILE: size})
        mp = MultipartClient(rep.bucket_site().objects.fetcher)
        n_parts = len(plan_parts(size, UNIT))
        wait_until(lambda: [len(mp.list_parts(u)) for u in mp.open_uploads()] == [n_parts], "every part stored")
        with fc.Checkpointer(str(tmp_path / "ckpt"), replicate=rep) as ck:
            for s in (1, 2, 3):
                ck.save({"a": torch.arange(100) + s}, s).wait()
                rep.wait(s, timeout=120)
                wait_until(lambda: committed_steps(f"{site}/j") == [s], f"retention after the publish of {s}")
        assert [len(mp.list_parts(u)) for u in mp.open_uploads()] == [n_parts]  # the save in flight: untouched
        mp.close()
        rep.aborted(50)
        stats = rep.bucket_site().stats
    finally:
        rep.close()
    assert stats["deleted"] == 2
    assert open_uploads(site) == []


def test_retention_of_dcp_replicas_deletes_by_publish_order_and_finishes_a_cut_delete(s3_env, tmp_path):
    site = make_bucket("repl-keep-dcp") + "/eval"
    rep = Replication(every=1, site=site, job="j", keep=2, bucket_options=PATIENT)
    try:
        for s in (1, 2, 3):
            dcp.save({"a": torch.arange(1000) + s},
                     storage_writer=ReplicatingStorageWriter(str(tmp_path / f"step-{s}"), replicate=rep, step=s))
            rep.wait(s, timeout=120)
            if s == 2:
                with BucketPrefix(f"{site}/j") as b:  # a pass over step-1 cut right after its .metadata
                    b.delete(["step-1/.metadata"])
    finally:
        rep.close()
    assert sorted(objects_under(f"{site}/j")) == ["step-2/.metadata", "step-2/__0_data.bin",
                                                  "step-3/.metadata", "step-3/__0_data.bin"]
    got = {"a": torch.empty(1000, dtype=torch.int64)}
    dcp.load(got, storage_reader=ForesightStorageReader(f"{site}/j/step-2"))
    assert torch.equal(got["a"], torch.arange(1000) + 2)


def test_keep_and_ttl_are_refused_for_a_node_site_and_out_of_range():
    with pytest.raises(ValueError, match="bucket site's retention"):
        Replication(every=1, site="eval-b", node="grpc://127.0.0.1:1", job="j", keep=2)
    with pytest.raises(ValueError, match="keep must be"):
        Replication(every=1, site="s3://eval/p", job="j", keep=0)
    with pytest.raises(ValueError, match="replica_ttl must be"):
        Replication(every=1, site="s3://eval/p", job="j", replica_ttl=-1)


def _late_rank(rank: int, init_file: str, path: str, site: str, env: dict, flag: str) -> None:
    """Rank 1 creates its upload only once rank 0 (the coordinator) has aborted the save and every upload it
    listed: the upload comes after the abort's listing, deterministically."""
    import torch.distributed as dist

    from foresight.distributed import run_then_end

    os.environ.update(env)
    rep = Replication(every=10, site=site, job="dcp", unit_bytes=UNIT, bucket_options=PATIENT)
    if rank == 1:
        mp = rep.bucket_site().multipart
        create = mp.create

        def late_create(name):
            wait_until(lambda: os.path.exists(flag), "the coordinator's abort", timeout=240)
            return create(name)

        mp.create = late_create

    def save() -> None:
        with pytest.raises(CheckpointException, match="Is a directory"):
            dcp.save(_sharded(_full()), storage_writer=ReplicatingStorageWriter(path, replicate=rep, step=10))
        sender = rep.bucket_site()
        rep.close()  # rank 0: the abort done (record, then every listed upload aborted); rank 1: its parts sent
        if rank == 0:
            assert open_uploads(site) == []  # rank 1 has not created its upload yet
            with open(flag, "w"):
                pass
        else:
            assert sender.stats["uploads_aborted_late"] == 1

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    run_then_end(save)


def test_a_rank_upload_created_after_the_coordinators_abort_is_aborted_too(s3_env, tmp_path):
    site = make_bucket("repl-abort-late") + "/eval"
    path = tmp_path / "step-10"
    (path / ".metadata").mkdir(parents=True)  # the commit's rename onto it fails: the save aborts
    (path / ".metadata" / "x").write_bytes(b"x")
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    tmp_mp.spawn(_late_rank, args=(str(tmp_path / "init"), str(path), site, env, str(tmp_path / "aborted")),
                 nprocs=WORLD, join=True)
    assert open_uploads(site) == []
    assert [n for n in objects_under(site) if "/.aborted/" not in n] == []


def test_an_urgent_step_is_published_ahead_of_the_steps_queued_before_it(s3_env, tmp_path):
    """Step 1's publish is held at its marker while steps 2 and 3 commit (their publishes queue behind it); step 3
    turned urgent is published before step 2."""
    site = make_bucket("repl-urgent") + "/eval"
    rep = Replication(every=1, site=site, job="j", bucket_options=PATIENT)
    objects = rep.bucket_site().objects
    put, markers, release = objects.put, [], threading.Event()

    def held_put(name, data):
        if name.endswith(f"/{store.COMMIT}"):
            if not markers:
                release.wait(120)
            markers.append(int(name.split("step-")[1][:8]))
        return put(name, data)

    objects.put = held_put
    try:
        with fc.Checkpointer(str(tmp_path / "ckpt"), replicate=rep) as ck:
            for s in (1, 2, 3):
                ck.save({"a": torch.arange(100) + s}, s).wait()
            rep.urgent(3)
            release.set()
            for s in (1, 2, 3):
                rep.wait(s, timeout=120)
    finally:
        release.set()
        rep.close()
    assert markers == [1, 3, 2]
    assert committed_steps(f"{site}/j") == [1, 2, 3]


def test_an_urgent_steps_parts_go_ahead_of_the_parts_queued_before_them(s3_env, tmp_path):
    """One part in flight at a time, held at the first: the rest of step 10's parts and then step 20's queue behind
    it; step 20 turned urgent has all its parts sent before step 10's next one."""
    site = make_bucket("repl-urgent-parts") + "/eval"
    with fc.Checkpointer(str(tmp_path / "other")) as ck:
        paths = {s: ck.save(state(s), s).wait().path for s in (10, 20)}
    rep = Replication(every=10, site=site, job="j", unit_bytes=UNIT,
                      bucket_options={**PATIENT, "part_concurrency": 1})
    mp = rep.bucket_site().multipart
    upload_part, sent, release = mp.upload_part, [], threading.Event()

    def held_part(up, number, data):
        if not sent:
            sent.append(None)
            release.wait(120)
        sent.append(int(up.name.split("step-")[1][:8]))
        return upload_part(up, number, data)

    mp.upload_part = held_part
    try:
        for s, path in paths.items():
            size = os.path.getsize(os.path.join(path, DATA_FILE))
            rep.data_started(s, path, [(DATA_FILE, size)], seq=store.read_marker(path)["seq"])
            rep.data_progress(s, {DATA_FILE: size})
        n = len(plan_parts(size, UNIT))
        assert n >= 3
        rep.urgent(20)
        release.set()
        for s, path in paths.items():
            rep.committed(s, path)
        for s in paths:
            rep.wait(s, timeout=120)
    finally:
        release.set()
        rep.close()
    assert sent[1:] == [10] + [20] * n + [10] * (n - 1)  # the held part first, then step 20's, then step 10's


def test_a_publish_that_cannot_read_its_commit_aborts_the_uploads_sent_while_saving(s3_env, tmp_path):
    """The committed directory is gone when the commit hook comes (deleted, or a wrong path): the publish fails,
    and the upload its parts went to while saving is aborted (none stays open, billed and never completed)."""
    site = make_bucket("repl-gone") + "/eval"
    with fc.Checkpointer(str(tmp_path / "other")) as ck:
        path = ck.save(state(7), 9).wait().path
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT, retry_every_s=3600)
    try:
        rep.data_started(9, path, [(DATA_FILE, size)], seq=store.read_marker(path)["seq"])
        rep.data_progress(9, {DATA_FILE: size})
        mp = MultipartClient(rep.bucket_site().objects.fetcher)
        n_parts = len(plan_parts(size, UNIT))
        wait_until(lambda: [len(mp.list_parts(u)) for u in mp.open_uploads()] == [n_parts], "every part stored")
        mp.close()
        shutil.rmtree(path)
        rep.committed(9, path)
        with pytest.raises(CheckpointError, match="not published"):
            rep.wait(9, timeout=120)
        assert rep.stats["hook_failures"] >= 1  # logged, counted (wait retried it once more)
        wait_until(lambda: open_uploads(site) == [], "the streamed upload aborted", timeout=30)
    finally:
        rep.close()
    assert objects_under(site) == {}


def test_a_coordinator_waits_for_the_other_ranks_uploads_once_not_once_per_rank(s3_env, tmp_path):
    """Three other ranks' uploads never come (their processes died): the coordinator's wait for them is one
    ``rank_wait_s`` in all, then each file is sent from the directory; the later files are looked up once each,
    not waited for again one after the other (64 ranks would have cost 64 waits)."""
    site = make_bucket("repl-rank-wait") + "/eval"
    path = tmp_path / "step-10"
    path.mkdir()
    bodies = {f"__{r}_data.bin": os.urandom((1 << 20) + 4096 * r + 7) for r in range(4)}
    for n, body in bodies.items():
        (path / n).write_bytes(body)
    (path / ".metadata").write_bytes(b"metadata")
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT, rank_wait_s=2.0)
    bsite = rep.bucket_site()
    journaled, looked = bsite._journaled, {}

    def counted(prefix, save, fname):  # the coordinator's look for a rank's upload (journaled under the save)
        looked[fname] = looked.get(fname, 0) + 1
        return journaled(prefix, save, fname)

    bsite._journaled = counted
    try:
        own = "__0_data.bin"
        rep.data_started(10, str(path), [(own, len(bodies[own]))], leaf="step-10", shared=True, save="s1")
        rep.data_progress(10, {own: len(bodies[own])})
        rep.committed(10, str(path))
        got = rep.wait(10, timeout=120)
        stats = rep.bucket_site().stats
    finally:
        rep.close()
    assert got["path"] == f"{site}/j/step-10"
    assert stats["files_sent_whole"] == 3
    waited = [looked.get(f"__{r}_data.bin", 0) for r in (1, 2, 3)]
    assert waited[0] >= 2 and waited[1:] == [1, 1], waited  # the later ranks: one look each, no second wait
    assert {n: len(b) for n, b in bodies.items()} == {n: s for n, s in objects_under(f"{site}/j/step-10").items()
                                                      if n != ".metadata"}
    assert open_uploads(site) == []


def test_a_part_waiting_on_a_failed_create_never_opens_an_upload_the_publish_does_not_see(s3_env, tmp_path):
    """The first part's upload cannot be created (the server is down for its retries); the next part, queued on the
    same create, must not create one later: the publish sends the file whole, and an upload created after its
    listing would stay open for ever."""
    site = make_bucket("repl-create-fail") + "/eval"
    with fc.Checkpointer(str(tmp_path / "other")) as ck:
        path = ck.save(state(7), 9).wait().path
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, retry_every_s=3600,
                      bucket_options={**QUICK, "part_concurrency": 2})
    mp = rep.bucket_site().multipart
    create, open_uploads_of, calls, listed = mp.create, mp.open_uploads, [], threading.Event()

    def create_with_the_server_down_first(name):
        calls.append(name)
        if len(calls) == 1:
            s3_env.stop()
            try:
                return create(name)
            finally:
                s3_env.start()
        listed.wait(30)  # a second create comes after the publish listed the open uploads
        return create(name)

    def listing(under=""):
        try:
            return open_uploads_of(under)
        finally:
            listed.set()

    mp.create, mp.open_uploads = create_with_the_server_down_first, listing
    try:
        rep.data_started(9, path, [(DATA_FILE, size)], seq=store.read_marker(path)["seq"])
        rep.data_progress(9, {DATA_FILE: size})
        assert len(plan_parts(size, UNIT)) >= 2
        wait_until(lambda: rep.bucket_site()._transfers[9].error is not None, "the first create failed")
        rep.committed(9, path)
        rep.wait(9, timeout=120)
        assert rep.bucket_site().stats["files_sent_whole"] == 1
    finally:
        listed.set()
        rep.close()
    assert_state_equal(fc.load(root=f"{site}/j").state_dict, state(7))
    assert open_uploads(site) == []


def test_a_save_announced_again_drops_the_first_attempts_upload_and_file(s3_env, tmp_path):
    """A DCP save of step 10 failed on another rank (no hook tells this rank) and is saved again into the same
    directory: the first attempt's upload is aborted and its data file closed, and the second is published."""
    site = make_bucket("repl-again") + "/eval"
    path = tmp_path / "step-10"
    path.mkdir()
    own = "__0_data.bin"
    body = os.urandom(8 * UNIT + 4096)
    (path / own).write_bytes(body)
    (path / ".metadata").write_bytes(b"metadata")
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT, retry_every_s=3600)
    try:
        rep.data_started(10, str(path), [(own, len(body))], leaf="step-10", shared=True)
        rep.data_progress(10, {own: 3 * UNIT})  # the first attempt sends a part, then fails elsewhere
        wait_until(lambda: rep.bucket_site().stats["parts_sent"] >= 1, "the first attempt's part stored")
        first = rep.bucket_site()._transfers[10].files[own]
        rep.data_started(10, str(path), [(own, len(body))], leaf="step-10", shared=True)  # saved again
        rep.data_progress(10, {own: len(body)})
        rep.committed(10, str(path))
        rep.wait(10, timeout=120)
        wait_until(lambda: first.fd == -1, "the first attempt's data file closed", timeout=30)
    finally:
        rep.close()
    assert objects_under(f"{site}/j/step-10") == {own: len(body), ".metadata": 8}
    assert open_uploads(site) == []


def test_an_error_on_the_publisher_thread_is_logged_and_counted_never_lost(s3_env, tmp_path, caplog):
    """A failure handler that itself raises (a caller's bug) runs on the publisher thread, where nobody waits on
    the result: the error is logged and counted, and the site goes on publishing."""
    site = make_bucket("repl-lost") + "/eval"
    with fc.Checkpointer(str(tmp_path / "other")) as ck:
        path = ck.save({"a": torch.arange(100)}, 3).wait().path
    bsite = Replication(every=1, site=site, job="j", bucket_options=QUICK).bucket_site()

    def broken_handler(e):
        raise RuntimeError("the handler's own bug")

    try:
        with caplog.at_level(logging.WARNING, logger="foresight.replicate"):
            s3_env.stop()
            try:
                bsite.publish(3, path, on_error=broken_handler)  # fails: the server is down
                with pytest.raises(CheckpointError):
                    bsite.wait(3, timeout=120)
            finally:
                s3_env.start()
            wait_until(lambda: bsite.stats["thread_errors"] == 1, "the handler's error counted")
        assert any("the handler's own bug" in r.getMessage() for r in caplog.records)
        bsite.publish(3, path, on_error=broken_handler)
        assert bsite.wait(3, timeout=120)["path"].startswith(f"{site}/j/step-00000003")  # still publishing
    finally:
        bsite.close()


def test_a_bucket_option_the_client_does_not_take_is_refused_before_any_save(tmp_path):
    """A DCP writer calls the hooks without a guard: an option the bucket client does not take must fail the
    Replication, by name, not the first replicated save (with a TypeError from inside the client)."""
    with pytest.raises(ValueError, match="retries"):
        Replication(every=1, site="s3://eval/p", job="j", bucket_options={"retries": 3})
    Replication(every=1, site="s3://eval/p", job="j", bucket_options={"part_concurrency": 2, "concurrency": 4})


def test_a_completion_whose_reply_was_lost_is_not_a_failure(s3_env, monkeypatch):
    """CompleteMultipartUpload is not idempotent: once it took effect the upload is gone, and a retry of it (the
    first reply lost on the way back) is answered NoSuchUpload. That retry must find the object the parts made
    (its size and multipart ETag), not fail the publish as "object not found" and send the checkpoint again."""
    from foresight.testing.http_faults import Fault, FaultProxy

    url = make_bucket("lost-reply") + "/job"
    parts_data = [os.urandom(MIN_PART_BYTES), os.urandom(1 << 20)]
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"]),
                    [Fault(status=0, method="POST", path=r"uploadId=", times=1, drop_reply=True)]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with BucketPrefix(url, **PATIENT) as b:
            mp = MultipartClient(b.fetcher)
            try:
                up = mp.create("step/data.bin")
                parts = [mp.upload_part(up, k + 1, d) for k, d in enumerate(parts_data)]
                ref = mp.complete(up, parts)
                assert proxy.count(method="POST", path=r"uploadId=", injected=True) == 1  # the reply was lost
                assert ref.size == sum(map(len, parts_data))
                assert b.get(ref) == b"".join(parts_data)
            finally:
                mp.close()
    # a completion that truly failed (the upload aborted, no object) still fails, naming the object
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    with BucketPrefix(url, **QUICK) as b:
        mp = MultipartClient(b.fetcher)
        try:
            up = mp.create("step/other.bin")
            parts = [mp.upload_part(up, 1, parts_data[1])]
            mp.abort(up)
            with pytest.raises(BucketError, match="other.bin"):
                mp.complete(up, parts)
        finally:
            mp.close()
