"""Per-call credentials, admission of jobs, and TLS material.

Every Flight call carries ``x-foresight-job`` and ``x-foresight-token`` headers; :class:`HeaderMiddlewareFactory`
hands them to the handlers, which compare the token with the one the job registered with (constant time) on every
call. TLS and mutual TLS are Flight's own (``grpc+tls://``; the server verifies client certificates against a CA
when one is given).

Who may register a job (:class:`Admission`): in a cluster, the operator issues each job's token into etcd
(``foresight node job-token --etcd E --job NAME``, which also rotates it); a registration must then present that
token, and presenting it re-attaches at once (a restarted trainer replaces its earlier registration, whatever token
that one had). A job with no issued token is refused with ``admission="issued"``; with ``"open"`` (the default, and
the single-node mode without etcd) its first caller's token binds the job on that node until it is unregistered or
idle for ``job_idle_s``. One caller (its TLS client identity, else its host) registers at most
``max_jobs_per_caller`` distinct jobs (the ranks of one job count once), so no caller fills ``max_jobs``.

Example::

    server = NodeServer(root, location="grpc+tls://127.0.0.1:0", tls=("node.pem", "node.key"), client_ca="ca.pem")
    client = connect(location, tls_root="ca.pem", cert=("client.pem", "client.key"))
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import urllib.parse
from typing import Callable

import pyarrow.flight as flight

from foresight.errors import NodeError
log = logging.getLogger("foresight.cluster.auth")
#: The two gRPC headers every Flight call carries (the node's and replication's alike).
HEADER_JOB = "x-foresight-job"
HEADER_TOKEN = "x-foresight-token"
ADMISSION_MODES = ("open", "issued")


class HeaderMiddleware(flight.ServerMiddleware):
    def __init__(self, job: str | None, token: str | None) -> None:
        self.job, self.token = job, token


class HeaderMiddlewareFactory(flight.ServerMiddlewareFactory):
    def start_call(self, info, headers):
        def first(name: str) -> str | None:
            values = headers.get(name) or []
            v = values[0] if values else None
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v

        return HeaderMiddleware(first(HEADER_JOB), first(HEADER_TOKEN))


def token_digest(token: str) -> str:
    """What etcd keeps of an issued token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def cluster_job(node_job: str, rank: int) -> str:
    """The job a node registration belongs to: ``NodeSource`` registers rank r of job J as ``J.r``."""
    suffix = f".{rank}"
    return node_job[: -len(suffix)] if node_job.endswith(suffix) and len(node_job) > len(suffix) else node_job


def caller_of(context) -> str:
    """Who is calling: the TLS client certificate's identity when there is one, else the peer's host (its port
    changes per connection)."""
    identity = context.peer_identity()
    if identity:
        return "tls:" + identity.decode("utf-8", "replace")
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def is_loopback_peer(context) -> bool:
    """Whether the call comes from this host over loopback (gRPC's peer ``ipv4:127.0.0.1:port``,
    ``ipv6:[::1]:port``; a Unix socket counts as local too)."""
    peer = context.peer() or ""
    if peer.startswith("unix:"):
        return True
    kind, _, rest = peer.partition(":")
    host = urllib.parse.unquote(rest).rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else ""  # ipv6:%5B::1%5D:port
    try:
        return is_loopback_address(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return False


def is_loopback_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Loopback, also as an IPv4-mapped IPv6 address: a dual-stack socket (``[::]``) sees a caller at 127.0.0.1
    as ``::ffff:127.0.0.1``, which Python before 3.13 does not call loopback."""
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def check_admin(context, admin_token: str) -> None:
    """The node's operator actions (``status``, ``replicas.stats``): with an admin token, only a caller presenting
    it (in the token header); without one, only callers on the node's own host (loopback). Raises
    ``FlightUnauthenticatedError`` otherwise."""
    mw = context.get_middleware("auth")
    token = None if mw is None else mw.token
    if admin_token:
        if token and hmac.compare_digest(token.encode(), admin_token.encode()):
            return
        raise flight.FlightUnauthenticatedError("foresight: this action needs the node's admin token "
                                                "(node serve --admin-token; node status --admin-token)")
    if not is_loopback_peer(context):
        raise flight.FlightUnauthenticatedError("foresight: without an admin token this action is answered on the "
                                                "node's host only; serve with --admin-token to ask from elsewhere")


class Admission:
    """Checks a registration's token against the one the cluster issued for its job; see the module docstring.

    ``issued(job) -> sha256 hex or None`` reads the cluster (:meth:`Cluster.job_token_digest`); None without etcd.

    Example::

        admission = Admission("issued", issued=cluster.job_token_digest)
        admission.check("run-7", token)      # True: issued and matching; raises when it does not match
    """

    def __init__(self, mode: str = "open", *, issued: Callable[[str], str | None] | None = None) -> None:
        if mode not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {mode!r}")
        if mode == "issued" and issued is None:
            raise ValueError("admission 'issued' needs the cluster's issued tokens (serve with --etcd)")
        self.mode, self.issued = mode, issued

    def check(self, job: str, token: str) -> bool:
        """True when ``token`` is the one issued for ``job``; False when none is issued and the mode is open
        (the first caller binds the job); raises ``FlightUnauthenticatedError`` otherwise."""
        if self.issued is None:
            return False
        try:
            digest = self.issued(job)
        except NodeError as e:
            if self.mode == "issued":
                raise flight.FlightUnavailableError(f"foresight: cannot check job {job!r}'s token: {e}") from None
            log.warning("etcd unreachable; admitting the job by its first caller's token",
                        extra={"job": job, "error": str(e)[:200]})
            return False
        if digest is None:
            if self.mode == "issued":
                raise flight.FlightUnauthenticatedError(
                    f"foresight: no token issued for job {job!r}; the operator issues one with "
                    f"`foresight node job-token --etcd ENDPOINT --job {job}`")
            return False
        if not isinstance(digest, str) or not hmac.compare_digest(digest, token_digest(token)):
            raise flight.FlightUnauthenticatedError(f"foresight: the token is not the one issued for job {job!r}")
        return True


def call_options(job: str | None, token: str | None, timeout: float | None = None) -> flight.FlightCallOptions:
    headers = []
    if job is not None:
        headers.append((HEADER_JOB.encode(), job.encode()))
    if token is not None:
        headers.append((HEADER_TOKEN.encode(), token.encode()))
    return flight.FlightCallOptions(headers=headers, timeout=timeout)


def read_pem(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def connect(location: str, *, tls_root: str | None = None, cert: tuple[str, str] | None = None,
            override_hostname: str | None = None) -> flight.FlightClient:
    """A Flight client; ``tls_root`` (CA PEM path) for ``grpc+tls://``, ``cert`` = (chain, key) for mutual TLS."""
    kwargs = {}
    if tls_root is not None:
        kwargs["tls_root_certs"] = read_pem(tls_root)
    if cert is not None:
        kwargs["cert_chain"], kwargs["private_key"] = read_pem(cert[0]), read_pem(cert[1])
    if override_hostname is not None:
        kwargs["override_hostname"] = override_hostname
    return flight.FlightClient(location, **kwargs)


__all__ = ["ADMISSION_MODES", "HEADER_JOB", "HEADER_TOKEN", "Admission", "caller_of", "check_admin", "cluster_job",
           "is_loopback_address", "is_loopback_peer", "token_digest", "HeaderMiddleware", "HeaderMiddlewareFactory", "call_options", "connect",
           "read_pem"]
