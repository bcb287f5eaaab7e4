"""Per-call credentials and TLS material.

Every Flight call carries ``x-foresight-job`` and ``x-foresight-token`` headers; :class:`HeaderMiddlewareFactory`
hands them to the handlers, which compare the token with the one the job registered with (constant time) on every
call. TLS and mutual TLS are Flight's own (``grpc+tls://``; the server verifies client certificates against a CA
when one is given).

Example::

    server = NodeServer(root, location="grpc+tls://127.0.0.1:0", tls=("node.pem", "node.key"), client_ca="ca.pem")
    client = connect(location, tls_root="ca.pem", cert=("client.pem", "client.key"))
"""
from __future__ import annotations

import pyarrow.flight as flight

from foresight.node.protocol import HEADER_JOB, HEADER_TOKEN


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


__all__ = ["HeaderMiddleware", "HeaderMiddlewareFactory", "call_options", "connect", "read_pem"]
