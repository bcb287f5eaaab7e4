"""Checkpoints to and from a bucket against a real SeaweedFS: the Checkpointer's bucket tier (drain with multipart
uploads and COMMIT last, retention, restore with ranged GETs), the DCP writer and reader on s3://, and the faults:
the server killed mid-upload, torn object sets, missing bucket and wrong keys."""
from __future__ import annotations

import datetime
import logging
import os
import threading
import traceback

import obstore
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp_mp
from torch.distributed.checkpoint.api import CheckpointException

import foresight.checkpoint as fc
from foresight.bucket import BucketURL, RetryPolicy
from foresight.bucket.config import open_store
from foresight.bucket.objects import BucketPrefix
from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter, store
from foresight.checkpoint.bucket_tier import BucketTier, commit_name
from foresight.errors import BucketError, CheckpointError
from foresight.distributed import end_process_groups
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

QUICK = {"retry": RetryPolicy(attempts=2, budget_s=5, base_s=0.01, max_backoff_s=0.05)}
PATIENT = {"retry": RetryPolicy(attempts=200, budget_s=120, base_s=0.05, max_backoff_s=0.5)}
# parts of 5 MiB (S3's smallest): the 12 MiB tensor of state() makes a multipart upload of 3 parts
SMALL_PARTS = {"part_bytes": 5 << 20}


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.randn(10, generator=g).to(torch.bfloat16),
            "i": torch.tensor(seed), "nested": {"h": torch.arange(seed, seed + 100, dtype=torch.int16)}}


def assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            assert_state_equal(got[k], v)
        else:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def make_bucket(name: str) -> str:
    """Create bucket ``name`` (SeaweedFS makes a bucket on its first object) and return its URL."""
    url = BucketURL(name)
    obstore.put(open_store(url), ".keep", b"")
    return f"s3://{name}"


def objects_under(url: str) -> dict[str, int]:
    u = BucketURL.parse(url)
    cut = len(u.prefix) + 1 if u.prefix else 0
    return {m["path"][cut:]: m["size"] for batch in obstore.list(open_store(u), u.prefix or None) for m in batch}


def test_drain_to_a_bucket_and_restore_from_it(s3_env, tmp_path):
    root = make_bucket("ckpt-roundtrip") + "/run1"
    fast = str(tmp_path / "fast")
    with fc.Checkpointer([fast, root], keep=[1, 2], bucket_options=SMALL_PARTS) as ck:
        for s in (1, 2, 3):
            h = ck.save(state(s), s * 10, extra_state={"epoch": s, "order": (s, "x")})
            h.wait()
        ck.wait()
        assert store.committed_steps(fast) == [30]
        assert ck.steps() == [20, 30]  # the bucket keeps 2: step 10 was superseded and deleted
        old = ck.load(20)  # only the bucket still holds it
        assert old.tier == 1 and old.path.startswith(root) and old.extra_state == {"epoch": 2, "order": (2, "x")}
        assert_state_equal(old.state_dict, state(2))
    names = objects_under(root)
    seqs = sorted(n.split("/")[0] for n in names)
    assert {n.split("/")[0] for n in names} == {commit_name(20, 1), commit_name(30, 2)}, seqs
    assert {n.split("/")[1] for n in names} == {"COMMIT", "index.json", "data-00000.bin"}
    # the local tier gone (a new node): restore from the bucket alone, in place into existing tensors
    into = {k: (torch.zeros_like(v) if not isinstance(v, dict) else {"h": torch.zeros_like(v["h"])})
            for k, v in state(0).items()}
    got = fc.load("latest", tiers=[str(tmp_path / "new-node"), root], into=into)
    assert got.step == 30 and got.tier == 1 and got.state_dict is into
    assert_state_equal(into, state(3))
    # the new node saves on: commit order continues from the bucket's, so its save is the latest
    with fc.Checkpointer([tmp_path / "new-node", root], keep=[1, 2]) as ck:
        assert ck.resumed == []
        ck.save(state(4), 5).wait()
    assert {n.split("/")[0] for n in objects_under(root)} == {commit_name(30, 2), commit_name(5, 3)}
    assert fc.latest_step(tiers=[str(tmp_path / "third-node"), root]) == 5


def test_bucket_tier_uploads_in_parts_and_commits_last(s3_env, tmp_path):
    root = make_bucket("ckpt-parts") + "/p"
    fast = str(tmp_path / "fast")
    with fc.Checkpointer(fast) as ck:
        ck.save(state(4), 4).wait()
    src = store.step_dir(fast, 4)
    order: list[str] = []
    with BucketTier(root, **SMALL_PARTS) as tier:
        put = tier.objects.put

        def recording_put(name, data):
            ref = put(name, data)
            order.append(name.split("/")[1])
            return ref

        tier.objects.put = recording_put
        tier.upload(src, 4)
        assert order[-1] == "COMMIT" and sorted(order[:-1]) == ["data-00000.bin", "index.json"]
        [c] = tier.commits()
        assert c.step == 4 and c.error is None
        # the data object was a multipart upload: its ETag says so ("<md5>-<parts>")
        data = tier.objects.head(f"{commit_name(4, c.seq)}/data-00000.bin")
        assert data.etag is not None and data.etag.strip('"').endswith("-3"), data.etag
        sizes = {n: r.size for n, r in tier.objects.list(commit_name(4, c.seq)).items()}
        stats = tier.objects.fetcher.stats
        before = (stats.requests, stats.bytes)
        tensors, index = tier.read_checkpoint(c)
        # the index, then the data object's bytes in GETs of up to 16 MiB (one here): nothing fetched twice
        assert stats.requests - before[0] == 2
        assert stats.bytes - before[1] == sizes[f"{commit_name(4, c.seq)}/index.json"] + sizes[
            f"{commit_name(4, c.seq)}/data-00000.bin"]
        assert torch.equal(tensors[index["tensors"]["name"].index("w")], state(4)["w"])


def test_rollback_resave_keeps_the_superseded_commit_until_retention(s3_env, tmp_path):
    root = make_bucket("ckpt-rollback") + "/r"
    with fc.Checkpointer([tmp_path / "fast", root], keep=[1, 2]) as ck:
        ck.save(state(1), 10).wait()
        ck.save(state(2), 20).wait()
        ck.save(state(3), 10).wait()  # rollback: step 10 again, the newest commit now
        ck.wait()
        got = fc.load("latest", tiers=[str(tmp_path / "elsewhere"), root])
        assert got.step == 10 and torch.equal(got.state_dict["w"], state(3)["w"])
        assert fc.load(20, tiers=[str(tmp_path / "elsewhere"), root]).step == 20  # keep=2: 20 stays
    assert {n.split("/")[0] for n in objects_under(root)} == {commit_name(20, 1), commit_name(10, 2)}


class KillingReader:
    """A data file whose reader kills the server once, when more than ``after`` bytes of it were read: the
    multipart upload that reads it loses its server between parts."""

    def __init__(self, path: str, after: int, kill) -> None:
        self.f = open(path, "rb")
        self.after, self.kill, self.read_bytes = after, kill, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.read_bytes += len(data)
        if self.read_bytes > self.after and self.kill is not None:
            kill, self.kill = self.kill, None
            kill()
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.f.close()


def kill_mid_data_upload(tier: BucketTier, kill, step: int):
    """Patch ``tier`` so that the upload of ``step``'s data object kills the server after its first part; returns
    the readers made (to close)."""
    put = tier.objects.put
    readers: list[KillingReader] = []

    def put_killing(name, data):
        if name.startswith(store.step_name(step)) and name.endswith("data-00000.bin") and not readers:
            readers.append(KillingReader(data, SMALL_PARTS["part_bytes"] + 1, kill))
            return put(name, readers[-1])
        return put(name, data)

    tier.objects.put = put_killing
    return readers


def test_server_killed_mid_upload_leaves_the_previous_commit_and_a_restart_resumes(s3_env, tmp_path):
    root = make_bucket("ckpt-killed") + "/k"
    fast = str(tmp_path / "fast")
    ck = fc.Checkpointer([fast, root], bucket_options={**QUICK, **SMALL_PARTS})
    ck.save(state(1), 10).wait()
    tier = ck._buckets[root]
    readers = kill_mid_data_upload(tier, s3_env.stop, 20)  # SIGKILL between the data object's parts
    h = ck.save(state(2), 20)
    with pytest.raises(CheckpointError) as e:
        h.wait()
    text = str(e.value)
    assert "drain failed" in text and "\n" not in text and s3_env.secret_key not in text
    assert store.committed_steps(fast) == [10, 20]  # the local commit stands
    assert readers and readers[0].kill is None  # the kill came mid-upload
    readers[0].close()
    ck.close()
    s3_env.start()
    names = objects_under(root)
    assert f"{commit_name(20, 1)}/COMMIT" not in names  # no marker: step 20 is not a commit in the bucket
    # a freshly restarted SeaweedFS answers 500 for a few seconds (its volumes register late): retried patiently
    got = fc.load("latest", tiers=[str(tmp_path / "other-node"), root], bucket_options=PATIENT)
    assert got.step == 10 and torch.equal(got.state_dict["w"], state(1)["w"])  # the previous commit
    # a new Checkpointer on the same tiers finds step 20 undrained and uploads it again, COMMIT last
    with fc.Checkpointer([fast, root], bucket_options={**PATIENT, **SMALL_PARTS}) as ck2:
        [resumed] = ck2.resumed
        resumed.wait()
        assert resumed.step == 20
    got = fc.load("latest", tiers=[str(tmp_path / "other-node"), root], bucket_options=PATIENT)
    assert got.step == 20 and got.tier == 1
    assert_state_equal(got.state_dict, state(2))


def test_server_killed_mid_upload_is_retried_until_it_is_back(s3_env, tmp_path, caplog):
    root = make_bucket("ckpt-retry") + "/k"
    with fc.Checkpointer([tmp_path / "fast", root], bucket_options={**PATIENT, **SMALL_PARTS}) as ck:
        tier = ck._buckets[root]
        killed = threading.Event()
        readers = kill_mid_data_upload(tier, lambda: (s3_env.stop(), killed.set()), 50)

        def restart_once_a_request_failed():
            assert killed.wait(120)  # stop() has returned: start() never races it
            for _ in range(600):
                if tier.objects.fetcher.stats.retries:
                    break
                threading.Event().wait(0.1)
            s3_env.start()

        with caplog.at_level(logging.WARNING, logger="foresight.bucket"):
            h = ck.save(state(5), 50)
            h.wait(durable=False)
            restarter = threading.Thread(target=restart_once_a_request_failed)
            restarter.start()
            h.wait()  # retried with backoff until the server was back
            restarter.join()
        assert readers[0].kill is None and tier.objects.fetcher.stats.retries >= 1
        assert readers[0].read_bytes > 12 << 20  # read more than once: the object was sent again from its start
        readers[0].close()
        assert any("retry" in r.getMessage() for r in caplog.records)
    got = fc.load("latest", tiers=[str(tmp_path / "other-node"), root], bucket_options=PATIENT)
    assert got.step == 50
    assert_state_equal(got.state_dict, state(5))


def test_a_torn_object_set_is_never_restored_as_committed(s3_env, tmp_path):
    root = make_bucket("ckpt-torn") + "/t"
    with fc.Checkpointer([tmp_path / "fast", root]) as ck:
        ck.save(state(1), 10).wait()
        ck.save(state(2), 20).wait()
    elsewhere = [str(tmp_path / "other-node"), root]
    url = BucketURL.parse(root)
    s3 = open_store(url)
    newest = commit_name(20, 1)
    # an upload cut short by a crash, newer than every commit: data and index, no COMMIT
    with BucketTier(root) as tier:
        src = store.step_dir(str(tmp_path / "fast"), 20)
        for name in ("data-00000.bin", "index.json"):
            with open(f"{src}/{name}", "rb") as f:
                obstore.put(s3, url.key(f"{commit_name(30, 9)}/{name}"), f.read())
        assert [c.step for c in tier.commits()] == [10, 20]
    assert fc.load("latest", tiers=elsewhere).step == 20
    # the newest commit's data object replaced behind its COMMIT (same size, other bytes): a torn set
    data_key = url.key(f"{newest}/data-00000.bin")
    raw = bytearray(obstore.get(s3, data_key).bytes())
    raw[100] ^= 0xFF
    obstore.put(s3, data_key, bytes(raw))
    with pytest.warns(RuntimeWarning, match="torn object set"):
        got = fc.load("latest", tiers=elsewhere)
    assert got.step == 10 and torch.equal(got.state_dict["w"], state(1)["w"])
    with pytest.raises(CheckpointError, match="torn object set") as e:
        fc.load(20, tiers=elsewhere)
    assert newest in str(e.value)
    # and one deleted: missing, named
    obstore.delete(s3, data_key)
    with pytest.raises(CheckpointError, match="data-00000.bin is missing"):
        fc.load(20, tiers=elsewhere)
    # retention never counts the torn set as the newest commit, nor deletes the last good one
    with BucketTier(root) as tier:
        assert tier.retain(1) == []
        assert [c.step for c in tier.commits() if c.error is None] == [10]


def test_missing_bucket_and_wrong_keys_fail_in_one_line_without_secrets(s3_env, tmp_path, monkeypatch):
    root = make_bucket("ckpt-keys") + "/x"
    fast = tmp_path / "fast"
    with pytest.raises(BucketError) as e:
        fc.Checkpointer([fast, "s3://no-bucket-of-ours/ckpt"], bucket_options=QUICK)
    text = str(e.value)
    assert "bucket not found" in text and "no-bucket-of-ours" in text and "\n" not in text
    assert s3_env.secret_key not in text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-right-secret-42")
    for attempt in (lambda: fc.Checkpointer([fast, root], bucket_options=QUICK),
                    lambda: fc.load("latest", tiers=[fast, root], bucket_options=QUICK)):
        with pytest.raises(BucketError) as e:
            attempt()
        text = str(e.value)
        assert e.value.reason == "denied" and "access denied" in text and "\n" not in text
        assert "not-the-right-secret-42" not in text and s3_env.secret_key not in text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    with fc.Checkpointer([fast, root]) as ck:  # the failed constructors released the local root's lock
        ck.save(state(1), 1).wait()
    with pytest.raises(ValueError, match="must be a local directory"):
        fc.Checkpointer([root, fast])


def dcp_state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(3 << 20, generator=g), "bf": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "ids": torch.arange(1000, dtype=torch.int64), "flag": torch.tensor([True, False, True]),
            "c": torch.randn(5, dtype=torch.complex128, generator=g), "meta": {"epoch": 3, "name": "run"},
            **{f"s{i}": torch.full((i + 1,), float(i)) for i in range(50)}}


def zeros_like_state(state: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0, "name": ""})
            for k, v in state.items()}


def test_dcp_save_and_load_through_a_bucket(s3_env, monkeypatch):
    path = make_bucket("dcp-roundtrip") + "/step-100"
    order: list[str] = []
    put = BucketPrefix.put

    def recording_put(self, name, data):
        ref = put(self, name, data)
        order.append(name)
        return ref

    monkeypatch.setattr(BucketPrefix, "put", recording_put)
    state = dcp_state()
    writer = ForesightStorageWriter(path, bucket_options=SMALL_PARTS)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.close()
    assert order == ["__0_data.bin", ".metadata"]  # the metadata last, after the data object is checked
    with BucketPrefix(path) as objects:
        etag = objects.head("__0_data.bin").etag
    assert etag.strip('"').endswith("-3"), etag  # 12 MiB in 5 MiB parts: a multipart upload
    target = zeros_like_state(state)
    reader = ForesightStorageReader(path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert target[k].dtype == v.dtype and torch.equal(target[k], v), k
        else:
            assert target[k] == v
    # a subset (the small tensors only) is fetched without the 12 MiB tensor's bytes
    before = reader._objects().fetcher.stats.bytes
    small = {f"s{i}": torch.zeros(i + 1) for i in range(50)}
    dcp.load(small, storage_reader=reader, no_dist=True)
    assert all(torch.equal(small[f"s{i}"], state[f"s{i}"]) for i in range(50))
    assert reader._objects().fetcher.stats.bytes - before < 1 << 20
    reader.close()


def test_dcp_in_a_bucket_incomplete_or_changed_is_refused(s3_env):
    path = make_bucket("dcp-faults") + "/step-1"
    url = BucketURL.parse(path)
    s3 = open_store(url)
    state = {"w": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(3)}
    writer = ForesightStorageWriter(path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.close()
    # the data object replaced after the save: refused by its recorded ETag, never read
    data_key = url.key("__0_data.bin")
    raw = bytearray(obstore.get(s3, data_key).bytes())
    raw[10] ^= 0xFF
    obstore.put(s3, data_key, bytes(raw))
    with pytest.raises((CheckpointError, CheckpointException), match="changed since it was written"):
        dcp.load({"w": torch.zeros(10_000), "b": torch.zeros(3)}, storage_reader=ForesightStorageReader(path),
                 no_dist=True)
    # no metadata (a save cut short before its last object): incomplete, one line naming it
    obstore.delete(s3, url.key(".metadata"))
    with pytest.raises((CheckpointError, CheckpointException), match="no DCP metadata") as e:
        dcp.load({"w": torch.zeros(10_000)}, storage_reader=ForesightStorageReader(path), no_dist=True)
    assert f"{path}/.metadata" in str(e.value) and s3_env.secret_key not in str(e.value)


def test_dcp_drain_to_a_bucket_uploads_the_metadata_last(s3_env, tmp_path, monkeypatch):
    durable = make_bucket("dcp-drain") + "/durable"
    order: list[str] = []
    put = BucketPrefix.put
    monkeypatch.setattr(BucketPrefix, "put", lambda self, name, data: (order.append(name), put(self, name, data))[1])
    state = dcp_state()
    writer = ForesightStorageWriter(tmp_path / "step-7", drain_to=durable)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.wait_drain()
    assert order == ["__0_data.bin", ".metadata"]
    target = zeros_like_state(state)
    dcp.load(target, storage_reader=ForesightStorageReader(f"{durable}/step-7"), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["c"], state["c"])


def full_weight() -> torch.Tensor:
    return torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


def _two_rank_worker(rank: int, root: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (2,))
        state = {"w": distribute_tensor(full_weight(), mesh, [Shard(0)]), "bias": torch.arange(5)}
        writer = ForesightStorageWriter(path)
        dcp.save(state, storage_writer=writer)
        writer.close()
        # reshard on load: saved row-sharded, loaded column-sharded, every rank fetching what it needs
        target = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]), "bias": torch.zeros(5, dtype=torch.int64)}
        reader = ForesightStorageReader(path)
        dcp.load(target, storage_reader=reader)
        reader.close()
        assert torch.equal(target["w"].full_tensor(), full_weight()) and torch.equal(target["bias"], torch.arange(5))
        open(os.path.join(root, f"rank{rank}.ok"), "w").close()
    except BaseException:
        with open(os.path.join(root, f"rank{rank}.failed"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        end_process_groups(barrier=False)


def test_dcp_two_gloo_ranks_save_to_and_reshard_from_a_bucket(s3_env, tmp_path):
    path = make_bucket("dcp-ranks") + "/step-5"
    tmp_mp.spawn(_two_rank_worker, args=(str(tmp_path), path), nprocs=2, join=True)
    failures = [open(tmp_path / f).read() for f in sorted(os.listdir(tmp_path)) if f.endswith(".failed")]
    assert not failures, "\n".join(failures)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".ok")) == ["rank0.ok", "rank1.ok"]
    assert sorted(objects_under(path)) == [".metadata", "__0_data.bin", "__1_data.bin"]
    target = {"w": torch.zeros(64, 48)}  # 2 -> 1: one process loads the whole tensor
    dcp.load(target, storage_reader=ForesightStorageReader(path), no_dist=True)
    assert torch.equal(target["w"], full_weight())


def test_a_replicated_dcp_checkpoint_is_refused_in_a_bucket():
    from foresight.replication.policy import ReplicatingStorageWriter

    with pytest.raises(ValueError, match="give the bucket as drain_to"):
        ReplicatingStorageWriter("s3://ckpt/run/step-1", replicate=None, step=1)
