"""The one place where foresight's exception classes live.

Each class has two bases, :class:`ForesightError` and a builtin, so callers can catch either
(``except OSError`` around I/O, ``except foresight.ForesightError`` around everything).
Messages always name what went wrong *where*: the file, the byte offset, the sample id.

Example::

    from foresight.errors import FormatError
    raise FormatError("truncated map", path="shard-00001.map", offset=4096)
"""
from __future__ import annotations

import os
from typing import Any


class ForesightError(Exception):
    """Base class of every error foresight raises on purpose.

    It comes first in each subclass's bases so that its ``__init__`` (which takes keyword context)
    runs instead of the builtin's.
    """

    def __init__(self, message: str, **context: Any) -> None:
        self.context = {k: v for k, v in context.items() if v is not None}
        if self.context:
            details = ", ".join(f"{k}={v}" for k, v in self.context.items())
            message = f"{message} ({details})"
        super().__init__(message)


class FormatError(ForesightError, ValueError):
    """A shard, map, manifest, plan or index file is truncated, corrupt or malformed."""


class ChecksumError(FormatError):
    """A sample's bytes do not match the checksum recorded at pack time."""


class PlanError(ForesightError, ValueError):
    """Plan inputs are inconsistent, or a plan file does not match its digest."""


class DeviceError(ForesightError, RuntimeError):
    """The device asked for is not there (``device="cuda"`` with a CPU-only torch, or no such GPU)."""


class IOEngineError(ForesightError, OSError):
    """A read or write issued by the native I/O engine failed."""

    def __init__(self, message: str, errno_: int | None = None, **context: Any) -> None:
        ForesightError.__init__(self, message, **context)
        if errno_ is not None:
            self.errno = errno_
            self.strerror = os.strerror(errno_)

    def __str__(self) -> str:  # OSError's own would print only "[Errno N] strerror"
        return str(self.args[0])


class BucketError(ForesightError, OSError):
    """An object store could not serve an object (missing, access denied, changed since it was opened, still failing
    after the retry budget) or its local cache could not take it. ``reason`` is one of ``not_found``, ``denied``,
    ``changed``, ``unavailable``, ``checksum`` (an object's bytes), ``cache_full``, ``cache``, ``exists`` (an upload
    that would replace a dataset or plan without overwrite), ``lock_timeout`` (another process of the host held a
    cache lock and made no progress for ``lock_wait_s``: the lock file is named); the message names the
    object (``s3://bucket/key``) or the cache directory and never holds a credential."""

    def __init__(self, message: str, reason: str, **context: Any) -> None:
        ForesightError.__init__(self, message, **context)
        self.reason = reason

    def __str__(self) -> str:  # OSError's own would print its args tuple
        return str(self.args[0])


class DecodeError(ForesightError, ValueError):
    """Media bytes could not be decoded (corrupt, truncated, unsupported)."""


class CheckpointError(ForesightError):
    """A checkpoint could not be written, committed, found or verified."""


class StaleBatchError(ForesightError, RuntimeError):
    """A loader batch was used after its arena slot went back to the loader (the next batch was asked for,
    or ``release()`` was called): its host views may already hold another step's bytes."""


class DecodeTimeoutError(ForesightError, TimeoutError):
    """A decode pool gave no result in time, or its worker threads are gone (e.g. it crossed a ``fork``)."""


class NodeError(ForesightError, RuntimeError):
    """A storage node or the cluster could not serve a request (unreachable, refused, shutting down)."""


class ProtocolError(ForesightError, ValueError):
    """A storage-node request is malformed, unauthorised, out of range or over a limit."""


def check(ret: int, what: str, **context: Any) -> int:
    """Turn a native ``-errno`` return into :class:`IOEngineError`; pass counts through.

    >>> check(3, "fs_io_submit")
    3
    """
    if ret < 0:
        err = -int(ret)
        raise IOEngineError(f"{what} failed: {os.strerror(err)}", errno_=err, **context)
    return ret


__all__ = [
    "ForesightError",
    "FormatError",
    "ChecksumError",
    "PlanError",
    "IOEngineError",
    "DecodeError",
    "BucketError",
    "CheckpointError",
    "StaleBatchError",
    "DecodeTimeoutError",
    "NodeError",
    "ProtocolError",
    "check",
]
