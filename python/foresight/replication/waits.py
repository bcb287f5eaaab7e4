"""Bounded waits of the replication actions that block (``replicate.wait``, ``replica.merged``).

A caller's wait holds one of the node's server threads; with no timeout a hostile or buggy caller could hold them all.
So every wait is capped by the node (``--replication-max-wait-s``; the caller hears "timed out ... at most N s" and
may ask again: :meth:`foresight.replication.policy.Replication.wait` does), and it ends as soon as its caller goes
away (its deadline passed, its channel closed): the thread is checked for cancellation every :data:`POLL_S`.

Example::

    wait_event(t.done, b.get("timeout"), max_wait_s=300, cancelled=context.is_cancelled, what="the replica",
               name=t.name)
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from foresight.errors import CheckpointError

#: Default cap of one wait on the node, seconds (a caller waiting longer asks again).
MAX_WAIT_S = 300.0
#: How often a waiting thread looks whether its caller went away.
POLL_S = 0.25
#: The words a capped or timed-out wait's error starts with (the client's loop matches them).
TIMED_OUT = "timed out waiting for"


class CallerGone(CheckpointError):
    """The caller cancelled its call (deadline, closed channel) while the node waited for it: nobody hears this."""


def wait_event(event: threading.Event, timeout: float | None, *, max_wait_s: float,
               cancelled: Callable[[], bool] | None, what: str, **context: Any) -> None:
    """Return once ``event`` is set; raise :class:`CheckpointError` ("timed out waiting for <what>") after
    ``min(timeout, max_wait_s)`` seconds, :class:`CallerGone` once ``cancelled()`` is true."""
    capped = timeout is None or timeout > max_wait_s
    limit = max_wait_s if capped else float(timeout)
    deadline = time.monotonic() + limit
    while not event.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            extra = {"max_wait_s": max_wait_s} if capped else {}
            raise CheckpointError(f"{TIMED_OUT} {what}" + (f" (the node waits at most {max_wait_s:g} s per call; "
                                                            "ask again)" if capped else ""), **context, **extra)
        if cancelled is not None and cancelled():
            raise CallerGone("the caller went away while waiting", **context)
        event.wait(min(left, POLL_S) if cancelled is not None else left)


__all__ = ["CallerGone", "MAX_WAIT_S", "POLL_S", "TIMED_OUT", "wait_event"]
