"""A fault-injecting HTTP proxy on loopback, in front of a real server (the tests' SeaweedFS S3 gateway).

It forwards every request as it came (method, path, headers, body: a SigV4 signature stays valid, since the
``Host`` header is passed through unchanged) and answers the ones a :class:`Fault` picks itself: ``503 SlowDown``
or ``500 InternalError`` with S3's XML error body, forwards them after a delay, or forwards them and drops the
server's reply (a request that took effect, its answer lost). A fault picks requests by method and path
pattern, then the first ``times`` of those, or a ``fraction`` of them drawn from a seeded
generator. Every request is recorded (:attr:`FaultProxy.requests`): what it asked for, and whether it was
forwarded or answered by a fault, so a test counts attempts and bytes instead of timing anything.

It runs on threads of the test's process (one per client connection, HTTP/1.1 keep-alive), over real TCP.
Request bodies must carry ``Content-Length`` (uploads are best sent to the server directly).

Example::

    with FaultProxy(("127.0.0.1", 8333), [Fault(status=503, path=r"\\.bin$", fraction=0.3, seed=1)]) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        ...
        proxy.count(path=r"\\.bin$", injected=True)     # how many were answered 503
"""
from __future__ import annotations

import http.client
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Fault", "FaultProxy", "ProxiedRequest", "S3_ERRORS"]

# status -> (S3 error code, message): what S3 answers when it sheds load or fails inside
S3_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}
# Hop-by-hop headers (RFC 9110 7.6.1) and the framing this proxy redoes itself.
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect",
        "content-length"}


@dataclass
class Fault:
    """Which requests to answer with ``status`` (503 SlowDown, 500 InternalError; 0: forward them) after
    ``delay_s`` (``drop_reply`` with status 0: forward them, then close the connection without passing the
    server's answer on: a request that took effect whose reply was lost, as when a link drops after the server
    acted): those whose method is ``method`` (None: any) and whose path (with query) matches the regex
    ``path``, then the first ``times`` of them (None: no limit), each with probability ``fraction`` (a generator
    seeded with ``seed``: the same requests in the same order draw the same faults)."""

    status: int = 503
    path: str = ""
    drop_reply: bool = False  # with status 0: forward, let the server act, then close without answering
    drop_headers: tuple[str, ...] = ()  # with status 0: forward without these request headers, signed anew
    #   with the proxy's ``keys`` (a server that ignores them: ``("If-Match",)`` is a store that ignores If-Match)
    method: str | None = "GET"
    times: int | None = None
    fraction: float = 1.0
    seed: int = 0
    delay_s: float = 0.0
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.status not in (0, *S3_ERRORS):
            raise ValueError(f"status must be 0 or one of {sorted(S3_ERRORS)}, got {self.status}")
        self._pattern = re.compile(self.path)
        self._rng = random.Random(self.seed)

    def picks(self, method: str, path: str) -> bool:
        """Whether this request is one of the fault's (counted in ``fired`` when it is); call under a lock."""
        if self.method is not None and method != self.method or not self._pattern.search(path):
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        if self.fraction < 1.0 and self._rng.random() >= self.fraction:
            return False
        self.fired += 1
        return True


@dataclass(frozen=True)
class ProxiedRequest:
    """One request seen: ``status`` is what the client got, ``injected`` whether a fault answered it (else the
    server did), ``range`` the ``Range`` header, ``nbytes`` the body bytes sent back, ``delivered`` whether the
    client was still there to take the answer (a client that timed out during a delay was not)."""

    method: str
    path: str
    range: str | None
    status: int
    injected: bool
    nbytes: int
    delivered: bool = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a client pool expects

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # the record is FaultProxy.requests

    def _any(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        if "chunked" in (self.headers.get("Transfer-Encoding") or ""):
            self._reply(501, b"chunked request bodies are not supported by the fault proxy", proxy, False, {})
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        fault = proxy._pick(self.command, self.path)
        if fault is not None and fault.delay_s:
            time.sleep(fault.delay_s)
        if fault is not None and fault.status:
            code, message = S3_ERRORS[fault.status]
            resource = self.path.split("?", 1)[0]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                   f"<Resource>{resource}</Resource><RequestId>{uuid.uuid4().hex}</RequestId></Error>").encode()
            self._reply(fault.status, xml, proxy, True, {"Content-Type": "application/xml"})
            return
        upstream = http.client.HTTPConnection(*proxy.target, timeout=proxy.timeout_s)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            headers = [(n, v) for n, v in self.headers.items() if n.lower() not in _HOP]
            if fault is not None and fault.drop_headers:
                headers = proxy._resigned(self.command, self.path, headers, body, fault.drop_headers)
            for name, value in headers:
                upstream.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body or None)
            resp = upstream.getresponse()
            data = resp.read()
        except OSError as e:  # the server is down (a test stopped it): what a gateway answers then
            self._reply(502, f"fault proxy: upstream {type(e).__name__}".encode(), proxy, False, {})
            return
        finally:
            upstream.close()
        if fault is not None and fault.drop_reply:  # the server acted; the client hears nothing but a close
            self.close_connection = True
            proxy._record(ProxiedRequest(self.command, self.path, self.headers.get("Range"), resp.status, True, 0,
                                         False))
            return
        headers = {k: v for k, v in resp.getheaders() if k.lower() not in _HOP}
        if self.command == "HEAD":  # the object's size, not this answer's body
            headers["Content-Length"] = resp.getheader("Content-Length") or "0"
        self._reply(resp.status, data, proxy, False, headers, reason=resp.reason)

    def _reply(self, status: int, data: bytes, proxy: "FaultProxy", injected: bool, headers: dict[str, str], *,
               reason: str | None = None) -> None:
        body = self.command != "HEAD" and status not in (204, 304)
        delivered = True
        try:
            self.send_response_only(status, reason)
            for name, value in headers.items():
                self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout ran out): recorded
            delivered = False
            self.close_connection = True
        proxy._record(ProxiedRequest(self.command, self.path, self.headers.get("Range"), status, injected,
                                     len(data) if body else 0, delivered))

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any


class FaultProxy:
    """An HTTP proxy from ``127.0.0.1:port`` to ``target`` that answers what ``faults`` pick (see the module doc);
    the first fault that picks a request decides. ``faults`` may be replaced any time; ``close()`` (or leaving
    the ``with``) stops it."""

    def __init__(self, target: tuple[str, int], faults: list[Fault] | None = None, *,
                 timeout_s: float = 60.0, keys: tuple[str, str, str] | None = None) -> None:
        self.target = target
        self.keys = keys  # (access key, secret key, region): to sign anew requests a fault changed
        self.faults = list(faults or [])
        self.timeout_s = timeout_s
        self.requests: list[ProxiedRequest] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _pick(self, method: str, path: str) -> Fault | None:
        with self._lock:
            return next((f for f in self.faults if f.picks(method, path)), None)

    def _resigned(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                  drop: tuple[str, ...]) -> list[tuple[str, str]]:
        """``headers`` without ``drop``, the request signed anew (SigV4, botocore's) with :attr:`keys`."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        if self.keys is None:
            raise ValueError("FaultProxy(keys=...) is needed to drop request headers (the request is signed anew)")
        gone = {h.lower() for h in drop} | {"authorization", "x-amz-date"}
        kept = {n: v for n, v in headers if n.lower() not in gone}
        host = next(v for n, v in headers if n.lower() == "host")
        request = AWSRequest(method=method, url=f"http://{host}{path}", headers=kept, data=body)
        S3SigV4Auth(Credentials(*self.keys[:2]), "s3", self.keys[2]).add_auth(request)
        return list(request.headers.items())

    def _record(self, request: ProxiedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def seen(self, *, path: str = "", method: str | None = "GET", injected: bool | None = None
             ) -> list[ProxiedRequest]:
        """The requests recorded so far whose method is ``method`` (None: any), path matches ``path`` and, unless
        ``injected`` is None, that a fault answered (True) or the server did (False)."""
        pattern = re.compile(path)
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and pattern.search(r.path)
                    and (injected is None or r.injected == injected)]

    def count(self, **match: object) -> int:
        """``len(self.seen(**match))``."""
        return len(self.seen(**match))  # type: ignore[arg-type]

    def wait_for(self, n: int, *, timeout_s: float = 60.0, **match: object) -> int:
        """Wait (bounded) until at least ``n`` requests matching ``match`` (as :meth:`seen`) are recorded; returns
        their count then (below ``n`` after ``timeout_s``). A delayed request is recorded when its delay is over."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.count(**match)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return seen

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
