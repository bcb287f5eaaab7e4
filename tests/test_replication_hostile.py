"""Hostile and malformed calls to a replication site (a real node process on loopback): each is refused at once with
a clear error naming the field or file, the node goes on serving, and a stream dropped unread holds nothing."""
from __future__ import annotations

import json
import os

import numpy as np
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
