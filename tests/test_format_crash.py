"""A pack killed with SIGKILL at any point leaves nothing that opens as a complete dataset."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from foresight.errors import FormatError
from foresight.format import DatasetWriter, open_dataset

# The child packs token batches into small shards and SIGKILLs itself at the named point ("adds:N" = after N
# batches, else a writer stage name; "pause:STAGE" waits there to be killed from outside).
CHILD = textwrap.dedent(
    """
    import os, signal, sys, numpy as np
    from foresight.format import DatasetWriter
    out, where = sys.argv[1], sys.argv[2]
    def hook(stage):
        if where == stage:
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "pause:" + stage:
            open(out + ".ready", "w").close()
            signal.pause()
    rng = np.random.default_rng(0)
    with DatasetWriter(out, align=4096, shard_bytes=64 << 10, _on_stage=hook) as w:
        for k in range(40):
            lengths = rng.integers(1, 600, size=20)
            w.add_many(rng.integers(0, 1000, size=int(lengths.sum())).astype(np.uint16), lengths,
                       modality="tokens")
            if where == f"adds:{k}":
                os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _run_child(out, where):
    return subprocess.run([sys.executable, "-c", CHILD, str(out), where], capture_output=True, timeout=120)


@pytest.mark.parametrize("where", ["adds:0", "adds:7", "shard_closed", "before_manifest", "manifest_written"])
def test_sigkill_leaves_no_complete_dataset(tmp_path, where):
    out = tmp_path / "ds"
    proc = _run_child(out, where)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with pytest.raises(FormatError, match="no dataset"):
        open_dataset(out)
    # The debris is a hidden partial directory; the next writer of the same dataset clears it and succeeds.
    assert [p for p in os.listdir(tmp_path) if ".partial-" in p]
    with DatasetWriter(out) as w:
        w.add(b"x", modality="bytes")
    assert open_dataset(out).num_samples == 1
    assert os.listdir(tmp_path) == ["ds"]


def test_sigkill_after_publish_leaves_a_complete_dataset(tmp_path):
    out = tmp_path / "ds"
    assert _run_child(out, "renamed").returncode == -signal.SIGKILL
    ds = open_dataset(out)
    assert ds.num_samples == 40 * 20
    ds.verify_files()


@pytest.mark.parametrize("stage", ["shard_closed", "manifest_written"])
def test_sigkill_from_outside(tmp_path, stage):
    out = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), "pause:" + stage])
    try:
        ready = tmp_path / "ds.ready"
        for _ in range(1200):  # poll (not a timing assertion): the child marks when it is parked
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), "child never reached the stage"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(FormatError):
        open_dataset(out)


def test_incomplete_directory_is_rejected(tmp_path):
    # A directory holding shards but no manifest (e.g. copied by hand from a partial pack).
    with DatasetWriter(tmp_path / "ds", align=0) as w:
        w.add_many(np.arange(10, dtype=np.uint16), [4, 6], modality="tokens")
    os.unlink(tmp_path / "ds" / "manifest.json")
    with pytest.raises(FormatError, match="manifest.json missing"):
        open_dataset(tmp_path / "ds")
