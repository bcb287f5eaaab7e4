"""A DoGet's record batches that hold something until the stream ends: ``release`` runs exactly once.

The node's step streams hold a count of streams in flight (:class:`~foresight.node.stream_drain.CountedStream`);
replication's file streams hold an open file or a read reference on a copy
(:mod:`foresight.replication.checkpoint_reads`, :mod:`foresight.replication.replica_copies`). Either is released
when the batches end or fail, when the server cancels the stream, or when the stream is dropped unread. A
generator's ``finally`` is not enough: Flight drops the stream without starting it when the client is gone before
the schema is written, and an unstarted generator runs no ``finally``.

Example::

    fd = os.open(path, os.O_RDONLY)
    return flight.GeneratorStream(schema, OwnedStream(batches_of(fd), lambda: os.close(fd)))
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pyarrow.flight as flight


class OwnedStream:
    """Iterates ``batches``; ``release`` runs once at their end, their failure, a cancellation or the stream's drop.

    ``cancelled``: asked before each batch; once true the stream ends with ``FlightCancelledError(cancel_message)``
    (the node cancelling its streams at shutdown)."""

    def __init__(self, batches: Iterable[Any], release: Callable[[], None], *,
                 cancelled: Callable[[], bool] | None = None, cancel_message: str = "stream cancelled") -> None:
        self._batches, self._release = iter(batches), release
        self._cancelled, self._cancel_message = cancelled, cancel_message

    def __iter__(self) -> OwnedStream:
        return self

    def __next__(self) -> Any:
        if self._cancelled is not None and self._cancelled():
            self.close()
            raise flight.FlightCancelledError(self._cancel_message)
        try:
            return next(self._batches)
        except BaseException:  # the end (StopIteration) or a failure: either way the stream is over
            self.close()
            raise

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        self.close()


__all__ = ["OwnedStream"]
