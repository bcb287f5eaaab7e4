"""Default log output: the loader says its backend, arena memory and fallbacks even when nobody set up logging.

A library must not take over logging, but a user who never configured it would otherwise see nothing: Python's
last-resort handler prints WARNING and above only, so the start-up line (backend, memory) stays silent. So on
first use, and only while logging is unconfigured (the root logger and the ``foresight`` logger have no
handlers), :func:`ensure_default_logging` attaches one concise stderr handler to the ``foresight`` logger:
INFO lines of ``foresight.loader`` (one start-up line per loader) and WARNING and above from any foresight module
(fallbacks: pread instead of io_uring, an unpinned arena, a storage node decoded locally). Once the application
configures logging itself (a root handler appears), the default handler steps aside at the next record and
foresight logs through the application's handlers, at the application's levels.

``FORESIGHT_LOG`` overrides it: ``off`` (attach nothing), ``info`` (the default), ``debug`` (every foresight
record down to DEBUG; with logging configured by the application, the ``foresight`` logger's level is set to it).

Example::

    $ python train.py
    foresight: loader rank 0/1, backend=uring, 4 slots x 8.0 MiB = 32.0 MiB host memory (not pinned), ...
    $ FORESIGHT_LOG=off python train.py        # silent (warnings still reach Python's last-resort handler)
"""
from __future__ import annotations

import logging
import os
import sys
import threading

ENV = "FORESIGHT_LOG"
_LEVELS = {"off": None, "info": logging.INFO, "debug": logging.DEBUG}
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_lock = threading.Lock()
_done = False


def _wanted_level() -> int | None:
    value = os.environ.get(ENV, "info").strip().lower() or "info"
    if value not in _LEVELS:
        logging.getLogger("foresight").warning("%s=%r is not one of off, info, debug; using info", ENV, value)
        value = "info"
    return _LEVELS[value]


class _ConciseFormatter(logging.Formatter):
    """``foresight: <message> (key=value ...)``: the ``extra`` fields node modules attach are kept."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"foresight: {record.getMessage()}"
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if extra:
            text += " (" + ", ".join(f"{k}={v}" for k, v in extra.items()) + ")"
        if record.levelno >= logging.WARNING:
            text = f"foresight {record.levelname.lower()}: {text[len('foresight: '):]}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _DefaultOutput(logging.Filter):
    """The stderr handler installed while logging is unconfigured, and its filter (see the module docstring)."""

    def __init__(self, logger: logging.Logger, level: int) -> None:
        super().__init__()
        self.logger, self.level = logger, level
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(_ConciseFormatter())
        self.handler.addFilter(self)
        logger.setLevel(level)
        logger.addHandler(self.handler)

    def step_aside(self) -> None:
        """The application configured logging: foresight's records follow its handlers and levels from now on."""
        if self.handler in self.logger.handlers:
            self.logger.removeHandler(self.handler)
            self.logger.setLevel(logging.NOTSET)

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            # Configured between two loaders: this record, already past foresight's level, still reaches the
            # application's handlers (ensure_default_logging steps aside before a loader's start-up line).
            self.step_aside()
            return False
        return self.level <= logging.DEBUG or record.levelno >= logging.WARNING or \
            record.name == "foresight.loader" or record.name.startswith("foresight.loader.")


_installed: _DefaultOutput | None = None


def ensure_default_logging() -> None:
    """Attach the default stderr output once, if logging is unconfigured and ``FORESIGHT_LOG`` is not ``off``;
    step it aside if the application has configured logging since. Called by every new loader."""
    global _done, _installed
    with _lock:
        if _installed is not None and logging.getLogger().handlers:
            _installed.step_aside()
            _installed = None
        if _done:
            return
        _done = True
        level = _wanted_level()
        if level is None:
            return
        logger = logging.getLogger("foresight")
        configured = logging.getLogger().handlers or [h for h in logger.handlers
                                                      if not isinstance(h, logging.NullHandler)]
        if not configured:
            _installed = _DefaultOutput(logger, level)
        elif ENV in os.environ and logger.level == logging.NOTSET:
            logger.setLevel(level)  # asked for explicitly: the application's handlers get foresight's records


__all__ = ["ENV", "ensure_default_logging"]
