"""Who may register a job: tokens issued in etcd by the operator (`foresight node job-token`), a restarted trainer
re-attaching at once with the job's current token, `--admission issued`, and per-caller limits on registrations.
Real etcd and real `foresight node serve` processes on loopback."""
from __future__ import annotations

import subprocess
import sys

import pyarrow.flight as flight
import pytest

from foresight.loader import MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.testing.etcd import EtcdProcess
from node_helpers import SPECS, NodeProc, flight_action, host_reference, job_request, make_root, run_source


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdProcess(str(tmp_path_factory.mktemp("admetcd"))) as e:
        yield e


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("admroot")), samples=12, steps=6)
    r["reference"] = host_reference(r["dataset"], r["plan"])
    return r


@pytest.fixture(scope="module")
def node(root, etcd, tmp_path_factory):
    n = NodeProc(root["root"], str(tmp_path_factory.mktemp("admnode")), "--etcd", etcd.endpoint, "--node-id", "adm",
                 "--cpu-threshold", "101", "--max-jobs", "6", "--max-jobs-per-caller", "2", name="adm")
    yield n
    n.terminate()


def issue_token(etcd, job: str) -> str:
    """`foresight node job-token`, as the operator runs it; the token is its one line of output."""
    out = subprocess.run([sys.executable, "-m", "foresight", "node", "job-token", "--etcd", etcd.endpoint, "--job",
                          job], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert len(token) >= 8 and "\n" not in token
    return token


def register(client, root, job, token):
    """Register node job ``NAME.RANK`` (rank RANK of 4) from this caller."""
    rank = int(job.rsplit(".", 1)[1])
    return flight_action(client, "register_job", job_request(root, job, rank=rank, world_size=4), job=job,
                         token=token)


def unregister(client, job, token):
    flight_action(client, "unregister_job", {"job": job}, job=job, token=token)


def test_only_the_issued_token_registers_and_a_rotated_one_reattaches_at_once(root, etcd, node):
    t1 = issue_token(etcd, "run7")
    client = flight.FlightClient(node.location)
    try:
        # the first caller cannot claim an issued job with a token of its own
        with pytest.raises(flight.FlightUnauthenticatedError, match="not the one issued for job 'run7'"):
            register(client, root, "run7.0", "first-caller-token")
        register(client, root, "run7.0", t1)
        assert flight_action(client, "progress", {"job": "run7.0", "step": 1}, job="run7.0", token=t1)["progress"] == 1
        t2 = issue_token(etcd, "run7")  # rotated: the restarted trainer gets the new one
        assert t2 != t1
        with pytest.raises(flight.FlightUnauthenticatedError, match="not the one issued"):
            register(client, root, "run7.0", t1)
        register(client, root, "run7.0", t2)  # at once, though run7.0 is still registered under t1
        with pytest.raises(flight.FlightUnauthenticatedError):
            flight_action(client, "progress", {"job": "run7.0", "step": 2}, job="run7.0", token=t1)
        assert flight_action(client, "progress", {"job": "run7.0", "step": 2}, job="run7.0", token=t2)["progress"] == 2
        unregister(client, "run7.0", t2)
    finally:
        client.close()
    assert "job re-attached with its issued token" in node.log()


def test_a_restarted_trainer_with_the_jobs_new_token_reattaches_and_is_served(root, etcd, node):
    t1 = issue_token(etcd, "train")
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
    crashed = NodeSource(stage, root["plan"], etcd=etcd.endpoint, token=t1, job="train", timeout=60)
    try:
        crashed._refresh(force=True)
        assert crashed._usable()  # registered on the node, then the trainer dies without unregistering
        t2 = issue_token(etcd, "train")
        restarted = NodeSource(stage, root["plan"], etcd=etcd.endpoint, token=t2, job="train", timeout=60)
        try:
            got = run_source(root["dataset"], root["plan"], restarted)
        finally:
            restarted.close()
        assert got == root["reference"]
        assert restarted.stats["samples_local"] == 0  # every part from the node: no wait for the old one to expire
    finally:
        crashed._job_reg.close()
        stage.close()


def test_one_caller_cannot_fill_the_node(root, etcd, node):
    client = flight.FlightClient(node.location)
    registered = []
    try:
        for job in ("a.0", "a.1", "b.0"):  # two jobs (the ranks of one count once): this caller's share
            register(client, root, job, "caller-one-token")
            registered.append(job)
        with pytest.raises(flight.FlightError, match="caller has as many jobs registered as one caller may"):
            register(client, root, "c.0", "caller-one-token")
        register(client, root, "a.2", "caller-one-token")  # another rank of a job it has: still fine
        registered.append("a.2")
        unregister(client, "b.0", "caller-one-token")
        registered.remove("b.0")
        register(client, root, "c.0", "caller-one-token")  # a slot freed is a slot again
        registered.append("c.0")
    finally:
        for job in registered:
            unregister(client, job, "caller-one-token")
        client.close()


def test_admission_issued_refuses_a_job_without_an_issued_token(root, etcd, tmp_path):
    n = NodeProc(root["root"], str(tmp_path), "--etcd", etcd.endpoint, "--node-id", "strict", "--cpu-threshold",
                 "101", "--admission", "issued", name="strict")
    client = flight.FlightClient(n.location)
    try:
        with pytest.raises(flight.FlightUnauthenticatedError, match="no token issued for job 'stray'.*job-token"):
            register(client, root, "stray.0", "any-token-at-all")
        token = issue_token(etcd, "stray")
        register(client, root, "stray.0", token)
        unregister(client, "stray.0", token)
    finally:
        client.close()
        assert n.terminate() == 0


def test_admission_issued_needs_etcd(root, tmp_path):
    out = subprocess.run([sys.executable, "-m", "foresight", "node", "serve", "--root", root["root"], "--admission",
                          "issued"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--admission issued needs --etcd" in out.stderr
