"""One storage node as a real subprocess on loopback: plan order, host-identical tensors, CPU guard, SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from foresight.loader import MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.testing.tether import start_tethered
from node_helpers import SPECS, TOKEN, NodeProc, host_reference, make_root, run_source, summary, wait_for


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("noderoot")))
    r["reference"] = host_reference(r["dataset"], r["plan"])
    return r


@pytest.fixture(scope="module")
def node(root, tmp_path_factory):
    n = NodeProc(root["root"], str(tmp_path_factory.mktemp("node")), "--cpu-threshold", "101",
                 "--metrics-port", "0", name="single")
    yield n
    n.terminate()


def _source(root, node, **kw):
    stage = MediaDecodeStage([root["dataset"]], SPECS, seed=kw.pop("seed", 9), threads=2)
    return stage, NodeSource(stage, root["plan"], nodes=[node.location], token=kw.pop("token", TOKEN),
                             job=kw.pop("job", "job-a"), **kw)


def test_node_serves_every_step_in_plan_order_with_host_tensors(root, node):
    stage, source = _source(root, node)
    try:
        got = run_source(root["dataset"], root["plan"], source)
    finally:
        source.close()
        stage.close()
    assert [g["step"] for g in got] == list(range(root["plan"].num_steps))
    assert got == root["reference"]
    assert source.stats["samples_local"] == 0 and source.stats["samples_raw"] == 0
    assert source.stats["samples_remote"] == sum(len(r[n][0]) for r in got for n in SPECS if n in r)


def test_metrics_endpoint_and_status_command_report_the_job(root, node):
    stage, source = _source(root, node, job="job-metrics")
    try:
        run_source(root["dataset"], root["plan"], source)
        url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'foresight_node_samples_served_total{job="job-metrics.0",kind="decoded"}' in text
        assert "foresight_node_lead_steps" in text and "foresight_node_cpu_percent" in text
        assert 'foresight_node_decode_seconds_total{modality="video"}' in text
        out = subprocess.run([sys.executable, "-m", "foresight", "node", "status", "--node", node.location],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "job job-metrics.0" in out.stdout and "fallback rate 0.00" in out.stdout
        assert "decode time by modality" in out.stdout
    finally:
        source.close()
        stage.close()


def test_metrics_can_listen_on_every_interface(root, tmp_path):
    import psutil

    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--metrics-port", "0",
                 "--metrics-host", "0.0.0.0", name="metrics-any")
    try:
        port = n.info["metrics_port"]
        listening = {c.laddr.ip for c in psutil.Process(n.proc.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"0.0.0.0"}  # a Prometheus on another host can scrape it
        assert "foresight_node_cpu_percent" in urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert n.terminate() == 0


def test_two_jobs_on_one_node_are_isolated(root, node):
    ref_seed_3 = host_reference(root["dataset"], root["plan"], seed=3)
    stage_a, a = _source(root, node, job="iso-a", token="token-aaaaaaaa")
    stage_b, b = _source(root, node, job="iso-b", token="token-bbbbbbbb", seed=3)
    try:
        from foresight.loader import Loader

        got_a, got_b = [], []
        from node_helpers import summary

        ds, plan = root["dataset"], root["plan"]
        with Loader(ds, plan, decode=a) as la, Loader(ds, plan, decode=b) as lb:
            for ba, bb in zip(la, lb):  # interleaved: both jobs live on the node at once
                got_a.append(summary(ba))
                got_b.append(summary(bb))
        assert got_a == root["reference"] and got_b == ref_seed_3
        # b's token opens nothing of a's
        import pyarrow.flight as flight

        from foresight.cluster.auth import call_options, connect
        from foresight.node.protocol import encode_ticket

        client = connect(node.location)
        with pytest.raises(flight.FlightUnauthenticatedError, match="token"):
            client.do_get(flight.Ticket(encode_ticket("iso-a.0", rank=0, step=0)),
                          call_options("iso-a.0", "token-bbbbbbbb")).read_all()
        client.close()
    finally:
        for s, st in ((a, stage_a), (b, stage_b)):
            s.close()
            st.close()


@pytest.mark.parametrize("threshold", ["0", "101"])
def test_cpu_guard_both_ways_same_tensors(root, tmp_path, threshold):
    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", threshold, name=f"guard{threshold}")
    stage, source = _source(root, n, job="guard")
    try:
        got = run_source(root["dataset"], root["plan"], source)
    finally:
        source.close()
        stage.close()
        assert n.terminate() == 0
    assert got == root["reference"]
    if threshold == "0":
        assert source.stats["samples_raw"] > 0 and source.stats["samples_remote"] == 0
    else:
        assert source.stats["samples_raw"] == 0 and source.stats["samples_remote"] > 0


BUSY_LOOP = "while True: pass"
BUSY_PROCESSES = 4  # several, so that they keep a share of the CPUs however busy the shared machine is
GUARD_THRESHOLD = 10.0  # percent of the measured scope's CPUs: far above an idle node, far below 4 spinners


def _busy_children() -> list:
    """Spinning processes that are children of this (the node's) process: inside its process tree."""
    return [start_tethered([sys.executable, "-c", BUSY_LOOP]) for _ in range(BUSY_PROCESSES)]


def _busy_outsiders() -> list[int]:
    """Spinning processes outside this process's tree (their parent shell exits: they are re-parented)."""
    out = subprocess.run(["sh", "-c", f"for i in $(seq {BUSY_PROCESSES}); do {sys.executable} -c '{BUSY_LOOP}' "
                          "</dev/null >/dev/null 2>&1 & echo $!; done"], capture_output=True, text=True, check=True)
    return [int(pid) for pid in out.stdout.split()]


def _end(children=(), pids=()):
    for p in children:
        p.kill()
        p.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_cpu_guard_engages_when_its_process_tree_is_busy_and_tensors_stay_the_same(root):
    """The node (here, in this process) measures its own process tree; busy children of it engage the guard, and
    the parts come back raw, decoded on the host into the same tensors."""
    from foresight.node.server import NodeServer

    server = NodeServer(root["root"], cpu_threshold=GUARD_THRESHOLD, cpu_measure="process", guard_interval=0.2,
                        decode_threads=2)
    busy = _busy_children()
    try:
        wait_for(lambda: server.guard.engaged, timeout=120, what="the CPU guard to engage")
        assert server.guard.cpu_percent >= GUARD_THRESHOLD
        stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
        source = NodeSource(stage, root["plan"], nodes=[server.location], token=TOKEN, job="busy")
        try:
            got = run_source(root["dataset"], root["plan"], source)
        finally:
            source.close()
            stage.close()
        assert got == root["reference"]
        assert source.stats["samples_raw"] > 0
    finally:
        _end(children=busy)
        server.stop()


def test_cpu_guard_measures_the_scope_it_is_given():
    """The same spinning processes outside the node's process tree: the machine measure engages, the process measure
    does not see them. Measured against this process tree's own reading just before they start (whatever an earlier
    test left running here counts in both), so the test checks the scope, not that the test process is idle."""
    from foresight.node.guard import CpuGuard, sampler

    process = sampler("process")
    time.sleep(2.0)  # one long reading: this process tree alone
    before = process()
    outsiders = _busy_outsiders()
    machine = CpuGuard(GUARD_THRESHOLD, interval=0.2, measure="machine").start()
    try:
        wait_for(lambda: machine.engaged, timeout=120, what="the machine-wide guard to engage")
        process()
        time.sleep(2.0)  # the same reading with the outsiders spinning on every CPU
        during = process()
        # 4 spinners on this machine's CPUs would add ~100 points to a measure that counted them
        assert during < before + 25.0, (before, during, [p.as_dict(["pid", "cmdline", "cpu_times"])
                                                          for p in psutil.Process().children(recursive=True)])
    finally:
        machine.stop()
        _end(pids=outsiders)


def test_sigterm_stops_cleanly_with_json_logs(root, tmp_path):
    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", name="term")
    stage, source = _source(root, n, job="term")
    try:
        run_source(root["dataset"], root["plan"], source)
    finally:
        stage.close()
    assert n.terminate() == 0
    source.close()  # the node is gone: unregistering is best effort and must not raise
    lines = [json.loads(line) for line in n.log().splitlines() if line.startswith("{")]
    msgs = [line["msg"] for line in lines]
    assert "node serving" in msgs and "node draining" in msgs and "node stopped" in msgs
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)


@pytest.mark.slow
def test_slow_node_is_bypassed_then_used_again(root, tmp_path):
    import os
    import signal

    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", name="slow")
    stage, source = _source(root, n, job="slow", timeout=5, retry_s=0)  # retry on every step
    remote_at = {}

    def before_decode(step):
        remote_at[step] = source.stats["samples_remote"]
        if step == 1:
            os.kill(n.proc.pid, signal.SIGSTOP)  # frozen: every call to it runs into its deadline
        if step == 3:
            os.kill(n.proc.pid, signal.SIGCONT)

    try:
        got = run_source(root["dataset"], root["plan"], source, before_decode=before_decode)
    finally:
        os.kill(n.proc.pid, signal.SIGCONT)
        source.close()
        stage.close()
        n.terminate()
    assert got == root["reference"]
    assert remote_at[3] == remote_at[1]  # steps 1-2: nothing from the frozen node, decoded here
    assert source.stats["samples_local"] > 0
    assert source.stats["samples_remote"] > remote_at[3]  # back to the node once it answers again


@pytest.mark.slow
def test_node_restarted_on_its_address_is_registered_again(root, tmp_path):
    from foresight.testing.processes import free_port

    port = str(free_port())
    nodes = [NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--port", port, name="r0")]
    stage, source = _source(root, nodes[0], job="restart", retry_s=0.2)

    def before_decode(step):
        if step == 2:  # a clean restart between two calls: the new process does not know the job
            assert nodes[-1].terminate() == 0
            nodes.append(NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--port", port, name="r1"))

    try:
        got = run_source(root["dataset"], root["plan"], source, before_decode=before_decode)
    finally:
        source.close()
        stage.close()
        nodes[-1].terminate()
    assert got == root["reference"]
    assert source.stats["samples_local"] == 0  # every part came from a node, before and after the restart
    assert source.stats["reregistered"] + source.stats["parts_failed"] >= 1


def test_stop_lets_in_flight_streams_finish_and_refuses_new_ones_clearly(root):
    """Streams in flight when the node stops finish whole within the grace period; calls arriving while it drains
    are refused with "shutting down" (the listener stays open meanwhile, so no caller meets a closed port)."""
    import threading

    import pyarrow.flight as flight

    from foresight.cluster.auth import call_options
    from foresight.node.protocol import decode_tensors, encode_ticket
    from foresight.node.server import NodeServer
    from node_helpers import BIG_SPECS, flight_action, job_request

    server = NodeServer(root["root"], cpu_threshold=101, decode_threads=2, shutdown_grace_s=300)
    clients = []
    try:
        client = flight.FlightClient(server.location)
        clients.append(client)
        flight_action(client, "register_job", job_request(root, "drain", transforms=BIG_SPECS, lead=1), job="drain",
                      token=TOKEN)
        readers = {}
        for step in (0, 1):  # big parts, not read yet: in flight until this test reads them
            readers[step] = client.do_get(flight.Ticket(encode_ticket("drain", rank=0, step=step)),
                                          call_options("drain", TOKEN, timeout=300))
        wait_for(lambda: flight_action(client, "health", {})["streams"] == 2, timeout=120, what="2 streams in flight")
        stopped = []
        stopper = threading.Thread(target=lambda: stopped.append(server.stop()))
        stopper.start()
        wait_for(lambda: not flight_action(client, "health", {})["ok"], timeout=60, what="the node draining")
        late = flight.FlightClient(server.location)
        clients.append(late)
        with pytest.raises(flight.FlightUnavailableError, match="shutting down"):
            late.do_get(flight.Ticket(encode_ticket("drain", rank=0, step=0)),
                        call_options("drain", TOKEN, timeout=60)).read_all()
        with pytest.raises(flight.FlightUnavailableError, match="shutting down"):
            flight_action(late, "progress", {"job": "drain", "step": 0}, job="drain", token=TOKEN)
        for step, reader in readers.items():  # read on: each in-flight stream ends whole
            rows = decode_tensors(reader.read_all().to_batches(), as_torch=False)
            want = sum(len(root["reference"][step][n][0]) for n in SPECS if n in root["reference"][step])
            assert len(rows) == want > 0 and sorted(p for p, _, _ in rows) == list(range(want))
        stopper.join(timeout=120)
        assert stopped == [True]  # gRPC shut down without cancelling anything
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_plan_not_on_the_node_is_uploaded_once_and_kept_by_digest(root, node, tmp_path):
    from foresight.plan import build_plan, load_plan

    plan = build_plan([(root["dataset"], 1.0)], seed=6, global_batch_size=4, num_steps=3)
    plan.save(str(tmp_path / "client-plan"))
    plan = load_plan(str(tmp_path / "client-plan"))
    reference = host_reference(root["dataset"], plan)
    for job in ("upload-1", "upload-2"):
        stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
        source = NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job=job)
        try:
            got = run_source(root["dataset"], plan, source)
        finally:
            source.close()
            stage.close()
        assert got == reference and source.stats["samples_local"] == 0
        assert source.stats["plans_uploaded"] == (1 if job == "upload-1" else 0)  # kept: not sent again


def test_raw_bytes_that_fail_their_checksum_are_decoded_from_the_hosts_read(root, tmp_path):
    """A node whose copy of a shard is corrupt: its raw bytes fail the pack-time xxh3, the client decodes that part
    from its own read instead, and the batch is still the host's."""
    import shutil

    import numpy as np

    bad_root = str(tmp_path / "bad-root")
    shutil.copytree(root["root"], bad_root)
    ds = root["dataset"]
    ext = ds.lookup(np.arange(ds.num_samples))
    shard0 = np.flatnonzero(ext.shard == 0)
    with open(f"{bad_root}/media/shard-00000.bin", "r+b") as f:  # one byte inside every sample of shard 0
        for i in shard0:
            f.seek(int(ext.offset[i]) + int(ext.length[i]) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    n = NodeProc(bad_root, str(tmp_path), "--cpu-threshold", "0", name="corrupt")
    stage, source = _source(root, n, job="corrupt", retry_s=0)
    try:
        got = run_source(root["dataset"], root["plan"], source)
    finally:
        source.close()
        stage.close()
        n.terminate()
    assert got == root["reference"]
    assert source.stats["parts_failed"] > 0 and source.stats["samples_local"] > 0


def test_each_rank_of_a_job_gets_its_own_share(root, node):
    for rank in (0, 1):
        reference = host_reference(root["dataset"], root["plan"], rank=rank, world_size=2)
        stage, source = _source(root, node, job="ranks", rank=rank, world_size=2)
        try:
            got = run_source(root["dataset"], root["plan"], source, rank=rank, world_size=2)
        finally:
            source.close()
            stage.close()
        assert got == reference and source.stats["samples_local"] == 0


def test_node_source_serves_the_rank_of_the_loader_it_is_given(root, node):
    from foresight.loader import Loader

    reference = host_reference(root["dataset"], root["plan"], rank=1, world_size=2)
    stage, source = _source(root, node, job="loader-rank")  # no rank: it takes the Loader's
    try:
        with Loader(root["dataset"], root["plan"], source=source, rank=1, world_size=2) as loader:
            got = [summary(b) for b in loader]
        assert (source.rank, source.world_size, source.node_job) == (1, 2, "loader-rank.1")
    finally:
        source.close()
        stage.close()
    assert got == reference
    wanted = sum(len(r[n][0]) for r in got for n in SPECS if n in r)
    assert source.stats["samples_remote"] == wanted and source.stats["samples_local"] == 0


def test_node_source_rank_that_differs_from_the_loader_is_an_error(root, node):
    from foresight.loader import Loader

    stage, source = _source(root, node, job="rank-clash", rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match=r"rank=0, world_size=2 .* rank 1 of world size 2"):
            Loader(root["dataset"], root["plan"], source=source, rank=1, world_size=2)
        with pytest.raises(ValueError, match=r"rank=0, world_size=2 .* rank 0 of world size 1"):
            Loader(root["dataset"], root["plan"], source=source)
    finally:
        source.close()
        stage.close()


def test_racing_registrations_of_one_job_leave_one_job_and_no_open_files(root):
    import os
    import threading

    import pyarrow.flight as flight

    from foresight.cluster.auth import call_options, connect
    from foresight.node.jobs import spec_digest
    from foresight.node.server import NodeServer

    req = json.dumps({"job": "race", "datasets": ["media"], "plan": "plans/p1", "plan_digest": root["plan"].digest,
                      "rank": 0, "world_size": 1, "specs": {k: v.to_dict() for k, v in SPECS.items()}, "seed": 9,
                      "spec_digest": spec_digest(SPECS)}).encode()
    shard_files = set(root["dataset"].shard_paths)

    def open_shards() -> int:
        return sum(os.path.realpath(f"/proc/self/fd/{fd}") in shard_files for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    server = NodeServer(root["root"], cpu_threshold=101, decode_threads=1)
    try:
        before = open_shards()

        def register():
            client = connect(server.location)
            list(client.do_action(flight.Action("register_job", req), call_options("race", TOKEN, timeout=60)))
            client.close()

        threads = [threading.Thread(target=register) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert list(server._jobs) == ["race"] and list(server.scheduler.queues) == ["race"]
        assert open_shards() - before == len(shard_files)  # one job's files, not six
    finally:
        server.stop()


def test_iterate_without_the_loader_reads_nothing_on_the_host_while_nodes_serve(root, node, tmp_path):
    """NodeSource.iterate(): the same batches as the host's loader; the host reads only what a node did not
    deliver (here: while the node is stopped), through its own engine."""
    from node_helpers import summary

    stage, source = _source(root, node, job="iterate")
    try:
        got = [summary(b) for b in source.iterate()]
        assert source._local_io is None  # healthy node: not one byte read on the host
        resumed = [summary(b) for b in source.iterate(start_step=2, end_step=4)]
    finally:
        source.close()
        stage.close()
    assert got == root["reference"] and resumed == root["reference"][2:4]

    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", name="iter-down")
    stage, source = _source(root, n, job="iterate-down", retry_s=0)
    try:
        it = source.iterate(prefetch=0)
        first = summary(next(it))
        assert n.terminate() == 0  # the node goes away mid-epoch: the rest is read and decoded here
        rest = [summary(b) for b in it]
    finally:
        source.close()
        stage.close()
    assert [first] + rest == root["reference"] and source.stats["samples_local"] > 0


HIDE_MODULE = ("import sys\nsys.modules[{name!r}] = None  # as if not installed: importing it raises\n"
               "from foresight.cli import main\nsys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("command, hidden", [
    (["node", "serve", "--root", "."], "prometheus_client"),
    (["node", "serve", "--root", ".", "--etcd", "http://127.0.0.1:9"], "etcd3gw"),
    (["demo", "--steps", "2"], "prometheus_client"),
    (["demo", "--steps", "2"], "av"),
])
def test_a_missing_optional_module_is_named_with_its_extra(tmp_path, command, hidden):
    from foresight.cli import EXTRA_OF

    out = subprocess.run([sys.executable, "-c", HIDE_MODULE.format(name=hidden), *command, *(
        ["--out", str(tmp_path / "demo")] if command[0] == "demo" else [])], capture_output=True, text=True,
        timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=os.path.abspath("python")))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"foresight {command[0]}: error: the Python module {hidden!r} is missing; install it with: "
        f"pip install 'foresight[{EXTRA_OF[hidden]}]'"], out.stderr[-2000:]
    if command[0] == "demo":
        assert not (tmp_path / "demo").exists()  # checked before any work


def test_extras_match_what_the_node_and_the_demo_import():
    import tomllib

    from foresight.cli import EXTRA_OF

    with open("pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {extra: " ".join(reqs) for extra, reqs in extras.items()}
    assert "etcd3gw" in names["node"] and "prometheus-client" in names["node"]
    assert "foresight[torch,media]" in names["node"]  # the decode stack the node runs
    assert "node" in names["all"].split("[")[1].rstrip("]").split(",")
    assert set(EXTRA_OF.values()) <= set(extras)
