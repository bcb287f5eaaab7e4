"""A storage node whose disk fills (a real node process; the file size limit stands in for a full disk, as
RLIMIT_FSIZE makes a write fail with EFBIG the way ENOSPC does): the caller gets a clear error naming the file,
nothing half-written is kept, and the node goes on serving."""
from __future__ import annotations

import os
import resource

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from foresight.cluster.auth import call_options

from node_helpers import NodeProc, flight_action


def test_a_plan_upload_on_a_full_disk_is_a_clear_error_and_the_node_serves_on(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    node = NodeProc(str(root), str(tmp_path / "work"))
    try:
        resource.prlimit(node.proc.pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files past 1 MiB: EFBIG
        client = flight.connect(node.location)
        schema = pa.schema([("name", pa.string()), ("data", pa.large_binary())])
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("plan", "sha256:" + "a" * 64), schema,
                                       call_options("j1", "token-123456", timeout=60))
        # it was "internal error (OSError)": a bug's answer, for a fault the caller can act on
        with pytest.raises(flight.FlightServerError, match=r"upload failed on the node: File too large.*plan\.json"):
            writer.write_batch(pa.record_batch([pa.array(["plan.json"]), pa.array([b"x" * (2 << 20)],
                                                                                   pa.large_binary())], schema=schema))
            writer.done_writing()
            reader.read()
            writer.close()
        assert os.listdir(root / ".uploads" / "plans") == []  # the half-written upload is gone
        assert flight_action(client, "health", {})["ok"]
        client.close()
    finally:
        node.kill()
