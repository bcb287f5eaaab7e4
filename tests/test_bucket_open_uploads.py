"""No multipart upload is left open by a save to a bucket that fails part way, against a real SeaweedFS with a
fault proxy in front of it: a DCP save whose data object's later parts fail, and the Checkpointer's drain of a
step to a bucket tier. What was acknowledged (an earlier checkpoint) stays."""
from __future__ import annotations

import os
import signal
import threading

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import foresight.checkpoint as fc
from foresight.bucket import RetryPolicy
from foresight.bucket.objects import BucketPrefix
from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter, store
from foresight.checkpoint.background_writer import DATA_FILE
from foresight.errors import CheckpointError
from foresight.replication.bucket_site import plan_parts
from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.testing.http_faults import Fault, FaultProxy
from replication_helpers import wait_until
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)
from test_checkpoint_bucket import assert_state_equal, make_bucket, objects_under, state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PATIENT = {"retry": RetryPolicy(attempts=400, budget_s=120, base_s=0.05, max_backoff_s=0.5)}
QUICK = {"retry": RetryPolicy(attempts=2, budget_s=5, base_s=0.01, max_backoff_s=0.05), "part_bytes": 5 << 20}
LATER_PARTS = r"partNumber=[2-9]"  # the data object's 2nd and later parts (12 MiB in 5 MiB parts)
CREATE = r"\?uploads"  # CreateMultipartUpload: POST <key>?uploads


def open_uploads(s3_env, bucket: str) -> list[dict]:
    """The bucket's open multipart uploads, listed by boto3 straight from the server."""
    env = s3_env.env()
    client = boto3.client("s3", endpoint_url=s3_env.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.fixture
def proxy(s3_env, monkeypatch):
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"])) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        yield p


def test_a_dcp_save_failing_after_some_parts_leaves_no_upload_open(s3_env, proxy):
    base = make_bucket("dcp-open-uploads")
    good = state(1)
    writer = ForesightStorageWriter(base + "/step-1", bucket_options=QUICK)
    dcp.save(good, storage_writer=writer, no_dist=True)  # acknowledged: stays
    writer.close()
    proxy.faults.append(Fault(status=500, method="PUT", path=LATER_PARTS))
    writer = ForesightStorageWriter(base + "/step-2", bucket_options=QUICK)
    with pytest.raises(CheckpointException, match="still failing"):
        dcp.save(state(2), storage_writer=writer, no_dist=True)
    writer.close()
    assert proxy.count(method="PUT", path=r"partNumber=1\b") >= 1  # a part was stored before the failure
    assert open_uploads(s3_env, "dcp-open-uploads") == []
    proxy.faults.clear()
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state(0).items()}
    dcp.load(target, storage_reader=ForesightStorageReader(base + "/step-1"), no_dist=True)
    assert torch.equal(target["w"], good["w"])


def test_a_checkpointer_drain_failing_after_some_parts_leaves_no_upload_open(s3_env, proxy, tmp_path):
    root = make_bucket("ck-open-uploads") + "/run"
    with fc.Checkpointer([str(tmp_path / "fast"), root], bucket_options=QUICK) as ck:
        ck.save(state(1), 10).wait()
        proxy.faults.append(Fault(status=500, method="PUT", path=LATER_PARTS))
        with pytest.raises(CheckpointError):
            ck.save(state(2), 20).wait()
    assert proxy.count(method="PUT", path=r"partNumber=1\b") >= 1
    assert open_uploads(s3_env, "ck-open-uploads") == []
    proxy.faults.clear()
    got = fc.load("latest", tiers=[str(tmp_path / "other"), root], bucket_options=QUICK)
    assert got.step == 10


def test_a_replicated_dcp_save_interrupted_in_write_data_leaves_no_upload_open(s3_env, tmp_path):
    """Replication to a bucket site sends parts while the data file is written; a KeyboardInterrupt after they
    left (before DCP reaches ``finish``, which no longer runs) aborts them."""
    site = make_bucket("repl-interrupted") + "/eval"
    rep = Replication(every=1, site=site, job="j", unit_bytes=2 << 20, bucket_options=QUICK)

    class Interrupted(ReplicatingStorageWriter):
        def _write_file(self, fio, fd, view, path):
            super()._write_file(fio, fd, view, path)
            wait_until(lambda: rep.bucket_site().stats["parts_while_saving"] >= 2, "parts sent while saving")
            raise KeyboardInterrupt  # Ctrl-C once the bytes are written and parts have left

    try:
        with pytest.raises(CheckpointException, match="KeyboardInterrupt"):
            dcp.save(state(1), storage_writer=Interrupted(str(tmp_path / "dcp"), replicate=rep, step=4), no_dist=True)
        assert rep.bucket_site().stats["parts_while_saving"] >= 2  # parts had left before the interrupt
    finally:
        rep.close()  # waits for the parts in flight and the abort
    assert open_uploads(s3_env, "repl-interrupted") == []


def test_a_replicated_dcp_save_that_never_reached_finish_is_aborted_at_the_next_save(s3_env, tmp_path):
    """DCP tells the writer nothing when a save fails between ``write_data`` and ``finish`` (another rank failed):
    the writer finds it at its next save (no metadata: never committed) and aborts its uploads."""
    site = make_bucket("repl-unfinished") + "/eval"
    rep = Replication(every=1, site=site, job="j", unit_bytes=2 << 20, bucket_options=QUICK)

    class FailsBeforeFinish(ReplicatingStorageWriter):
        fail = True

        def finish(self, metadata, results):
            if self.fail:  # what DCP does when a rank failed: the coordinator's finish is never called
                raise RuntimeError("another rank failed")
            super().finish(metadata, results)

        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            wait_until(lambda: rep.bucket_site().stats["parts_while_saving"] >= 2, "parts sent while saving")
            return fut

    writer = FailsBeforeFinish(str(tmp_path / "step-4"), replicate=rep, step=4)
    try:
        with pytest.raises(CheckpointException, match="another rank failed"):
            dcp.save(state(1), storage_writer=writer, no_dist=True)
        writer.fail = False
        writer.step = 5
        dcp.save(state(2), storage_writer=writer, checkpoint_id=str(tmp_path / "step-5"), no_dist=True)
        writer.close()
        rep.bucket_site().wait(5, timeout=120)
    finally:
        rep.close()
    assert [u["Key"] for u in open_uploads(s3_env, "repl-unfinished")] == []


def test_a_dcp_save_interrupted_mid_upload_leaves_no_upload_open(s3_env, proxy):
    """Ctrl-C while the data object's parts are in flight (the later ones held back by the proxy): obstore's put
    runs to its end (the interrupt lands once it returns), so the object is completed, never left open."""
    base = make_bucket("dcp-interrupted")
    proxy.faults.append(Fault(status=0, method="PUT", path=LATER_PARTS, delay_s=2.0))
    writer = ForesightStorageWriter(base + "/step-1", bucket_options=QUICK)

    def interrupt():
        proxy.wait_for(1, method="PUT", path=r"partNumber=1\b", timeout_s=60)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python's own Ctrl-C handler, whatever this process inherited: a suite started from a shell without job
    # control (`cmd &` in a script) starts with SIGINT ignored, and the save then ran to its end uninterrupted
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt)
    t.start()
    try:
        with pytest.raises(CheckpointException, match="KeyboardInterrupt"):
            dcp.save(state(1), storage_writer=writer, no_dist=True)
        assert open_uploads(s3_env, "dcp-interrupted") == []
    finally:
        t.join()
        writer.close()
        signal.signal(signal.SIGINT, previous)


UNIT = 2 << 20  # replication units of 2 MiB: a file of a few units is several 5 MiB parts


def _rank_save(site: str, path, fname: str, body: bytes, save: str, **kw) -> Replication:
    """One DCP rank's side of save ``save``: its data file announced and written whole (its parts leave)."""
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=QUICK, retry_every_s=3600, **kw)
    (path / fname).write_bytes(body)
    rep.data_started(10, str(path), [(fname, len(body))], leaf="step-10", shared=True, save=save)
    rep.data_progress(10, {fname: len(body)})
    return rep


def test_an_upload_left_open_by_an_earlier_attempt_is_never_published_by_the_next(s3_env, tmp_path):
    """A DCP save of step-10 crashed after rank 1 had sent every part of its file (the upload stays open: no hook
    ran). The job restarts and saves step-10 again, same sizes, other values; rank 1 of the new attempt never
    sends its parts (slow, or dead). The coordinator must not complete the old attempt's upload (its parts match
    the plan's sizes): the replica holds the new attempt's bytes (sent from the directory), and the stale upload
    is aborted by the publish."""
    site = make_bucket("repl-stale") + "/eval"
    path = tmp_path / "step-10"
    path.mkdir()
    size = 4 * UNIT + 4096
    old, new, own = os.urandom(size), os.urandom(size), os.urandom(size)
    first = _rank_save(site, path, "__1_data.bin", old, "attempt-1")
    wait_until(lambda: first.bucket_site().stats["parts_sent"] == len(plan_parts(size, UNIT)), "rank 1's parts")
    first.close()  # the crash: nothing aborts rank 1's upload
    stale = open_uploads(s3_env, "repl-stale")
    assert len(stale) == 1
    newer_than(s3_env, "repl-stale", stale[0]["Initiated"])
    (path / "__1_data.bin").write_bytes(new)  # the new attempt's rank 1 file (its parts are never sent)
    (path / ".metadata").write_bytes(b"metadata")
    coord = _rank_save(site, path, "__0_data.bin", own, "attempt-2", rank_wait_s=2.0)
    try:
        coord.committed(10, str(path))
        coord.wait(10, timeout=120)
        sent_whole = coord.bucket_site().stats["files_sent_whole"]
    finally:
        coord.close()
    with BucketPrefix(site + "/j/step-10") as b:
        assert b.get(b.head("__1_data.bin")) == new
        assert b.get(b.head("__0_data.bin")) == own
    assert sent_whole == 1  # rank 1's, from the directory
    assert open_uploads(s3_env, "repl-stale") == []
    assert [n for n in objects_under(site) if "/.uploads/" in n] == []  # both attempts' journal entries gone


def newer_than(s3_env, bucket: str, when) -> None:
    """Wait until the server's clock is past ``when`` (its listings have 1 s steps): what is created next is
    newer than what was created before, as the server stamps it."""
    with BucketPrefix(f"s3://{bucket}/.clock") as b:
        def past() -> bool:
            b.put(".clock", b"")
            return b.list()[".clock"].modified > when.timestamp()
        wait_until(past, "the server's clock to move on", timeout=30)
        b.delete([".clock"])


def test_a_create_whose_reply_was_lost_leaves_no_upload_open_after_the_publish(s3_env, proxy, tmp_path):
    """CreateMultipartUpload took effect but its reply was lost; the retry creates a second upload, which the
    parts go to. The first, empty and known to nobody, must be aborted by the publish that succeeds."""
    site = make_bucket("repl-lost-create") + "/eval"
    with fc.Checkpointer(str(tmp_path / "src")) as ck:
        path = ck.save(state(3), 9).wait().path
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    proxy.faults.append(Fault(status=0, method="POST", path=CREATE, times=1, drop_reply=True))
    rep = Replication(every=1, site=site, job="j", unit_bytes=UNIT, bucket_options=PATIENT, retry_every_s=3600)
    try:
        rep.data_started(9, path, [(DATA_FILE, size)], seq=store.read_marker(path)["seq"])
        rep.data_progress(9, {DATA_FILE: size})
        rep.committed(9, path)
        rep.wait(9, timeout=120)
        assert rep.bucket_site().stats["files_sent_whole"] == 0
    finally:
        rep.close()
    assert proxy.count(method="POST", path=CREATE, injected=True) == 1
    assert open_uploads(s3_env, "repl-lost-create") == []
    assert_state_equal(fc.load(root=f"{site}/j").state_dict, state(3))


def test_a_dcp_save_whose_create_reply_was_lost_leaves_no_upload_open(s3_env, proxy):
    base = make_bucket("dcp-lost-create")
    proxy.faults.append(Fault(status=0, method="POST", path=CREATE, times=1, drop_reply=True))
    writer = ForesightStorageWriter(base + "/step-1", bucket_options={**PATIENT, "part_bytes": 5 << 20})
    dcp.save(state(1), storage_writer=writer, no_dist=True)
    writer.close()
    assert proxy.count(method="POST", path=CREATE, injected=True) == 1
    assert open_uploads(s3_env, "dcp-lost-create") == []
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state(0).items()}
    dcp.load(target, storage_reader=ForesightStorageReader(base + "/step-1"), no_dist=True)
    assert torch.equal(target["w"], state(1)["w"])


def test_a_checkpointer_drain_whose_create_reply_was_lost_leaves_no_upload_open(s3_env, proxy, tmp_path):
    root = make_bucket("ck-lost-create") + "/run"
    proxy.faults.append(Fault(status=0, method="POST", path=CREATE, times=1, drop_reply=True))
    with fc.Checkpointer([str(tmp_path / "fast"), root], bucket_options={**PATIENT, "part_bytes": 5 << 20}) as ck:
        ck.save(state(1), 10).wait()
    assert proxy.count(method="POST", path=CREATE, injected=True) == 1
    assert open_uploads(s3_env, "ck-lost-create") == []
    assert fc.load("latest", tiers=[str(tmp_path / "other"), root], bucket_options=QUICK).step == 10
