"""A process of the host that stops while it holds one of a shared bucket cache's locks (a job suspended with
SIGSTOP, a process stuck on a bad disk) never stalls the others for ever: the layout lock, a sample's fetch lock and
a sample's eviction lock are each waited for at most ``lock_wait_s`` without progress, then a ``BucketError``
(``lock_timeout``) names the lock file and what was waited for. Real processes against a real SeaweedFS; the
stopped child is always continued and killed."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
from typing import Iterator

import numpy as np
import pytest

from foresight import open_dataset
from foresight.bucket.cache import INDEX_DIR
from foresight.bucket.upload import upload_dataset
from foresight.errors import BucketError
from foresight.format import DatasetWriter
from foresight.testing.http_faults import Fault, FaultProxy
from seaweed_helpers import s3_env, seaweed  # noqa: F401  (fixtures)

SMALL_WAIT_S = 0.5  # the bound under test (a stopped holder makes no progress, so any bound ends the wait)
POLLS = 6000  # of 10 ms: how long the child may take to reach the lock (a loaded machine), never the bound


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    rng = np.random.default_rng(17)
    path = tmp_path_factory.mktemp("lockwait") / "d"
    with DatasetWriter(str(path), align=4096, shard_bytes=100_000) as w:
        for _ in range(64):
            w.add(rng.integers(0, 256, size=int(rng.integers(500, 5000)), dtype=np.uint8).tobytes(), modality="bytes")
    return open_dataset(str(path))


@contextlib.contextmanager
def _child(code: str, *args: str, env: dict) -> Iterator[subprocess.Popen]:
    """A Python child running ``code``; whatever happens, continued (it may be stopped) and killed at the end."""
    child = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.communicate()


def _until_held(child: subprocess.Popen, path: str, try_lock) -> None:
    """Poll until ``child`` holds a lock on ``path`` that ``try_lock(fd)`` (non-blocking) cannot take."""
    for _ in range(POLLS):
        assert child.poll() is None, child.communicate()
        if os.path.exists(path):
            fd = os.open(path, os.O_RDWR)
            try:
                try_lock(fd)
            except OSError:
                return
            finally:
                os.close(fd)  # drops whatever this process got (flock and POSIX locks alike)
        threading.Event().wait(0.01)
    raise AssertionError(f"the child never took the lock on {path}")


def _stop(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGSTOP)


OPEN = """
import os
from foresight import open_dataset
open_dataset(os.environ["URL"], cache_dir=os.environ["CACHE"])
"""


def test_an_open_behind_a_stopped_layout_names_the_layout_lock(s3_env, tmp_path, local, monkeypatch):
    """A child laying the copy out (its manifest GET held back by a proxy) is stopped while it holds the layout
    lock: another open raises ``lock_timeout`` naming the lock file (before: it waited on flock for ever)."""
    url = "s3://lockwait/layout"
    upload_dataset(local.path, url)
    cache = str(tmp_path / "cache")
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"]),
                    [Fault(status=0, path=r"manifest\.json", delay_s=30.0, times=1)]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # the same endpoint: the same cache place
        with _child(OPEN, env=dict(os.environ, URL=url, CACHE=cache)) as child:
            lock = None
            for _ in range(POLLS):  # the cache place depends on the endpoint: find the child's lock file
                found = [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names if n == "lock"]
                if found:
                    lock = found[0]
                    break
                assert child.poll() is None, child.communicate()
                threading.Event().wait(0.01)
            assert lock is not None
            _until_held(child, lock, lambda fd: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))
            _stop(child)
            with pytest.raises(BucketError) as e:
                open_dataset(url, cache_dir=cache, lock_wait_s=SMALL_WAIT_S)
            assert e.value.reason == "lock_timeout"
            assert lock in str(e.value) and "layout" in str(e.value)
            assert f"pid {child.pid}" in str(e.value)  # the holder, for the operator


FETCH = """
import os, sys
import numpy as np
from foresight import open_dataset
ds = open_dataset(os.environ["URL"], cache_dir=os.environ["CACHE"], concurrency=1, max_gap=0)
ds.lookup(np.array([int(a) for a in sys.argv[1:]], dtype=np.int64))
"""


@contextlib.contextmanager
def _stopped_fetcher(s3_env, tmp_path, local, monkeypatch, url: str, ids: np.ndarray):
    """A child fetching ``ids`` (its first GET held back by a proxy) stopped while it holds their locks; yields
    ``(cache, index path, child)``."""
    upload_dataset(local.path, url)
    cache = str(tmp_path / "cache")
    bucket = url.split("/")[2]
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"]),
                    [Fault(status=0, path=rf"^/{bucket}/.*\.bin", delay_s=30.0, times=1)]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with open_dataset(url, cache_dir=cache) as ds:
            index = os.path.join(ds.cache.local_dir, INDEX_DIR, "present")
        with _child(FETCH, *map(str, ids.tolist()), env=dict(os.environ, URL=url, CACHE=cache)) as child:
            _until_held(child, index, lambda fd: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(ids[0]),
                                                             os.SEEK_SET))
            _stop(child)
            yield cache, index, child


def test_a_lookup_behind_a_stopped_fetch_names_the_sample_lock(s3_env, tmp_path, local, monkeypatch):
    """A lookup of samples whose fetch lock a stopped process holds raises ``lock_timeout`` naming the index file
    and the samples (before: lockf waited for ever); once the holder is gone, the same lookup fetches them."""
    ids = np.array([3, 4, 5], dtype=np.int64)
    with _stopped_fetcher(s3_env, tmp_path, local, monkeypatch, "s3://lockwait/fetch", ids) as (cache, index, child):
        with open_dataset("s3://lockwait/fetch", cache_dir=cache, lock_wait_s=SMALL_WAIT_S) as ds:
            with pytest.raises(BucketError) as e:
                ds.lookup(ids)
            assert e.value.reason == "lock_timeout"
            assert index in str(e.value) and "samples 3-5" in str(e.value)
            assert f"pid {child.pid}" in str(e.value)
            os.kill(child.pid, signal.SIGKILL)  # its locks go with it
            child.wait()
            ds.lookup(ids)
            assert ds.cache.present[ids].all()


def test_a_claimed_lookup_behind_a_stopped_fetch_is_bounded_too(s3_env, tmp_path, local, monkeypatch):
    """The claim's owner (a prefetcher's fetch) waits on a stopped process's locks and gives up with
    ``lock_timeout``; the lookup waiting on its claim gives up too (no GET lands anywhere), never a hang."""
    ids = np.array([10, 11], dtype=np.int64)
    with _stopped_fetcher(s3_env, tmp_path, local, monkeypatch, "s3://lockwait/claim", ids) as (cache, index, _):
        with open_dataset("s3://lockwait/claim", cache_dir=cache, lock_wait_s=SMALL_WAIT_S) as ds:
            claim = ds.cache.claim(lambda: None, wait_s=SMALL_WAIT_S)
            claim.set(ids)
            owned: dict = {}

            def own() -> None:
                try:
                    ds.cache.ensure(ids, claim=claim)
                except BucketError as err:
                    owned["error"] = err
                finally:
                    claim.release()  # as the prefetcher does when its fetch fails

            owner = threading.Thread(target=own)
            owner.start()
            try:
                with pytest.raises(BucketError):  # its claim's wait, or the locks once the claim is released
                    ds.lookup(ids)
            finally:
                owner.join()
            assert owned["error"].reason == "lock_timeout" and index in str(owned["error"])


EVICTOR = """
import os, sys
import numpy as np
from foresight.bucket.pins import claim_unpinned, open_pin_file
fd = open_pin_file(sys.argv[1])
with claim_unpinned(fd, np.array([int(a) for a in sys.argv[2:]], dtype=np.int64)) as free:
    print(len(free), flush=True)
    sys.stdin.read()
"""


def test_pinning_behind_a_stopped_evictor_names_the_pin_file(s3_env, tmp_path, local):
    """A reader pinning samples an evictor holds (stopped before it let them go) raises ``lock_timeout`` naming
    the pin file (before: F_OFD_SETLKW waited for ever)."""
    url = "s3://lockwait/pins"
    upload_dataset(local.path, url)
    with open_dataset(url, cache_dir=tmp_path / "cache", lock_wait_s=SMALL_WAIT_S) as ds:
        index_dir = os.path.join(ds.cache.local_dir, INDEX_DIR)
        with _child(EVICTOR, index_dir, "7", "8", env=dict(os.environ)) as child:
            assert child.stdout.readline().strip() == "2", child.stderr.read()
            _stop(child)
            pins = ds.cache.pins()
            try:
                with pytest.raises(BucketError) as e:
                    pins.hold(np.array([6, 7, 8]))
                assert e.value.reason == "lock_timeout"
                assert os.path.join(index_dir, "pins") in str(e.value) and "samples 6-8" in str(e.value)
                assert pins.ids.size == 0  # nothing half-pinned is claimed as held
            finally:
                pins.close()


def test_lock_wait_s_must_be_positive(s3_env, tmp_path, local):
    url = "s3://lockwait/option"
    upload_dataset(local.path, url)
    with pytest.raises(ValueError, match="lock_wait_s"):
        open_dataset(url, cache_dir=tmp_path / "cache", lock_wait_s=0)


def test_a_lookup_waits_past_lock_wait_s_while_the_holder_makes_progress(s3_env, tmp_path, local, monkeypatch):
    """A holder whose fetch takes longer than ``lock_wait_s`` in all, but marks a sample every GET (a GET at a
    time, each held back by a proxy for a fraction of the bound), is waited for to the end: the lookup then finds
    every sample present and fetches none (progress, not the total wait, is what is bounded)."""
    url = "s3://lockwait/progress"
    upload_dataset(local.path, url)
    cache = str(tmp_path / "cache")
    ids = np.arange(0, 48, 4, dtype=np.int64)  # 12 GETs at max_gap 0, concurrency 1: 12 x 0.5 s, > 2.5 s in all
    with FaultProxy(("127.0.0.1", s3_env.ports["s3.port"]),
                    [Fault(status=0, path=r"^/lockwait/.*\.bin", delay_s=0.5)]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with open_dataset(url, cache_dir=cache, lock_wait_s=2.5) as ds:
            index = os.path.join(ds.cache.local_dir, INDEX_DIR, "present")
            with _child(FETCH, *map(str, ids.tolist()), env=dict(os.environ, URL=url, CACHE=cache)) as child:
                _until_held(child, index, lambda fd: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(ids[0]),
                                                                 os.SEEK_SET))
                ds.lookup(ids)
                assert ds.cache.present[ids].all() and ds.cache.stats.misses == 0
                assert child.wait() == 0
