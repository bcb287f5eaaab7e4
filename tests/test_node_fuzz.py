"""A hostile caller against the real node daemon (a process on loopback), over its real wire protocol.

Hypothesis sends malformed actions, tickets and uploads; every one must get a clear one-line Flight error (no
traceback, no internal error, none of the node's paths), the node must stay alive and keep serving a good job the
exact same bytes, write nothing outside its root, and not grow its threads or memory without bound. Idle and
half-sent connections (slowloris) must not keep a good client from being served."""
from __future__ import annotations

import json
import os
import socket

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foresight.cluster.auth import call_options
from foresight.node.protocol import ACTION_DECODERS, encode_ticket
from node_helpers import TOKEN, NodeProc, job_request, make_root

#: examples per property (FORESIGHT_FUZZ_EXAMPLES=1000 for a longer hunt: about 40 s here)
FUZZ = settings(max_examples=int(os.environ.get("FORESIGHT_FUZZ_EXAMPLES", "100")), deadline=None,
                suppress_health_check=list(HealthCheck))
TIMEOUT = 60.0  # client-side: a hang fails the call instead of the run

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=15)
hostile_ints = st.sampled_from([-1, -(1 << 63), (1 << 63), (1 << 64) + 1, 1 << 40, (1 << 40) + 1, 10 ** 30, 0])
hostile_paths = st.sampled_from(["..", "../outside", "/etc", "/etc/passwd", "media/../../outside", "media\x00x",
                                 "plans/p1/../../..", "./media", "media//x", "x" * 5000, "\u2028", "~root", ""])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzzroot")
    r = make_root(str(base / "root"), samples=6, steps=3, batch=2)
    os.makedirs(base / "outside")
    (base / "outside" / "secret.txt").write_text("not the node's")
    r["outside"] = str(base / "outside")
    return r


@pytest.fixture(scope="module")
def node(root, tmp_path_factory):
    n = NodeProc(root["root"], str(tmp_path_factory.mktemp("fuzznode")), "--cpu-threshold", "101",
                 "--max-jobs", "4", "--max-jobs-per-caller", "4", "--max-lead", "2", "--max-plan-bytes", "200000",
                 name="fuzz")
    yield n
    n.terminate()


@pytest.fixture(scope="module")
def client(node):
    c = flight.FlightClient(node.location)
    yield c
    c.close()


def _act(client, name, body: bytes, job=None, token=None):
    return [r.body.to_pybytes() for r in client.do_action(flight.Action(name, body),
                                                           call_options(job, token, timeout=TIMEOUT))]


class _Bytes(list):
    """A step's buffers; a short repr (Hypothesis prints fixtures of a failing example)."""

    def __repr__(self) -> str:
        return f"<{len(self)} buffers, {sum(map(len, self))} bytes>"


def _step_bytes(client, job="good", token=TOKEN, step=0) -> list[bytes]:
    """Step ``step`` of the good job as the exact bytes of its record batches' buffers."""
    reader = client.do_get(flight.Ticket(encode_ticket(job, rank=0, step=step)),
                           call_options(job, token, timeout=TIMEOUT))
    table = reader.read_all()
    return _Bytes(b.to_pybytes() for batch in table.to_batches() for col in batch.columns for b in col.buffers()
                  if b is not None)


_baseline: dict = {}


@pytest.fixture(scope="module")
def good(root, node, client):
    _act(client, "register_job", json.dumps(job_request(root)).encode(), job="good", token=TOKEN)
    first = _step_bytes(client)
    _baseline.update(proc=_proc(node.proc.pid), outside=_outside_snapshot(root))  # for the last test
    return first


def _proc(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Threads", "VmRSS"):
                out[k] = int(v.split()[0])
    kinds: dict = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target if target.startswith("anon_inode") else target.split(":")[0] if ":" in target else \
            os.path.basename(target)[:40]
        kinds[kind] = kinds.get(kind, 0) + 1
    out["fds"] = sum(kinds.values())
    out["fd_kinds"] = kinds
    return out


def _outside_snapshot(root) -> dict:
    """Every file next to the root (the tmp directory holding it and the 'outside' one) with its size and mtime."""
    base = os.path.dirname(root["root"])
    got = {}
    for d, _, files in os.walk(base):
        if os.path.commonpath([d, root["root"]]) == root["root"]:
            continue
        for f in files:
            st_ = os.stat(os.path.join(d, f))
            got[os.path.join(d, f)] = (st_.st_size, st_.st_mtime_ns)
    return got


def _assert_clear(err: flight.FlightError, root) -> None:
    text = str(err)
    assert "Traceback" not in text and "internal error" not in text, text
    assert root["root"] not in text and os.path.dirname(root["root"]) not in text, text
    assert TOKEN not in text, text


def _expect_refused(call, root) -> None:
    with pytest.raises(flight.FlightError) as err:
        call()
    _assert_clear(err.value, root)


def _alive(client) -> None:
    health = json.loads(_act(client, "health", b"{}")[0])
    assert health["ok"]


# -- regressions found by the fuzzing --------------------------------------------------------------------------


def test_errors_name_files_relative_to_the_root_not_by_the_nodes_absolute_path(root, node, client, good):
    """A plan name that is a dataset directory: the refusal names the file it lacks, relative to the data root
    (the node's absolute paths are its own business: the log has them)."""
    body = json.dumps(job_request(root, job="fuzzleak", plan="media")).encode()
    with pytest.raises(flight.FlightError) as err:
        _act(client, "register_job", body, job="fuzzleak", token="token-of-fuzz")
    assert "plan.json is missing" in str(err.value) and "<root>/media/plan.json" in str(err.value), str(err.value)
    _assert_clear(err.value, root)


BAD_SPECS = [  # (what, modality, edits): values of the wrong type or out of range, each refused at registration
    ("frames not an object", "video", {"frames": -1}),
    ("audio not an object", "video", {"audio": "loud"}),
    ("fractional size", "image", {"size": [32.5, 32]}),
    ("size of booleans", "image", {"size": [True, True]}),
    ("infinite window", "video", {"frames": {"num_frames": 3, "window_s": 1e999}}),
    ("boolean frame count", "video", {"frames": {"num_frames": True, "window_s": 0.8}}),
    ("boolean flip", "image", {"flip": True}),
    ("mean for five channels", "image", {"dtype": "float32", "mean": [0.5] * 5, "std": [0.5] * 5}),
    ("zero std", "image", {"dtype": "float32", "mean": [0.5] * 3, "std": [0.0] * 3}),
    ("mean of strings", "image", {"dtype": "float32", "mean": "abc", "std": "abc"}),
    ("infinite scale", "image", {"scale": [0.5, 1e999]}),
]


@pytest.mark.parametrize("what,modality,edits", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_specs_of_the_wrong_type_are_refused_at_registration(root, node, client, good, what, modality, edits):
    """Each is refused as a bad transform spec when the job registers, not met as an internal error (or a decode
    failure per step) later."""
    from node_helpers import SPECS

    specs = {k: v.to_dict() for k, v in SPECS.items()}
    specs[modality].update(edits)
    body = json.dumps(dict(job_request(root, job="fuzzspec"), specs=specs, spec_digest=None)).encode()
    with pytest.raises(flight.FlightError, match="bad transform spec") as err:
        _act(client, "register_job", body.replace(b"Infinity", b"1e999"), job="fuzzspec", token="token-of-fuzz")
    _assert_clear(err.value, root)
    _alive(client)


def _unserved_calls(client):
    opts = call_options("good", TOKEN, timeout=TIMEOUT)
    descriptor = flight.FlightDescriptor.for_path("plans", "p1")

    def exchange():
        writer, reader = client.do_exchange(descriptor, opts)
        try:
            reader.read_chunk()
        finally:
            writer.close()

    return {"list_flights": lambda: list(client.list_flights(options=opts)),
            "get_flight_info": lambda: client.get_flight_info(descriptor, opts),
            "get_schema": lambda: client.get_schema(descriptor, opts),
            "do_exchange": exchange}


@pytest.mark.parametrize("method", ["list_flights", "get_flight_info", "get_schema", "do_exchange"])
def test_flight_methods_the_node_does_not_serve_answer_one_line(root, node, client, good, method):
    """Flight's other RPCs answered pyarrow's default: UNIMPLEMENTED with the server's Python traceback."""
    if method == "get_schema":
        # pyarrow (26) maps no exception of a Python get_schema to a status (its siblings map FlightError): the
        # caller reads our line, then the traceback pyarrow attaches; nothing of the root or the token
        with pytest.raises(pa.ArrowException, match="the node does not serve GetSchema") as err:
            _unserved_calls(client)[method]()
        assert root["root"] not in str(err.value) and TOKEN not in str(err.value)
    else:
        with pytest.raises(flight.FlightError, match="the node does not serve") as err:
            _unserved_calls(client)[method]()
        _assert_clear(err.value, root)
    _alive(client)


def test_steps_prepared_on_call_threads_reuse_a_bounded_set_of_io_engines(root, node, client, good):
    """A step not yet in a job's queue is read on the gRPC call thread that asked for it; gRPC starts and ends
    those threads as load comes and goes, and each used to get an IOEngine (an io_uring) of its own, kept until
    the node stopped: the node's io_urings (and their memory) grew with every new call thread."""
    from concurrent.futures import ThreadPoolExecutor

    pid = node.proc.pid
    rings = lambda: _proc(pid)["fd_kinds"].get("anon_inode:[io_uring]", 0)  # noqa: E731
    body = json.dumps(job_request(root, job="rings")).encode()
    clients = [flight.FlightClient(node.location) for _ in range(6)]
    try:
        def fetch(i: int) -> None:
            _step_bytes(clients[i], "rings", "token-of-rings", i % 3)

        first = None
        for round_ in range(12):
            _act(client, "register_job", body, job="rings", token="token-of-rings")  # a fresh queue: nothing ready
            with ThreadPoolExecutor(6) as pool:
                list(pool.map(fetch, range(6)))
            if round_ == 1:
                first = rings()
        assert rings() <= first + 6, (first, rings())  # at most one per call in flight, not one per thread ever
    finally:
        _act(client, "unregister_job", b'{"job": "rings"}', job="rings", token="token-of-rings")
        for c in clients:
            c.close()


# -- actions --------------------------------------------------------------------------------------------------

action_names = st.sampled_from(sorted(ACTION_DECODERS)) | st.text(max_size=60)
bodies = (st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode())
          | st.dictionaries(st.sampled_from(["job", "step", "rank", "x", "datasets"]), json_values, max_size=4)
          .map(lambda v: json.dumps(v).encode()))


def _ok_or_refused(call, root):
    """A call that may be legitimate (health, status with an empty body); if refused, refused clearly."""
    try:
        return call()
    except flight.FlightError as e:
        _assert_clear(e, root)
        return None


@FUZZ
@given(name=action_names, body=bodies, job=st.sampled_from([None, "good", "nope", "x" * 300]),
       token=st.sampled_from([None, TOKEN, "wrong-token-123", ""]))
def test_fuzz_actions_get_clear_errors(root, node, client, good, name, body, job, token):
    if name == "unregister_job" and job == "good":
        job = "nope"  # the good job must stay registered for the exact-bytes check
    if name == "register_job":
        job = "fuzzjob"
    _ok_or_refused(lambda: _act(client, name, body, job=job, token=token), root)
    _alive(client)


@FUZZ
@given(field=st.sampled_from(["step", "rank", "world_size", "seed", "lead", "queue_bytes", "version"]),
       value=hostile_ints | json_values)
def test_fuzz_register_job_with_hostile_numbers(root, node, client, good, field, value):
    body = json.dumps(job_request(root, job="fuzzreg", **{field: value})).encode()
    try:
        _act(client, "register_job", body, job="fuzzreg", token="token-of-fuzz")
    except flight.FlightError as e:
        _assert_clear(e, root)
    else:  # accepted (a value in range): it must be usable and then go away cleanly
        _act(client, "unregister_job", b'{"job": "fuzzreg"}', job="fuzzreg", token="token-of-fuzz")
    _alive(client)


hostile_numbers = (hostile_ints | st.sampled_from([1e999, -1e999, 1e308, -0.0, 5e-324, 0.5, -3])
                   | st.floats(allow_nan=False, allow_infinity=False))
spec_values = (hostile_numbers | st.lists(hostile_numbers, max_size=4) | json_values
               | st.fixed_dictionaries({"num_frames": hostile_numbers, "window_s": hostile_numbers})
               | st.fixed_dictionaries({"sample_rate": hostile_numbers, "window_s": hostile_numbers}))


@FUZZ
@given(modality=st.sampled_from(["image", "video"]),
       edits=st.dictionaries(st.sampled_from(["size", "scale", "ratio", "flip", "frames", "audio", "mean", "std",
                                              "crop", "dtype", "layout", "interpolation", "output"]),
                             spec_values, min_size=1, max_size=3))
def test_fuzz_register_job_with_hostile_specs(root, node, client, good, modality, edits):
    """Specs with hostile numbers (1e999 parses as an infinity), wrong types and shapes: refused clearly or, when
    valid, served within the node's limits."""
    from node_helpers import SPECS

    specs = {k: v.to_dict() for k, v in SPECS.items()}
    specs[modality].update(edits)
    body = json.dumps(dict(job_request(root, job="fuzzspec"), specs=specs, spec_digest=None)).encode()
    # the JSON text as a client could send it: json.dumps writes Infinity, which the node refuses as a constant
    body = body.replace(b"-Infinity", b"-1e999").replace(b"Infinity", b"1e999")
    if _ok_or_refused(lambda: _act(client, "register_job", body, job="fuzzspec", token="token-of-fuzz"), root):
        try:
            for step in range(3):
                _ok_or_refused(lambda: _step_bytes(client, "fuzzspec", "token-of-fuzz", step), root)
        finally:
            _act(client, "unregister_job", b'{"job": "fuzzspec"}', job="fuzzspec", token="token-of-fuzz")
    _alive(client)


@FUZZ
@given(datasets=st.lists(st.sampled_from(["media", "plans/p1", "plans", ".uploads", "media/maps"]), max_size=4),
       world=st.integers(min_value=1, max_value=5) | st.just(1 << 20), rank=st.integers(min_value=0, max_value=5),
       step=st.sampled_from([0, 2, 3, 1 << 40]))
def test_fuzz_register_job_with_inconsistent_sizes(root, node, client, good, datasets, world, rank, step):
    """Dataset lists that do not match the plan, world sizes that do not divide the batch, ranks outside them,
    steps past the plan's end: refused clearly, or served and then the job goes away cleanly."""
    body = json.dumps(job_request(root, job="fuzzsize", datasets=datasets, world_size=world, rank=rank,
                                  step=step)).encode()
    if _ok_or_refused(lambda: _act(client, "register_job", body, job="fuzzsize", token="token-of-fuzz"), root):
        assert datasets == ["media"] and rank < world and 2 % world == 0
        for s in range(3):
            try:
                reader = client.do_get(flight.Ticket(encode_ticket("fuzzsize", rank=rank, step=s)),
                                       call_options("fuzzsize", "token-of-fuzz", timeout=TIMEOUT))
                reader.read_all()
            except flight.FlightError as e:
                _assert_clear(e, root)
        _act(client, "unregister_job", b'{"job": "fuzzsize"}', job="fuzzsize", token="token-of-fuzz")
    _alive(client)


@FUZZ
@given(field=st.sampled_from(["datasets", "plan"]), path=hostile_paths | st.text(max_size=80))
def test_fuzz_register_job_with_hostile_paths(root, node, client, good, field, path):
    value = [path] if field == "datasets" else path
    body = json.dumps(job_request(root, job="fuzzpath", **{field: value})).encode()
    if _ok_or_refused(lambda: _act(client, "register_job", body, job="fuzzpath", token="token-of-fuzz"), root):
        assert os.path.normpath(path) in ("media", "plans/p1"), path  # only a name for what is under the root
        _act(client, "unregister_job", b'{"job": "fuzzpath"}', job="fuzzpath", token="token-of-fuzz")
    _alive(client)


@FUZZ
@given(step=hostile_ints | st.integers(min_value=-5, max_value=10), job=st.sampled_from(["good", "nope"]))
def test_fuzz_progress_numbers(root, node, client, good, step, job):
    _ok_or_refused(lambda: _act(client, "progress", json.dumps({"job": job, "step": step}).encode(), job=job,
                                token=TOKEN), root)
    _alive(client)


# -- tickets --------------------------------------------------------------------------------------------------

tickets = (st.binary(max_size=300)
           | st.fixed_dictionaries({"job": st.sampled_from(["good", "nope", "", "../x"]) | json_values,
                                    "rank": hostile_ints | json_values,
                                    "step": hostile_ints | st.integers(min_value=-3, max_value=10) | json_values})
           .map(lambda d: json.dumps(d).encode())
           | st.dictionaries(st.sampled_from(["kind", "job", "rank", "step", "path"]), json_values, max_size=4)
           .map(lambda d: json.dumps(d).encode()))


@FUZZ
@given(ticket=tickets, token=st.sampled_from([None, TOKEN, "wrong-token-123"]))
def test_fuzz_tickets_get_clear_errors(root, node, client, good, ticket, token):
    def get():
        return client.do_get(flight.Ticket(ticket), call_options("good", token, timeout=TIMEOUT)).read_all()

    if token == TOKEN and ticket in {encode_ticket("good", rank=0, step=s) for s in range(3)}:
        get()
    else:
        _ok_or_refused(get, root)
    _alive(client)


# -- uploads ----------------------------------------------------------------------------------------------------

@FUZZ
@given(path=st.lists(st.binary(max_size=80), max_size=3),
       files=st.lists(st.tuples(hostile_paths | st.text(max_size=40), st.binary(max_size=200)), max_size=3))
def test_fuzz_plan_uploads_get_clear_errors(root, node, client, good, path, files):
    schema = pa.schema([("name", pa.string()), ("data", pa.large_binary())])

    def put():
        writer, reader = client.do_put(flight.FlightDescriptor.for_path(*path) if path else
                                       flight.FlightDescriptor.for_command(b"x"), schema,
                                       call_options("uploader", "token-of-upload", timeout=TIMEOUT))
        try:
            for name, data in files:
                writer.write_batch(pa.record_batch([pa.array([name]), pa.array([data], pa.large_binary())],
                                                   schema=schema))
            writer.done_writing()
            reader.read()
        finally:
            writer.close()

    _expect_refused(put, root)
    _alive(client)


# -- jobs' lifetimes ------------------------------------------------------------------------------------------


def test_duplicate_and_cancelled_jobs(root, node, client, good):
    body = json.dumps(job_request(root, job="dup")).encode()
    _act(client, "register_job", body, job="dup", token="token-of-dup")
    _expect_refused(lambda: _act(client, "register_job", body, job="dup", token="token-of-thief"), root)
    _act(client, "register_job", body, job="dup", token="token-of-dup")  # re-registration by its owner
    assert _step_bytes(client, "dup", "token-of-dup") == good
    _act(client, "unregister_job", b'{"job": "dup"}', job="dup", token="token-of-dup")
    # after the cancel: every job-scoped call is refused clearly, a second cancel too
    _expect_refused(lambda: _act(client, "progress", b'{"job": "dup", "step": 1}', job="dup", token="token-of-dup"),
                    root)
    _expect_refused(lambda: _step_bytes(client, "dup", "token-of-dup"), root)
    _expect_refused(lambda: _act(client, "unregister_job", b'{"job": "dup"}', job="dup", token="token-of-dup"), root)
    _alive(client)


# -- slowloris ---------------------------------------------------------------------------------------------------


def test_idle_and_half_sent_connections_do_not_starve_a_good_client(root, node, good):
    host, port = node.location.split("://")[1].rsplit(":", 1)
    socks = []
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    try:
        for i in range(200):
            s = socket.create_connection((host, int(port)), timeout=10)
            if i % 3 == 1:
                s.sendall(preface[: 10])  # half a preface
            elif i % 3 == 2:
                s.sendall(preface + b"\x00\x00\x12\x04")  # preface and half a SETTINGS frame header
            socks.append(s)
        fresh = flight.FlightClient(node.location)
        try:
            assert _step_bytes(fresh) == good  # under the generous client timeout
        finally:
            fresh.close()
    finally:
        for s in socks:
            s.close()


def test_stalled_uploads_and_unread_streams_do_not_starve_a_good_client(root, node, good):
    """Callers that start an upload and never finish it, or open a step's stream and never read it, hold the node's
    call threads; a good client is still served, and when they go away the node frees what they held."""
    schema = pa.schema([("name", pa.string()), ("data", pa.large_binary())])
    pid = node.proc.pid
    before = _proc(pid)
    clients, held = [], []
    try:
        for i in range(60):
            c = flight.FlightClient(node.location)
            clients.append(c)
            if i % 2:
                writer, reader = c.do_put(flight.FlightDescriptor.for_path("plan", "sha256:" + "ab" * 32), schema,
                                          call_options(f"stall{i}", "token-of-stall", timeout=TIMEOUT))
                writer.write_batch(pa.record_batch([pa.array(["plan.json"]), pa.array([b"{"], pa.large_binary())],
                                                   schema=schema))
                held.append(writer)  # never done_writing
            else:
                held.append(c.do_get(flight.Ticket(encode_ticket("good", rank=0, step=i % 3)),
                                     call_options("good", TOKEN, timeout=TIMEOUT)))  # never read
        fresh = flight.FlightClient(node.location)
        try:
            assert _step_bytes(fresh) == good
            _alive(fresh)
        finally:
            fresh.close()
    finally:
        for h in held:  # an upload's writer ends its call (the node refuses the half plan); a reader cancels
            try:
                h.close() if hasattr(h, "done_writing") else h.cancel()
            except (flight.FlightError, pa.ArrowException):
                pass
        del held
        for c in clients:
            c.close()
    # the node lets go of them: its threads come back down (gRPC keeps a few idle ones)
    from node_helpers import wait_for

    wait_for(lambda: _proc(pid)["Threads"] <= before["Threads"] + 8, timeout=60, what="call threads released")
    assert [n for n in os.listdir(os.path.join(root["root"], ".uploads", "plans"))] == []  # no debris


def test_concurrent_hostile_and_good_callers(root, node, good):
    """Threads racing registrations of one job id under different tokens, unregistering, progress and tickets of
    garbage: every call answered (ok or a clear refusal), none an internal error, the good job's bytes unchanged."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    def worker(seed: int) -> list:
        rnd = random.Random(seed)
        c = flight.FlightClient(node.location)
        problems = []
        try:
            for _ in range(25):
                token = rnd.choice(["token-of-race-a", "token-of-race-b"])
                calls = [
                    lambda: _act(c, "register_job", json.dumps(job_request(root, job="race")).encode(), job="race",
                                 token=token),
                    lambda: _act(c, "unregister_job", b'{"job": "race"}', job="race", token=token),
                    lambda: _act(c, "progress", json.dumps({"job": "race", "step": rnd.randint(-1, 5)}).encode(),
                                 job="race", token=token),
                    lambda: _step_bytes(c, "race", token, rnd.randint(0, 2)),
                    lambda: _act(c, "progress", bytes(rnd.randrange(256) for _ in range(40)), job="race",
                                 token=token),
                ]
                try:
                    rnd.choice(calls)()
                except flight.FlightError as e:
                    text = str(e)
                    if "internal error" in text or "Traceback" in text or root["root"] in text:
                        problems.append(text[:300])
        finally:
            c.close()
        return problems

    with ThreadPoolExecutor(8) as pool:
        problems = [p for ps in pool.map(worker, range(8)) for p in ps]
    assert problems == []
    c = flight.FlightClient(node.location)
    try:
        assert _step_bytes(c) == good
        for token in ("token-of-race-a", "token-of-race-b"):
            try:
                _act(c, "unregister_job", b'{"job": "race"}', job="race", token=token)
            except flight.FlightError:
                pass
    finally:
        c.close()


# -- the end state: alive, exact bytes, nothing outside written, bounded resources ----------------------------


def test_after_the_fuzzing_the_node_serves_the_same_bytes_and_is_bounded(root, node, client, good):
    pid = node.proc.pid
    before, outside_before = _baseline["proc"], _baseline["outside"]
    for _ in range(3):  # another round of abuse, then compare
        for body in (b"\xff" * 100, b'{"job": "good", "step": "x"}', b'{"job": "../../etc"}'):
            for name in ("progress", "register_job", "nope"):
                _ok_or_refused(lambda: _act(client, name, body, job="good", token=TOKEN), root)
        _ok_or_refused(lambda: client.do_get(flight.Ticket(b'{"job": "good", "rank": 0, "step": 99}'),
                                             call_options("good", TOKEN, timeout=TIMEOUT)).read_all(), root)
    after = _proc(pid)
    assert _step_bytes(client) == good
    assert node.proc.poll() is None
    assert after["Threads"] <= before["Threads"] + 8, (before, after)
    assert after["fds"] <= before["fds"] + 16, f"{before['fd_kinds']} -> {after['fd_kinds']}"
    assert after["VmRSS"] <= before["VmRSS"] + 200 * 1024, (before, after)  # kB
    assert _outside_snapshot(root) == outside_before
    status = json.loads(_act(client, "status", b"{}")[0])
    log = node.log()
    assert "failed inside the node" not in log, log[-4000:]
    assert not status.get("refusals", {}).get("internal"), status.get("refusals")
