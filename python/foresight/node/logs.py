"""Structured logs: one JSON object per line on stderr (``ts``, ``level``, ``logger``, ``msg`` and any ``extra``).

Example::

    setup_json_logging("INFO")
    log.info("job registered", extra={"job": "j1", "rank": 0})
    # {"ts": "2026-12-01T03:00:00.123Z", "level": "INFO", "logger": "foresight.node", "msg": "job registered", ...}
"""
from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_json_logging(level: str = "INFO") -> None:
    """Route the ``foresight`` loggers to stderr as JSON lines (the daemon's only log output)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("foresight")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


__all__ = ["JsonFormatter", "setup_json_logging"]
