"""Hostile and malformed calls to a replication site (a real node process on loopback): each is refused at once with
a clear error naming the field or file, the node goes on serving, and a stream dropped unread holds nothing."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
from pyarrow import flight

from foresight.replication.service import ReplicationService
from foresight.replication.source import WIRE_CHUNK, RemoteSource

from replication_helpers import Site, write_checkpoint_phases

CALL_S = 60  # a bound for a hung call; every refusal here comes back at once


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile") / "train")
    s = Site("train-a", root, routes={"eval-b": "grpc://127.0.0.1:1"})
    try:
        yield s
    finally:
        s.stop()


def _action(site, action, body):
    client = flight.connect(site.url)
    try:
        res = list(client.do_action(flight.Action(action, json.dumps(body).encode()),
                                    flight.FlightCallOptions(timeout=CALL_S)))
    finally:
        client.close()
    return json.loads(res[0].body.to_pybytes()) if res else {}


def test_declared_sizes_past_the_unit_bound_are_refused_at_once_and_the_node_serves_on(site):
    """A writer declaring a 2**60-byte file (or a 64 GiB one in 4 KiB units) made the node cut it into units in a
    loop that never ended, growing a list in memory, on a thread the caller had long given up on."""
    tmp = next(write_checkpoint_phases(os.path.join(site.root, "big"), 1, 10_000))
    for name, files, unit_bytes in (("big/s1", [["data-00000.bin", 1 << 60]], None),
                                    ("big/s2", [["data-00000.bin", 1 << 36]], 4096)):
        body = {"name": name, "src": tmp, "site": "eval-b", "files": files, "written": {}}
        if unit_bytes:
            body["unit_bytes"] = unit_bytes
        with pytest.raises(flight.FlightServerError, match=r"more than \d+ units.*file=data-00000.bin"):
            _action(site, "replicate.start", body)
    with pytest.raises(flight.FlightServerError, match="size must be an integer >= 0.*file=data-00000.bin"):
        _action(site, "replicate.start", {"name": "big/s3", "src": tmp, "site": "eval-b",
                                          "files": [["data-00000.bin", -5]]})
    assert _action(site, "replication.ping", {}) == {"site": "train-a"}


@pytest.mark.parametrize("action, body, field", [
    ("replicate.start", {"name": "t/s", "src": "/", "site": 5}, "site"),
    ("replicate.start", {"name": "t/s", "src": "/", "site": "../x"}, "site"),
    ("replicate.start", {"name": "t/s", "src": "/", "site": "eval-b", "priority": "nan"}, "priority"),
    ("replicate.start", {"name": "t/s", "src": "/", "site": "eval-b", "unit_bytes": 100}, "unit_bytes"),
    ("replicate.start", {"name": "t/s", "src": ["/"], "site": "eval-b"}, "src"),
    ("replicate.urgent", {"name": "t/s", "priority": "inf"}, "priority"),
    ("replicate.urgent", {"name": "t/s", "priority": -1}, "priority"),
    ("replicate.wait", {"name": "t/s", "timeout": 1e300}, "timeout"),
    ("replicate.wait", {"name": "t/s", "timeout": "soon"}, "timeout"),
    ("replicate.resume", {"units": -3}, "units"),
    ("replicate.resume", {"units": 2.5}, "units"),
    ("replicate.commit", {"name": "t/s", "path": 7}, "path"),
])
def test_replication_fields_of_a_wrong_type_or_range_are_refused_by_name(site, action, body, field):
    """These were accepted and failed later on a sending thread (site 5: 'no route'), or not at all (a NaN
    priority breaks the lane's order; a negative unit budget lifts the pause)."""
    with pytest.raises(flight.FlightServerError, match=f"{field} must be"):
        _action(site, action, body)


def test_ckpt_file_streams_a_large_file_in_wire_chunks(site):
    """``ckpt.file`` read the whole file into one buffer (a data file of many GiB on a request; past 2 GiB the
    one-row batch's int32 offsets overflow); it streams it in wire chunks, byte for byte."""
    phases = write_checkpoint_phases(os.path.join(site.root, "wide"), 1, 2 * WIRE_CHUNK + 12_345)
    next(phases)
    final = next(phases)
    name = "wide/" + os.path.basename(final)
    client = flight.connect(site.url)
    ticket = {"kind": "ckpt.file", "name": name, "file": "data-00000.bin"}
    batches = list(client.do_get(flight.Ticket(json.dumps(ticket).encode())))
    client.close()
    assert len(batches) == 3
    with open(os.path.join(final, "data-00000.bin"), "rb") as f:
        want = f.read()
    src = RemoteSource(site.url, name)
    assert src.read_file("data-00000.bin") == want
    src.close()


def test_a_symlink_in_a_checkpoint_directory_serves_nothing_from_outside_the_root(site, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not for the wire")
    phases = write_checkpoint_phases(os.path.join(site.root, "link"), 1, 10_000)
    next(phases)
    final = next(phases)
    os.symlink(outside, os.path.join(final, "leak.bin"))
    src = RemoteSource(site.url, "link/" + os.path.basename(final))
    with pytest.raises(Exception, match="outside this node's root"):
        src.read_file("leak.bin")
    with pytest.raises(Exception, match="outside this node's root"):
        src.read_extents(["leak.bin"], np.zeros(1, np.int32), np.array([0]), np.array([4]))
    src.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_ckpt_read_stream_dropped_unread_closes_its_file(tmp_path):
    """Flight drops a DoGet's stream without starting it when the client is gone before the schema is written;
    the file the handler had opened stayed open (a generator's ``finally`` never runs unstarted)."""
    svc = ReplicationService("eval-b", str(tmp_path / "root"), unit_bytes=64 << 10, streams=1)
    try:
        phases = write_checkpoint_phases(os.path.join(svc.root, "drop"), 1, 100_000)
        next(phases)
        name = "drop/" + os.path.basename(next(phases))
        before = _open_fds()
        for kind, extra in (("ckpt.read", {"ranges": [[0, 1000], [5000, 100]]}), ("ckpt.file", {})):
            for _ in range(5):
                stream = svc.do_get({"kind": kind, "name": name, "file": "data-00000.bin", **extra})
                del stream  # dropped unread
        assert _open_fds() - before == set()
    finally:
        svc.close()


class _Caller:
    """The Flight call context a handler sees (its auth middleware: the job header and token)."""

    def __init__(self, job: str, token: str) -> None:
        self._mw = type("Auth", (), {"job": job, "token": token})()

    def get_middleware(self, name):
        return self._mw if name == "auth" else None


@pytest.fixture
def manager(tmp_path, root_dir):
    from foresight.cluster.membership import Cluster
    from foresight.node.server import NodeServer
    from foresight.replication.replica_manager import ReplicaManager
    from foresight.testing.etcd import EtcdProcess

    with EtcdProcess(str(tmp_path / "etcd")) as etcd, NodeServer(str(tmp_path / "root")) as server:
        m = ReplicaManager(server, Cluster(etcd.endpoint))
        try:
            yield m
        finally:
            m.close()


@pytest.fixture
def root_dir(tmp_path):
    os.makedirs(tmp_path / "root")
    return tmp_path / "root"


def test_a_ckpt_get_dropped_unread_closes_its_file_and_lets_the_copy_go(root_dir, manager, tmp_path):
    """A ``ckpt.get`` stream dropped before its first batch kept the file open and the copy referenced for ever:
    the node advertised a read in flight that never ended, and a reclaimed copy was never deleted."""
    ckpt = root_dir / "job1" / "step-1"
    ckpt.mkdir(parents=True)
    (ckpt / "shard.bin").write_bytes(os.urandom(3 << 20))
    caller = _Caller("job1", "token-123456")
    manager._publish(caller, {"job": "job1", "checkpoint": "job1/step-1"})
    before = _open_fds()
    for _ in range(5):
        stream = manager._get(caller, {"kind": "ckpt.get", "job": "job1", "checkpoint": "job1/step-1",
                                       "file": "shard.bin"})
        del stream  # the client was gone before the schema went out: Flight never starts the stream
    assert _open_fds() - before == set()
    assert manager.inflight == 0 and manager._copies[("job1/step-1", "shard.bin")].refs == 0


def test_publishing_a_file_that_resolves_outside_the_root_is_refused(root_dir, manager, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not for the cluster")
    ckpt = root_dir / "job2" / "step-1"
    ckpt.mkdir(parents=True)
    (ckpt / "ok.bin").write_bytes(b"fine")
    os.symlink(secret, ckpt / "leak.bin")
    with pytest.raises(Exception, match="outside the node's root.*leak.bin"):
        manager._publish(_Caller("job2", "token-123456"), {"job": "job2", "checkpoint": "job2/step-1"})
    assert ("job2/step-1", "leak.bin") not in manager._copies


def test_status_queries_and_refused_commits_leave_no_directories(site):
    """``replica.status`` of a name the site never received, and a commit refused for missing units, each made the
    name's hidden temp directory (and its job directory): any caller could litter the root without bound."""
    from foresight.replication.flight_calls import put_body

    for i in range(5):
        assert _action(site, "replica.status", {"name": f"ghost/step-{i}"}) == {"units": [], "extents": []}
    client = flight.connect(site.url)
    with pytest.raises(flight.FlightServerError, match="units missing"):
        put_body(client, "replica.commit", {"name": "ghost2/step-1", "units": 3, "files": [["COMMIT", 2]]}, b"ok")
    client.close()
    assert not {"ghost", "ghost2"} & set(os.listdir(site.root))


def _unit_put(site, header: bytes):
    from foresight.replication.flight_calls import SCHEMA, binary_batch

    client = flight.connect(site.url)
    try:
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("replica.units", json.dumps({"name": "h/s"})),
                                       SCHEMA)
        writer.write_with_metadata(binary_batch(memoryview(b"abc")), pa.py_buffer(header))
        writer.done_writing()
        reader.read()
        writer.close()
    finally:
        client.close()


def _layout_put(site, body: bytes):
    from foresight.replication.flight_calls import put_body

    client = flight.connect(site.url)
    try:
        put_body(client, "replica.layout", {"name": "h/lay"}, body)
    finally:
        client.close()


def _get(site, ticket: dict):
    client = flight.connect(site.url)
    try:
        list(client.do_get(flight.Ticket(json.dumps(ticket).encode())))
    finally:
        client.close()


@pytest.mark.parametrize("send, arg, message", [
    (_get, {"kind": "ckpt.read", "name": 5, "file": "x", "ranges": [[0, 1]]}, "checkpoint name must be a string"),
    (_get, {"kind": "ckpt.list", "name": ["a"]}, "checkpoint name must be a string"),
    (_unit_put, b'{"id": 0, "file": "d.bin", "offset": 0, "length": 3, "file_size": 1e300, "xxh3": "00"}',
     "file_size must be an integer"),
    (_unit_put, b'{"id": 0, "file": "d.bin", "offset": 0, "length": 3, "file_size": 4611686018427387904, '
                b'"xxh3": "00"}', "file_size must be an integer"),
    (_unit_put, b'{"id": -1, "file": "d.bin", "offset": 0, "length": 3, "file_size": 3, "xxh3": "00"}',
     "id must be an integer"),
    (_unit_put, b'{"id": 0, "file": 7, "offset": 0, "length": 3, "file_size": 3, "xxh3": "00"}', "must be a string"),
    (_layout_put, b'{"rows": [], "merge": {"groups": 5}}', "merge groups must map"),
    (_layout_put, b'{"rows": [], "merge": {"reshard": "two"}}', "merge reshard must be an integer"),
    (_layout_put, b'{"rows": [], "meta": [1, 2]}', "replica.layout wants meta as an object"),
])
def test_hostile_replication_streams_are_refused_by_name_never_as_an_internal_error(site, send, arg, message):
    """Each of these was answered 'internal error (AttributeError/OverflowError)': a crash inside the handler, not
    a refusal naming what is wrong (a size of 1e300 reached posix_fallocate)."""
    with pytest.raises(flight.FlightServerError) as e:
        send(site, arg)
    assert message in str(e.value) and "internal error" not in str(e.value)
    assert "inside the node" not in site.log()


class _EndlessHolder(flight.FlightServerBase):
    """A holder that answers ``ckpt.get`` with far more bytes than the file has (broken or hostile)."""

    BATCHES = 1000

    def __init__(self) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.yielded = 0

    def do_get(self, context, ticket):
        from foresight.replication.flight_calls import SCHEMA, binary_batch

        def batches():
            block = memoryview(bytes(64 << 10))
            for _ in range(self.BATCHES):
                self.yielded += 1
                yield binary_batch(block)

        return flight.GeneratorStream(SCHEMA, batches())


def test_a_copy_pulled_from_a_holder_sending_too_much_stops_at_the_files_size(manager):
    """The pull wrote whatever the holder sent and compared sizes only at the end: a holder streaming without end
    filled the target's disk. It stops once the bytes pass the file's size, and the temp file is removed."""
    holder = _EndlessHolder()
    try:
        task = {"checkpoint": "job3/step-1", "file": "w.bin", "job": "job3", "grant": "g", "size": 1000,
                "xxh3": "0"}
        with pytest.raises(Exception, match="more bytes than the file has"):
            manager._pull(task, {"node": "evil", "location": f"grpc://127.0.0.1:{holder.port}"})
        assert holder.yielded < _EndlessHolder.BATCHES
        left = os.path.join(manager.root, ".replicas", "job3", "step-1")
        assert os.listdir(left) == []
    finally:
        holder.shutdown()


def _serve(root, *args, timeout=120):
    """``foresight node serve --site`` run to its end or its ready file: (exit code or None if serving, log)."""
    import subprocess
    import sys
    import time

    from foresight.testing.processes import stop_process

    ready = os.path.join(root, "ready.json")
    proc = subprocess.Popen([sys.executable, "-m", "foresight", "node", "serve", "--root", root, "--port", "0",
                             "--ready-file", ready, "--site", "train-a", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    code = proc.poll()
    if code is None:
        stop_process(proc, "site", grace=60)
    return code, proc.stdout.read().decode(errors="replace")


def test_replication_without_a_token_refuses_to_serve_on_a_non_loopback_address_unless_told_to(tmp_path):
    root = str(tmp_path / "root")
    os.makedirs(root)
    code, out = _serve(root, "--host", "0.0.0.0")
    assert code not in (None, 0) and "--replication-token" in out and "--replication-no-token" in out, out
    assert "Traceback" not in out
    assert _serve(root, "--host", "0.0.0.0", "--replication-token", "site-token-1")[0] is None
    assert _serve(root, "--host", "0.0.0.0", "--replication-no-token")[0] is None  # the operator's explicit choice
    assert _serve(root, "--host", "127.0.0.1")[0] is None  # loopback: only this host's callers


def test_a_wait_cap_that_is_not_a_positive_number_refuses_to_serve(tmp_path):
    """``--replication-max-wait-s 0`` (or negative, nan) answered every ``replicate.wait`` 'timed out' at once, so
    ``Replication.wait`` with no timeout asked again in a busy loop for ever: refused at start, one line naming it."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    for bad in ("0", "-5", "nan", "inf"):
        code, out = _serve(root, "--replication-max-wait-s", bad)
        assert code not in (None, 0) and "--replication-max-wait-s" in out and "Traceback" not in out, (bad, out)
    assert _serve(root, "--replication-max-wait-s", "0.5")[0] is None


def test_a_wait_is_capped_by_the_node_and_replication_wait_waits_on_over_capped_calls(tmp_path):
    """``replicate.wait`` with no timeout (or one past the node's cap) is answered 'timed out' at the cap (a caller
    cannot hold a server thread for ever); ``Replication.wait`` with no timeout waits on over capped calls."""
    import threading

    from foresight.replication.policy import Replication
    from replication_helpers import wait_until

    ev = Site("eval-b", str(tmp_path / "eval"))
    tr = Site("train-a", str(tmp_path / "train"), routes={"eval-b": ev.url}, max_wait_s=1)
    try:
        tr.call("replicate.pause")
        rep = Replication(every=1, site="eval-b", node=tr.url, job="job")
        phases = write_checkpoint_phases(os.path.join(tr.root, "job"), 1, 200_000)
        rep.data_written(1, next(phases))
        final = next(phases)
        rep.committed(1, final)
        name = "job/" + os.path.basename(final)
        for timeout in (None, 3600):
            with pytest.raises(flight.FlightServerError, match="timed out waiting for the replica.*at most 1"):
                tr.call("replicate.wait", {"name": name, "timeout": timeout})
        got = {}
        waiting = threading.Thread(target=lambda: got.update(rep.wait(1)))  # no timeout: capped calls, repeated
        waiting.start()
        wait_until(lambda: tr.call("replicate.log")["wait_capped"] >= 4, "the waiter to be capped again")
        tr.call("replicate.resume")
        waiting.join(120)
        assert got["path"] == os.path.join(ev.root, "job", os.path.basename(final))
        rep.close()
    finally:
        tr.stop()
        ev.stop()


def test_callers_that_give_up_a_wait_free_its_server_thread(site, tmp_path):
    """Waits whose callers' deadlines pass (their calls cancelled) end on the node too: no thread left waiting
    (the node's cap is far off here)."""
    from replication_helpers import wait_until

    src = next(write_checkpoint_phases(os.path.join(site.root, "job-w"), 1, 100_000))
    site.call("replicate.pause")
    try:
        site.call("replicate.start", {"name": "job-w/step-00000001", "src": src, "site": "eval-b"})
        for _ in range(4):
            client = flight.connect(site.url)
            with pytest.raises(flight.FlightTimedOutError):
                list(client.do_action(flight.Action("replicate.wait",
                                                    json.dumps({"name": "job-w/step-00000001"}).encode()),
                                      flight.FlightCallOptions(timeout=0.5)))
            client.close()
        wait_until(lambda: site.call("replicate.log")["waiters"] == 0, "the abandoned waits to end")
        site.call("replicate.abort", {"name": "job-w/step-00000001"})
    finally:
        site.call("replicate.resume")


def test_the_replica_managers_stats_and_wake_check_their_callers(tmp_path):
    """``replicas.stats`` is the operator's (the node's admin token); ``replicas.wake`` (it makes the node read etcd
    at once) takes the token of a job already bound there, as the planning node forwards it: no token, a made-up
    job or a wrong token is refused."""
    from node_helpers import NodeProc, flight_action
    from replication_helpers import Etcd

    etcd = Etcd(str(tmp_path / "etcd"))
    os.makedirs(tmp_path / "root")
    n = None
    try:
        n = NodeProc(str(tmp_path / "root"), str(tmp_path / "work"), "--etcd", etcd.endpoint, "--admin-token",
                     "admin-token-77", name="rm")
        client = flight.connect(n.location)
        for token in (None, "job-a-token-1"):
            with pytest.raises(flight.FlightUnauthenticatedError, match="admin token"):
                flight_action(client, "replicas.stats", {}, job="job-a", token=token)
        assert "copies_made" in flight_action(client, "replicas.stats", {}, token="admin-token-77")
        with pytest.raises(flight.FlightServerError, match="no such checkpoint"):  # binds job-a's token first
            flight_action(client, "replicas.publish", {"job": "job-a", "checkpoint": "job-a/step-1"}, job="job-a",
                          token="job-a-token-1")
        for job, token, message in ((None, None, "job header"), ("made-up", "made-up-token-1", "no token is bound"),
                                    ("job-a", "wrong-token-12", "bad token")):
            with pytest.raises(flight.FlightUnauthenticatedError, match=message):
                flight_action(client, "replicas.wake", {}, job=job, token=token)
        assert flight_action(client, "replicas.wake", {}, job="job-a", token="job-a-token-1")["node"]
        client.close()
    finally:
        if n is not None:
            n.terminate()
        etcd.close()
