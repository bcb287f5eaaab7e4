"""Default log output: foresight's warnings (fallbacks) reach a user who never set up logging, one line each.

A library must not take over logging, but a user who never configured it would otherwise see fallbacks without
context (Python's last-resort handler prints the bare message). So on first use, and only while logging is
unconfigured (the root logger and the ``foresight`` logger have no handlers), :func:`ensure_default_logging` attaches
one concise stderr handler to the ``foresight`` logger, at the level ``FORESIGHT_LOG`` names: ``warning`` by default
(fallbacks: pread instead of io_uring, an unpinned arena, a storage node decoded locally; a loader's construction
says nothing), ``info`` adds each loader's start-up summary (backend, arena memory, prefetch), ``debug`` every
foresight record. Once the application configures logging itself (a root handler appears), the default handler
steps aside at the next record and foresight logs through the application's handlers, at the application's levels.

``FORESIGHT_LOG`` takes the standard level names in any case (``debug``, ``info``, ``warning``/``warn``, ``error``,
``critical``) or ``off``; with logging configured by the application, a ``FORESIGHT_LOG`` that is set sets the
``foresight`` logger's level.

Example::

    $ python train.py                          # quiet unless something falls back
    $ FORESIGHT_LOG=info python train.py
    foresight: loader rank 0/1, backend=uring, 4 slots x 8.0 MiB = 32.0 MiB host memory (not pinned), ...
    $ FORESIGHT_LOG=off python train.py        # silent (warnings still reach Python's last-resort handler)
"""
from __future__ import annotations

import logging
import os
import sys
import threading

ENV = "FORESIGHT_LOG"
DEFAULT = "warning"
_LEVELS = {"off": None, "none": None, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_lock = threading.Lock()
_done = False


def parse_level(value: str) -> int | None:
    """A ``FORESIGHT_LOG`` value as a logging level (None: off); unknown values raise ValueError naming them.

    >>> parse_level("WARNING"), parse_level("info"), parse_level("off")
    (30, 20, None)
    """
    key = value.strip().lower() or DEFAULT
    if key not in _LEVELS:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(_LEVELS)}")
    return _LEVELS[key]


def _wanted_level() -> int | None:
    value = os.environ.get(ENV, DEFAULT)
    try:
        return parse_level(value)
    except ValueError as e:
        logging.getLogger("foresight").warning("%s; using %s", e, DEFAULT)
        return _LEVELS[DEFAULT]


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
        if record.levelno < self.level:
            return False
        # info: the loaders' summaries, not every module's info (the I/O engine's and arena's are for debug)
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


__all__ = ["ENV", "DEFAULT", "ensure_default_logging", "parse_level"]
