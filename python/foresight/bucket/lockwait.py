"""Bounded waits on the file locks a bucket cache shares between the processes of a host.

A blocking ``flock``/``lockf``/``F_OFD_SETLKW`` waits for ever when its holder stops without dying (a job
suspended with SIGSTOP, a process stuck in D state on a bad disk): the kernel drops a lock when its holder dies,
never when it stops. So every wait here is a non-blocking try repeated (a short pause between tries, growing to
``MAX_PAUSE_S``) until the lock is free, or until ``wait_s`` passes with no sign of progress from the holders:
then a :class:`~foresight.errors.BucketError` (``lock_timeout``) names the lock file, what was waited for and the
process holding it (from ``/proc/locks``, where it shows). A legitimate holder shows progress (``progress()``
returns something new: a layout touches its lock file, a fetch marks samples), and each sign gives the waiter
``wait_s`` more, so a long layout or fetch is waited for as long as it moves.

Example::

    wait_for_lock(lambda: try_flock(fd), wait_s=300.0, progress=lambda: os.fstat(fd).st_mtime_ns,
                  path=lock_path, what="the cache layout")
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Hashable

from foresight.errors import BucketError

log = logging.getLogger("foresight.bucket")

__all__ = ["wait_for_lock", "holders", "touch", "LOCK_WAIT_S", "MAX_PAUSE_S", "check_wait_s"]

# How long a lock holder may go without progress: well past the longest legitimate pause (one GET's retry budget
# plus its timeout, 90 s by default), short enough that a stopped holder is named within minutes.
LOCK_WAIT_S = 300.0
MAX_PAUSE_S = 0.005  # between tries: a released lock is seen within 5 ms (a waiter's 200 syscalls/s cost ~0.1% CPU)


def check_wait_s(wait_s: float) -> float:
    wait_s = float(wait_s)
    if not wait_s > 0:  # also refuses NaN
        raise ValueError(f"lock_wait_s must be a positive number of seconds, got {wait_s!r}")
    return wait_s


def touch(fd: int) -> None:
    """A holder's sign of progress: its lock file's mtime moves (waiters compare it). Best effort: a file system
    that refuses it costs waiters their patience, never the holder its work."""
    try:
        os.utime(fd)
    except OSError:
        pass


def holders(fd: int) -> list[int]:
    """The pids ``/proc/locks`` shows holding a lock on ``fd``'s file (other than this process; any range, not only
    the one waited for); empty when it shows none (another pid namespace, no procfs, OFD locks)."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                if "->" in line:  # a blocked waiter, not a holder
                    continue
                fields = line.split()
                at = next((i for i, x in enumerate(fields) if x.count(":") == 2), None)
                if at is None or fields[at] != dev:
                    continue
                pid = int(fields[at - 1])
                if pid > 0 and pid != os.getpid() and pid not in found:
                    found.append(pid)
    except (OSError, ValueError):
        return []
    return found


def _state(pid: int) -> str:
    """``pid``'s run state as ``/proc`` shows it (``T (stopped)``, ``D (disk sleep)``, ...), or ``""``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def wait_for_lock(try_lock: Callable[[], bool], *, fd: int, path: str, what: str, wait_s: float,
                  progress: Callable[[], Hashable]) -> None:
    """Take a lock with ``try_lock()`` (non-blocking: True once taken), waiting while it is held elsewhere; raise
    ``lock_timeout`` naming ``path`` (the lock file, open as ``fd``) and ``what`` was waited for once ``wait_s``
    passes in which ``progress()`` (asked once per ``wait_s``) stayed the same."""
    if try_lock():
        return
    log.debug("waiting for %s on %s", what, path)  # (a wait on a blocking lock showed in /proc/locks; this does not)
    mark = progress()
    deadline = time.monotonic() + wait_s
    pause = 0.0005
    while True:
        time.sleep(pause)
        pause = min(2 * pause, MAX_PAUSE_S)
        if try_lock():
            return
        now = time.monotonic()
        if now < deadline:
            continue
        seen = progress()
        if seen != mark:  # the holder moved: as long again
            mark, deadline = seen, now + wait_s
            continue
        pids = holders(fd)
        held_by = ", ".join(f"pid {p}" + (f" ({s})" if (s := _state(p)) else "") for p in pids)
        raise BucketError(f"waited {wait_s:g} s for {what}: its lock is held by another process" +
                          (f" (locks on this file: {held_by})" if held_by else "") + ", which made no progress "
                          "meanwhile (stopped, or stuck on its disk?); open_bucket_dataset's lock_wait_s sets this "
                          "wait", "lock_timeout", path=path)
