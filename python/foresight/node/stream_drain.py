"""The node's DoGet streams in flight: counted from call to last batch, waited for at shutdown, then cancelled.

:meth:`NodeServer.stop <foresight.node.server.NodeServer.stop>` refuses new calls, waits up to its grace for
:class:`InFlightStreams` to reach zero, and then cancels what is left: every :class:`CountedStream` ends at its
next batch, and :func:`cut_connections` shuts the server's client sockets so gRPC cancels calls stuck on a reader
that stopped reading (Flight offers no per-call cancel).

Example::

    streams = InFlightStreams()
    with streams.starting() as started:
        stream = flight.GeneratorStream(schema, CountedStream(streams, batches))
        started()                           # the stream gives the count back at its end
    streams.wait_idle(timeout=10.0)         # at shutdown
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator

import psutil

from foresight.cluster.owned_stream import OwnedStream

#: Default seconds streams in flight may run on after :meth:`NodeServer.stop` (SIGTERM) before they are cancelled.
DEFAULT_SHUTDOWN_GRACE_S = 10.0
#: Seconds :meth:`NodeServer.stop` waits for gRPC to wind down once the streams left were cancelled.
CANCEL_WAIT_S = 5.0


class InFlightStreams:
    """How many DoGet streams are between their call and their last batch (or their cancellation)."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()
        self._cancel = threading.Event()

    @contextlib.contextmanager
    def starting(self) -> Iterator[Callable[[], None]]:
        """Count a DoGet from its call on; ``started()`` hands the count to its :class:`CountedStream` (which
        gives it back at the stream's end), else it is given back when the call fails."""
        with self._cond:
            self.count += 1
        handed = []
        try:
            yield lambda: handed.append(True)
        finally:
            if not handed:
                self.ended()

    def ended(self) -> None:
        with self._cond:
            self.count -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is in flight, for up to ``timeout`` seconds; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count == 0, timeout=timeout)

    def cancel(self) -> None:
        """End every stream at its next batch."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


def CountedStream(streams: InFlightStreams, batches: list) -> OwnedStream:
    """The record batches of one DoGet, counted in the server's in-flight streams until the last one is taken,
    the stream fails or is dropped (client gone, call cancelled) or the server cancels it at shutdown."""
    return OwnedStream(batches, streams.ended, cancelled=lambda: streams.cancelled,
                       cancel_message="foresight: node shut down; stream cancelled")


def cut_connections(port: int) -> int:
    """Shut down the sockets of this process's client connections to ``port``: gRPC sees them close, cancels their
    calls and unblocks writes stuck on a reader that stopped reading. Returns how many were cut."""
    cut = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.raddr and c.fd >= 0:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:  # closed meanwhile
                pass
    return cut
