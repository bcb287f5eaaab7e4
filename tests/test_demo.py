"""The README's main job runs end to end (short), and its resumed run is bit-exact; its bucket and replication
sections run against real servers on loopback, and each is skipped in one line when its server cannot start."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import psutil

import foresight.demo.replication as demo_replication
import foresight.testing.seaweed as seaweed
from foresight.demo import add_arguments, run
from foresight.demo.background import Starting
from foresight.testing.seaweed import weed_binary


def test_demo_runs_and_resumes_bit_exact(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "foresight", "demo", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = json.loads((out / "demo.json").read_text())
    assert measured["resume bit-exact"] is True
    assert measured["loader"]["steps"] == 24
    assert set(measured["media decode (s) by modality"]) >= {"image", "video"}
    # the demo serves its media through a storage node process and gets the host's tensors
    assert measured["node tensors equal host's"] is True
    assert measured["node"]["samples_remote"] > 0 and measured["node"]["parts_failed"] == 0
    # trained from a bucket through a cache a quarter of the dataset: the same batches, samples evicted on the way
    bucket = measured["bucket"]
    if weed_binary() is None:
        assert "weed not found" in bucket["skipped"]
    else:
        assert bucket["batches equal the local run's"] is True and bucket["steps"] == 24
        assert bucket["evicted samples"] > 0 and bucket["fetched / plan bytes"] >= 1.0
        assert 0 < bucket["GETs per sample"] and 0 <= bucket["hit rate"] <= 1
        assert {"hit rate optimum", "hit rate LRU", "first batch (s)"} <= set(bucket)
    # the step-12 checkpoint replicated to an evaluation site: it loads equal there, and merged, its model too
    replication = measured["replication"]
    assert replication["replica loads equal"] is True and replication["merged model equals"] is True
    assert replication["units"] > 1 and "commit -> replica ready (s)" in replication
    left, sent = replication["bytes left at commit"].split(" of ")
    assert 0 <= int(left) <= int(sent)
    assert "== 6. train from an S3 bucket" in proc.stdout and "== 7. replicate" in proc.stdout


def test_a_server_that_cannot_start_skips_its_section_in_one_line(tmp_path, monkeypatch, capsys):
    """SeaweedFS and the sites given no time to get ready (a real start that fails, bounded): the demo still
    runs its other sections, says in one line per section why it skipped it, and leaves no server behind."""
    monkeypatch.setattr(seaweed, "READY_TIMEOUT_S", 0.0)
    monkeypatch.setattr(demo_replication, "START_TIMEOUT_S", 0.0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # the suite's own servers (a session weed)
    assert run(parser.parse_args(["--out", str(tmp_path / "demo"), "--steps", "4"])) == 0
    printed = capsys.readouterr().out
    skips = [line for line in printed.splitlines() if "skipped:" in line]
    assert len(skips) == 2, printed[-3000:]
    assert "SeaweedFS did not start" in skips[0] and ("not ready" in skips[0] or "weed not found" in skips[0])
    assert "replication sites did not start" in skips[1] and "site eval-b did not start" in skips[1]
    measured = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert measured["resume bit-exact"] is True
    assert set(measured["bucket"]) == set(measured["replication"]) == {"skipped"}
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert started == []  # the demo's weed, both sites and the storage node are gone


def test_starting_reports_a_failed_start_and_stops_what_it_started():
    stopped = []
    failing = Starting("nothing", lambda: (_ for _ in ()).throw(RuntimeError("no port\nmore detail")), stopped.append)
    assert failing.get() is None and failing.reason == "RuntimeError: no port"
    failing.stop()
    working = Starting("something", lambda: "server", stopped.append)
    assert working.get() == "server"
    working.stop()
    working.stop()  # once only
    assert stopped == ["server"]
