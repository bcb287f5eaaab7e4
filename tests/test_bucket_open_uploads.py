"""No multipart upload is left open by a save to a bucket that fails part way, against a real SeaweedFS with a
fault proxy in front of it: a DCP save whose data object's later parts fail, and the Checkpointer's drain of a
step to a bucket tier. What was acknowledged (an earlier checkpoint) stays."""
from __future__ import annotations

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
from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter
from foresight.errors import CheckpointError
from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.testing.http_faults import Fault, FaultProxy
from replication_helpers import wait_until
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)
from test_checkpoint_bucket import make_bucket, state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

QUICK = {"retry": RetryPolicy(attempts=2, budget_s=5, base_s=0.01, max_backoff_s=0.05), "part_bytes": 5 << 20}
LATER_PARTS = r"partNumber=[2-9]"  # the data object's 2nd and later parts (12 MiB in 5 MiB parts)


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

    t = threading.Thread(target=interrupt)
    t.start()
    try:
        with pytest.raises(CheckpointException, match="KeyboardInterrupt"):
            dcp.save(state(1), storage_writer=writer, no_dist=True)
        assert open_uploads(s3_env, "dcp-interrupted") == []
    finally:
        t.join()
        writer.close()
