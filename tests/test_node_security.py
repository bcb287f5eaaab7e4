"""Every refusal of the node's security and limits: tokens, data-root escapes, specs, caps, TLS and mutual TLS.

Each bad request gets a clear Flight error, and a job registered before it keeps being served."""
from __future__ import annotations

import datetime
import ipaddress
import json
import os

import pyarrow.flight as flight
import pytest

from foresight.loader import MediaDecodeStage
from foresight.cluster.auth import call_options, connect
from foresight.node.client import NodeSource
from foresight.node.protocol import MAX_MESSAGE_BYTES, decode_tensors, encode_ticket
from node_helpers import (SPECS, TOKEN, NodeProc, flight_action, host_reference, job_request, make_root,
                          run_source)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = make_root(str(tmp_path_factory.mktemp("secroot")))
    os.makedirs(os.path.join(r["root"], "..", "outside"), exist_ok=True)
    return r


@pytest.fixture(scope="module")
def node(root, tmp_path_factory):
    n = NodeProc(root["root"], str(tmp_path_factory.mktemp("secnode")), "--cpu-threshold", "101",
                 "--max-jobs", "2", "--max-jobs-per-caller", "2", "--max-queue-bytes", "1000000", "--max-lead", "3",
                 "--max-plan-bytes", "200000", name="sec")
    yield n
    n.terminate()


_request = job_request
_act = flight_action


def _step(client, job, token, step):
    table = client.do_get(flight.Ticket(encode_ticket(job, rank=0, step=step)),
                          call_options(job, token, timeout=60)).read_all()
    return decode_tensors(table.to_batches())


REFUSALS = [
    ("dataset escaping the root", dict(datasets=["../outside"]), "without '\\.\\.'"),
    ("absolute dataset path", dict(datasets=["/etc"]), "relative to the data root"),
    ("plan escaping the root", dict(plan="plans/../../outside"), "relative to the data root"),
    ("symlink out of the root", dict(datasets=["link-out"]), "escapes the node's data root"),
    ("unknown spec field", dict(specs={"image": dict(SPECS["image"].to_dict(), code="import os")}),
     "unknown transform spec fields"),
    ("pickle in a spec", dict(specs={"image": "gASVBQAAAAAAAACMAXiULg=="}), "must be a JSON object"),
    ("unknown modality", dict(specs={"hologram": {}}), "unknown modality"),
    ("bad spec value", dict(specs={"image": dict(SPECS["image"].to_dict(), crop="melt")}), "bad transform spec"),
    ("spec/library digest mismatch", dict(spec_digest="0123456789abcdef"), "tensors would not match"),
    ("plan digest mismatch", dict(plan_digest="sha256:" + "0" * 64), "another digest"),
    ("rank outside world", dict(rank=3, world_size=2), "rank must be"),
    ("unknown request field", dict(callback="os.system"), "unknown fields"),
]


def test_every_refusal_is_clear_and_disturbs_no_other_job(root, node):
    os.symlink("/tmp", os.path.join(root["root"], "link-out"))
    client = connect(node.location)
    good = _act(client, "register_job", _request(root), job="good", token=TOKEN)
    assert good["queue_bytes"] == 1000000 and good["lead"] == 2  # node caps: min(asked, node's)
    before = _step(client, "good", TOKEN, 0)
    for what, over, message in REFUSALS:
        with pytest.raises(flight.FlightError, match=message):
            _act(client, "register_job", _request(root, job="bad", **over), job="bad", token="token-of-bad")
    # oversized message, malformed JSON, unknown action
    with pytest.raises(flight.FlightError, match="larger than the node accepts"):
        _act(client, "progress", b'{"job": "good", "step": 1, "pad": "' + b"x" * MAX_MESSAGE_BYTES + b'"}',
             job="good", token=TOKEN)
    with pytest.raises(flight.FlightError, match="not valid JSON"):
        _act(client, "progress", b"{job", job="good", token=TOKEN)
    with pytest.raises(flight.FlightError, match="unknown action"):
        _act(client, "exec", {}, job="good", token=TOKEN)
    # tokens: missing, wrong, too short, another job's; re-registration under another token
    with pytest.raises(flight.FlightUnauthenticatedError):
        _act(client, "progress", {"job": "good", "step": 1}, job="good", token=None)
    with pytest.raises(flight.FlightUnauthenticatedError):
        _act(client, "progress", {"job": "good", "step": 1}, job="good", token="wrong-token-123")
    with pytest.raises(flight.FlightUnauthenticatedError, match="at least 8"):
        _act(client, "register_job", _request(root, job="short"), job="short", token="abc")
    with pytest.raises(flight.FlightUnauthenticatedError, match="another token"):
        _act(client, "register_job", _request(root), job="good", token="stolen-token-1")
    with pytest.raises(flight.FlightUnauthenticatedError):
        _step(client, "good", "wrong-token-123", 1)
    with pytest.raises(flight.FlightError, match="another rank or a step outside"):
        client.do_get(flight.Ticket(json.dumps({"job": "good", "rank": 0, "step": 999}).encode()),
                      call_options("good", TOKEN, timeout=60)).read_all()
    # jobs per node: the second job fits, the third is refused
    _act(client, "register_job", _request(root, job="second"), job="second", token="token-second")
    with pytest.raises(flight.FlightError, match="as many jobs as it accepts"):
        _act(client, "register_job", _request(root, job="third"), job="third", token="token-third")
    # the good job is served as before, untouched by all of the above
    assert [(p, m) for p, m, _ in _step(client, "good", TOKEN, 0)] == [(p, m) for p, m, _ in before]
    assert _act(client, "progress", {"job": "good", "step": 1}, job="good", token=TOKEN)["progress"] == 1
    status = _act(client, "status", {})
    assert set(status["jobs"]) >= {"good", "second"} and "bad" not in status["jobs"]
    for job, token in (("good", TOKEN), ("second", "token-second")):
        _act(client, "unregister_job", {"job": job}, job=job, token=token)
    client.close()


# -- TLS ---------------------------------------------------------------------------------------------------


def _cert(subject: str, issuer_key=None, issuer_name=None, *, ca: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, builder.sign(issuer_key or key, hashes.SHA256())


def _write(path, key, cert):
    from cryptography.hazmat.primitives import serialization

    with open(path + ".pem", "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(path + ".key", "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return path + ".pem", path + ".key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    ca_key, ca = _cert("foresight test CA", ca=True)
    ca_pem, _ = _write(os.path.join(d, "ca"), ca_key, ca)
    server = _write(os.path.join(d, "server"), *_cert("127.0.0.1", ca_key, ca.subject))
    client = _write(os.path.join(d, "client"), *_cert("trainer", ca_key, ca.subject))
    rogue_key, rogue_ca = _cert("rogue CA", ca=True)
    rogue = _write(os.path.join(d, "rogue"), *_cert("trainer", rogue_key, rogue_ca.subject))
    return {"ca": ca_pem, "server": server, "client": client, "rogue": rogue}


def test_mutual_tls_serves_the_job_and_refuses_clients_without_a_good_certificate(root, pki, tmp_path):
    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--tls-cert", pki["server"][0],
                 "--tls-key", pki["server"][1], "--client-ca", pki["ca"], name="mtls")
    try:
        assert n.location.startswith("grpc+tls://")
        for kwargs in ({}, {"cert": pki["rogue"]}):  # no client certificate; one from another CA
            client = connect(n.location, tls_root=pki["ca"], **kwargs)
            with pytest.raises(flight.FlightError):
                _act(client, "health", {})
            client.close()
        plain = connect(n.location.replace("grpc+tls", "grpc"))
        with pytest.raises(flight.FlightError):
            _act(plain, "health", {})
        plain.close()
        stage = MediaDecodeStage([root["dataset"]], SPECS, seed=9, threads=2)
        source = NodeSource(stage, root["plan"], nodes=[n.location], token=TOKEN, job="tls",
                            tls_root=pki["ca"], cert=pki["client"])
        try:
            got = run_source(root["dataset"], root["plan"], source)
        finally:
            source.close()
            stage.close()
        assert got == host_reference(root["dataset"], root["plan"])
        assert source.stats["samples_local"] == 0
    finally:
        n.terminate()


def test_plan_uploads_that_do_not_verify_are_refused(root, node):
    import pyarrow as pa

    from foresight.node.plans import _schema

    client = connect(node.location)

    def put(digest, files, token=TOKEN):
        writer, reader = client.do_put(flight.FlightDescriptor.for_path("plan", digest), _schema(),
                                       call_options("uploader", token, timeout=60))
        for name, data in files:
            writer.write_batch(pa.record_batch([pa.array([name]), pa.array([data], pa.large_binary())],
                                               schema=_schema()))
        writer.done_writing()
        reader.read()
        writer.close()

    plan_dir = os.path.join(root["root"], "plans", "p1")
    files = [(n, open(os.path.join(plan_dir, n), "rb").read()) for n in sorted(os.listdir(plan_dir))
             if n == "plan.json" or n.endswith(".npy")]
    with pytest.raises(flight.FlightError, match="digest differs"):
        put("sha256:" + "1" * 64, files)
    with pytest.raises(flight.FlightError, match="a plan does not have"):
        put(root["plan"].digest, [("../evil.py", b"import os")])
    with pytest.raises(flight.FlightError, match="larger than the node accepts"):
        put(root["plan"].digest, [("item_ptr.npy", b"\0" * 300_000)])
    with pytest.raises(flight.FlightError, match="does not load"):
        put(root["plan"].digest, [("plan.json", b"{}")])
    with pytest.raises(flight.FlightUnauthenticatedError):
        put(root["plan"].digest, files, token="short")
    assert not os.path.exists(os.path.join(root["root"], ".uploads", "plans", root["plan"].digest.split(":")[1]))
    assert [n for n in os.listdir(os.path.join(root["root"], ".uploads", "plans"))] == []  # no debris
    client.close()


MALFORMED = [  # (what, call, body): every one answered with one line naming the problem; the node lives on
    ("ticket of deeply nested JSON after {\"kind\"", "get", b'{"kind": ' + b"[" * 20000 + b"]" * 20000 + b"}",
     "nested deeper than the node accepts"),
    ("ticket of nested JSON under the size limit", "get", b'{"job": ' + b'{"a":' * 5000 + b"1" + b"}" * 5001,
     "nested deeper than the node accepts"),
    ("oversized ticket", "get", b'{"kind": "' + b"x" * MAX_MESSAGE_BYTES + b'"}', "larger than the node accepts"),
    ("ticket that is not JSON", "get", b"\xff\xfe{job", "not valid JSON"),
    ("ticket that is a JSON array", "get", b"[1, 2]", "must be a JSON object"),
    ("ticket with a NaN", "get", b'{"job": "good", "rank": NaN, "step": 0}', "constant NaN"),
    ("ticket of the wrong types", "get", b'{"job": "good", "rank": "0", "step": 0}', "rank must be an integer"),
    ("kind ticket with no handler", "get", b'{"kind": 7}', "lacks fields"),
    ("action body nested deeply", "action", b'{"job": "good", "step": ' + b"[" * 20000 + b"]" * 20000 + b"}",
     "nested deeper than the node accepts"),
    ("action body not UTF-8", "action", b'{"job": "\xff"}', "not valid JSON"),
    ("action body a JSON string", "action", b'"progress"', "must be a JSON object"),
]


@pytest.mark.parametrize("what,call,body,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_every_malformed_request_gets_a_one_line_error(node, what, call, body, message):
    client = flight.FlightClient(node.location)  # a raw Flight client, no foresight helper in between
    try:
        with pytest.raises(flight.FlightError) as err:
            if call == "get":
                client.do_get(flight.Ticket(body), call_options("good", TOKEN, timeout=60)).read_all()
            else:
                list(client.do_action(flight.Action("progress", body), call_options("good", TOKEN, timeout=60)))
        first = str(err.value).splitlines()[0]
        assert "foresight: " in first and message in first, str(err.value)
        assert "Traceback" not in str(err.value) and "Error(" not in first
        health = json.loads(list(client.do_action(flight.Action("health", b"{}")))[0].body.to_pybytes())
        assert health["ok"]  # the node survived it
    finally:
        client.close()


# -- operator actions: status (and the replica manager's replicas.stats) --------------------------------------


def _non_loopback_address() -> str | None:
    """An address of this host that is not loopback (none: a machine with loopback only)."""
    import socket

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # no packet is sent: the route picks the source address
            found.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        found += [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((a for a in found if not ipaddress.ip_address(a).is_loopback), None)


def test_status_needs_the_admin_token_and_health_stays_open(root, tmp_path):
    """``status`` names every job, its progress and the bucket root: with ``--admin-token`` it is answered only to
    callers presenting it; ``health`` (the liveness probe clients use before registering) needs nothing."""
    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--admin-token", "admin-token-77",
                 name="admin")
    try:
        client = connect(n.location)
        for token in (None, "wrong-admin-token", TOKEN):
            with pytest.raises(flight.FlightUnauthenticatedError, match="admin token"):
                _act(client, "status", {}, token=token)
        assert "jobs" in _act(client, "status", {}, token="admin-token-77")
        assert _act(client, "health", {})["ok"]
        client.close()
        import subprocess
        import sys

        out = subprocess.run([sys.executable, "-m", "foresight", "node", "status", "--node", n.location, "--json"],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, FORESIGHT_NODE_ADMIN_TOKEN="admin-token-77"))
        assert out.returncode == 0 and "error" not in json.loads(out.stdout)[0], out.stdout + out.stderr
    finally:
        n.terminate()


def test_without_an_admin_token_status_is_answered_on_the_nodes_host_only(root, tmp_path):
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this host has no address but loopback: no caller from elsewhere to be")
    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--host", "0.0.0.0", name="open")
    try:
        port = n.location.rsplit(":", 1)[1]
        remote = connect(f"grpc://{addr}:{port}")
        with pytest.raises(flight.FlightUnauthenticatedError, match="admin token"):
            _act(remote, "status", {})
        assert _act(remote, "health", {})["ok"]
        remote.close()
        local = connect(f"grpc://127.0.0.1:{port}")
        assert "jobs" in _act(local, "status", {})  # the operator on the node's host (node status, tests)
        local.close()
    finally:
        n.terminate()


@pytest.mark.parametrize("any_host", ["[::]", "::"])
def test_without_an_admin_token_status_is_answered_to_loopback_callers_of_a_dual_stack_node(root, tmp_path, any_host):
    """A node on ``--host [::]`` or ``::`` (IPv6 and IPv4 on one socket): ``status`` answers callers at 127.0.0.1 and
    at ``[::1]``. gRPC names an IPv6 peer ``ipv6:%5B::1%5D:port`` (brackets percent-encoded), which was not taken for
    loopback, so the operator on the node's own host was refused over IPv6; ``::`` unbracketed made no location."""
    if not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this host")
    n = NodeProc(root["root"], str(tmp_path), "--cpu-threshold", "101", "--host", any_host, name="dual")
    try:
        port = n.location.rsplit(":", 1)[1]
        for host in ("127.0.0.1", "[::1]"):
            local = connect(f"grpc://{host}:{port}")
            assert "jobs" in _act(local, "status", {}), host
            local.close()
    finally:
        n.terminate()
