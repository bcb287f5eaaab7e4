"""WAN test bed: a delaying TCP proxy on loopback that models a link as one pipe (round trip + shared bandwidth).

This kernel has no ``netem`` (``tc qdisc add dev lo root netem`` -> "Specified qdisc kind is unknown"), so the
two "sites" talk through this proxy instead. Each direction of the link is one :class:`Pipe` shared by *all*
the proxy's connections: a token bucket of ``mbit`` per direction (burst :data:`BURST` bytes) decides when each
chunk leaves the serializer, and it is delivered ``rtt/2`` later. So N parallel TCP connections together move
at most the cap, as on a real WAN link (they do not get N x the cap). Many chunks are in flight at once (the
link stays pipelined, like a real long fat pipe); the bytes queued inside the proxy per connection are bounded
(bandwidth-delay product + 4 MiB), so a fast sender feels TCP backpressure instead of filling memory.

Contention mode (``background=k``): k background flows share the pipe with the proxy's connections, each taking
an equal share with every connection that has bytes waiting (a fair-queued link), so m busy connections get
``m / (m + k)`` of the cap: one stream against 3 background flows gets a quarter, 4 parallel streams half.
It runs as its own process (``python -m foresight.testing.wan``), so it never competes for the
GIL with what it carries. See docs/wan_bed.md.

Example::

    with WanLink(("127.0.0.1", 9000), rtt_ms=100, mbit=1000, background=2) as link:
        flight.connect(f"grpc://127.0.0.1:{link.port}")   # 100 ms away from the server on :9000
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

from foresight.testing.tether import start_tethered

CHUNK = 256 << 10
BURST = 64 << 10  # bytes the bucket holds when idle: a short burst leaves at once, then the rate rules


class Pipe:
    """One direction of the link: a token bucket shared by every connection (rate ``bps`` bytes/s; 0 = no cap),
    plus ``background`` flows taking an equal share with each busy connection.

    >>> p = Pipe(1000.0, burst=0)
    >>> p.reserve(500, now=0.0), p.reserve(500, now=0.0)   # two connections' chunks queue behind each other
    (0.5, 1.0)
    """

    def __init__(self, bps: float, *, background: int = 0, burst: int = BURST) -> None:
        self.bps, self.background, self.burst = float(bps), int(background), int(burst)
        self._free = -1e18  # when the serializer is next free (virtual time; the bucket's debt)
        self.busy: set[object] = set()  # connections with bytes waiting in the proxy
        self.bytes = 0

    def reserve(self, n: int, now: float, active: int = 1) -> float:
        """When ``n`` bytes of a connection leave the serializer, ``active`` connections being busy."""
        self.bytes += n
        if not self.bps:
            return now
        share = 1.0 + self.background / max(1, active)  # background flows' bytes interleaved with ours
        self._free = max(self._free, now - self.burst / self.bps) + n * share / self.bps
        return max(now, self._free)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, one_way: float, pipe: Pipe) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    bps = pipe.bps
    limit = int(bps * one_way * 2) + (4 << 20) if bps else 64 << 20
    state = {"queued": 0}
    space = asyncio.Event()
    space.set()
    me = object()

    async def receive() -> None:
        while True:
            while state["queued"] > limit:
                space.clear()
                await space.wait()
            try:
                data = await reader.read(CHUNK)
            except (ConnectionError, OSError):
                data = b""
            now = loop.time()
            if not data:
                await queue.put((now + one_way, None))
                return
            pipe.busy.add(me)
            leaves = pipe.reserve(len(data), now, len(pipe.busy))
            state["queued"] += len(data)
            await queue.put((leaves + one_way, data))

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            state["queued"] -= len(data)
            if not state["queued"]:
                pipe.busy.discard(me)
            space.set()

    rx = asyncio.ensure_future(receive())
    try:
        await deliver()
    except (ConnectionError, OSError):
        pass  # the far end went away: so does this direction of the link
    finally:
        pipe.busy.discard(me)
        rx.cancel()


async def _serve(listen_port: int, target: tuple[str, int], one_way: float, bps: float, background: int = 0) -> None:
    up, down = Pipe(bps, background=background), Pipe(bps, background=background)  # the link, both ways

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*target)
        except OSError:
            cw.close()
            return
        for s in (cw, sw):
            sock = s.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fwd = asyncio.ensure_future(_pump(cr, sw, one_way, up))
        back = asyncio.ensure_future(_pump(sr, cw, one_way, down))
        await asyncio.wait([fwd, back], return_when=asyncio.ALL_COMPLETED)
        for w in (cw, sw):
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    port = server.sockets[0].getsockname()[1]
    print(f"READY {port}", flush=True)
    # the parent reads only that line and closes its end: whatever is printed later must neither fill a pipe nobody
    # drains (blocking the link) nor die of SIGPIPE
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    async with server:
        await server.serve_forever()


class WanLink:
    """A delaying proxy process from ``127.0.0.1:port`` to ``target``: ``rtt_ms`` round trip, ``mbit`` cap per
    direction shared by all its connections (0 = uncapped), ``background`` competing flows (contention mode).
    ``close()`` (or leaving the ``with``) stops it."""

    def __init__(self, target: tuple[str, int], *, rtt_ms: float = 100.0, mbit: float = 0.0,
                 background: int = 0) -> None:
        self.target, self.rtt_ms, self.mbit, self.background = target, rtt_ms, mbit, background
        self._proc = start_tethered(
            [sys.executable, "-m", "foresight.testing.wan", "--target", f"{target[0]}:{target[1]}",
             "--rtt-ms", str(rtt_ms), "--mbit", str(mbit), "--background", str(background)],
            stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline()
        self._proc.stdout.close()  # the proxy prints nothing after READY (its stdout goes to /dev/null then)
        if not line.startswith("READY "):
            self._proc.kill()
            raise RuntimeError(f"WAN proxy did not start (exit {self._proc.wait(60)})")
        self.port = int(line.split()[1])

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The proxy process (a bench leaves its CPU out of the measured work's: it is the network)."""
        return self._proc.pid

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(60)

    def __enter__(self) -> WanLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TcpReceiver:
    """A loopback TCP server at the far end of a link: each accepted connection goes to ``handle(conn, n)`` (``n``
    counts from 1) on a thread of its own, until :meth:`close`.

    Example::

        rx = TcpReceiver(lambda conn, n: conn.close())
        WanLink(("127.0.0.1", rx.port), rtt_ms=100)
    """

    def __init__(self, handle: Callable[[socket.socket, int], None]) -> None:
        self._handle = handle
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        n = 0
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:  # closed: stop accepting
                return
            n += 1
            threading.Thread(target=self._handle, args=(conn, n), daemon=True).start()

    def close(self) -> None:
        self._srv.close()
        self._thread.join(5)


def measure_rtt(*, rtt_ms: float, mbit: float = 0.0, pings: int = 5) -> dict[str, float]:
    """Median and min round trip (ms) of 1-byte ping-pongs through a fresh link to a local echo server."""

    def echo(conn: socket.socket, _: int) -> None:
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    rx = TcpReceiver(echo)
    with WanLink(("127.0.0.1", rx.port), rtt_ms=rtt_ms, mbit=mbit) as link:
        with socket.create_connection(("127.0.0.1", link.port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            samples = []
            for _ in range(pings):
                t0 = time.perf_counter()
                c.sendall(b"x")
                if c.recv(1) != b"x":
                    raise RuntimeError("echo through the WAN proxy returned wrong bytes")
                samples.append((time.perf_counter() - t0) * 1e3)
    rx.close()
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "configured_ms": rtt_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="host:port to forward to")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any; printed as READY <port>)")
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--mbit", type=float, default=0.0,
                   help="bandwidth cap per direction in Mbit/s, shared by all connections (0: none)")
    p.add_argument("--background", type=int, default=0, help="background flows sharing the link (contention)")
    a = p.parse_args(argv)
    host, port = a.target.rsplit(":", 1)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(_serve(a.port, (host, int(port)), a.rtt_ms / 2000.0, a.mbit * 1e6 / 8, a.background))
    return 0


if __name__ == "__main__":
    sys.exit(main())
