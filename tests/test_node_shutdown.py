"""SIGTERM with a stream in flight whose reader stopped reading: the stream gets ``--shutdown-grace-s``, then is
cancelled (the log says so) and the process exits; streams that do read on finish whole meanwhile."""
from __future__ import annotations

import json
import signal
import subprocess

import pyarrow.flight as flight
import pytest

from foresight.cluster.auth import call_options
from foresight.node.protocol import encode_ticket
from node_helpers import BIG_SPECS, TOKEN, NodeProc, flight_action, job_request, make_root, wait_for

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_root(str(tmp_path_factory.mktemp("shutroot")), samples=8, steps=2)


def stalled_stream(location: str, root: dict, job: str):
    """A raw Flight client registered as ``job`` holding a step's stream open without reading it (the node's
    writes wait on this reader), once the node counts it in flight."""
    client = flight.FlightClient(location)
    flight_action(client, "register_job", job_request(root, job, transforms=BIG_SPECS, lead=1), job=job, token=TOKEN)
    reader = client.do_get(flight.Ticket(encode_ticket(job, rank=0, step=0)), call_options(job, TOKEN, timeout=300))
    wait_for(lambda: flight_action(client, "health", {})["streams"] >= 1, timeout=120, what="the stream in flight")
    return client, reader


def test_sigterm_cancels_a_stalled_stream_after_the_grace_and_exits(root, tmp_path):
    node = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--shutdown-grace-s", "1", name="stall")
    client, reader = stalled_stream(node.location, root, "stall")
    try:
        node.proc.send_signal(signal.SIGTERM)
        try:
            code = node.proc.wait(timeout=120)  # a bounded wait for the event, not a timing assertion
        except subprocess.TimeoutExpired:
            node.kill()
            pytest.fail("the node did not exit with a stalled reader:\n" + node.log()[-3000:])
        with pytest.raises(flight.FlightError):  # the stream was cut, not completed
            reader.read_all()
    finally:
        client.close()
    lines = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    cancelled = [line for line in lines if line["msg"] == "shutdown grace over; cancelling in-flight streams"]
    assert cancelled and cancelled[0]["streams"] == 1 and cancelled[0]["connections_cut"] >= 1, node.log()[-3000:]
    assert code == 0 and lines[-1]["msg"] == "node stopped"
