"""The WAN bed's link is one pipe (issue 20, item 4): parallel connections through the proxy share its cap, and
background flows take their share. Throughputs are compared as ratios within one run (no wall-clock bound)."""
from __future__ import annotations

import socket
import threading
import time

from foresight.testing.wan import Pipe, TcpReceiver, WanLink

MBIT = 40.0  # 5 MB/s: far below what the proxy moves on a loaded machine, so the cap is what binds
EACH = 2 << 20


class Sink:
    """A TCP server that counts the bytes it receives and the connections it is reading."""

    def __init__(self) -> None:
        self.received = self.reading = 0
        self._cv = threading.Condition()
        self._rx = TcpReceiver(self._drain)
        self.port = self._rx.port

    def _drain(self, conn: socket.socket, _: int) -> None:
        with self._cv:
            self.reading += 1
            self._cv.notify_all()
        with conn:
            while data := conn.recv(1 << 20):
                with self._cv:
                    self.received += len(data)
                    self._cv.notify_all()

    def close(self) -> None:
        self._rx.close()

    def wait_for(self, n: int, timeout: float = 120.0) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.received >= n, timeout), (self.received, n)

    def wait_reading(self, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` connections in all are being read (the link's far ends are open)."""
        with self._cv:
            assert self._cv.wait_for(lambda: self.reading >= n, timeout), (self.reading, n)


def aggregate_rate(link: WanLink, sink: Sink, streams: int) -> float:
    """Bytes per second that ``streams`` parallel connections move together through ``link``."""
    reading = sink.reading
    socks = [socket.create_connection(("127.0.0.1", link.port)) for _ in range(streams)]
    start = sink.received
    payload = b"x" * EACH
    go = threading.Barrier(streams + 1)  # the clock starts once every sender runs (a thread that started late
    # on a loaded host would count its start-up as link time, and 4 threads have more of it than 1)

    def send(s: socket.socket) -> None:
        go.wait()
        s.sendall(payload)

    threads = [threading.Thread(target=send, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    sink.wait_reading(reading + streams)
    go.wait(timeout=60)
    t0 = time.perf_counter()
    sink.wait_for(start + streams * EACH)
    secs = time.perf_counter() - t0
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    return streams * EACH / secs


def test_parallel_connections_share_the_link_cap():
    sink = Sink()
    with WanLink(("127.0.0.1", sink.port), rtt_ms=10, mbit=MBIT) as link:
        one = aggregate_rate(link, sink, 1)
        four = aggregate_rate(link, sink, 4)
    sink.close()
    # one pipe: 4 streams together move what 1 does (a cap per connection would give ~4x)
    assert four / one < 1.5, (one, four)


def test_background_flows_take_their_share():
    sink = Sink()
    with WanLink(("127.0.0.1", sink.port), rtt_ms=10, mbit=MBIT) as idle, \
            WanLink(("127.0.0.1", sink.port), rtt_ms=10, mbit=MBIT, background=1) as shared:
        alone = aggregate_rate(idle, sink, 1)
        contended = aggregate_rate(shared, sink, 1)
        contended4 = aggregate_rate(shared, sink, 4)
    sink.close()
    assert 0.3 < contended / alone < 0.7, (alone, contended)  # one background flow: half the link
    assert contended4 > 1.3 * contended, (contended, contended4)  # 4 streams against 1 flow get 4/5


def test_pipe_accounting_is_exact():
    p = Pipe(1000.0, burst=0)
    assert [p.reserve(250, now=0.0, active=2) for _ in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert p.bytes == 1000
    c = Pipe(1000.0, background=3, burst=0)
    assert c.reserve(250, now=0.0, active=1) == 1.0  # 3 background flows interleave 750 bytes with our 250
    assert c.reserve(250, now=0.0, active=3) == 1.5  # against 3 busy connections, each flow takes a share
    assert Pipe(0.0).reserve(1 << 30, now=5.0) == 5.0  # uncapped
