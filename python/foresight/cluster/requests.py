"""Field checks shared by every Flight handler (the node's own actions and replication's): one refusal each.

A request is a small JSON object; a handler checks its fields before acting on any of them, and every refusal is a
one-line :class:`~foresight.errors.ProtocolError` naming the field (never a traceback from deep inside a handler).

Example::

    check_fields(body, required=("job", "checkpoint"), optional=(), what="request")
    job = check_ident(body["job"], "job")          # 1-128 of [A-Za-z0-9._-], starting with a letter or digit
"""
from __future__ import annotations

import re
from typing import Any, NoReturn, Sequence

from foresight.errors import ProtocolError

_IDENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def fail(message: str, **context: Any) -> NoReturn:
    """Refuse the request: :class:`ProtocolError` with ``message`` and the offending values."""
    raise ProtocolError(message, **context)


def check_ident(v: Any, name: str) -> str:
    """``v`` as a name (a job, a node, a checkpoint part): 1-128 characters of [A-Za-z0-9._-]."""
    if not isinstance(v, str) or not _IDENT.match(v):
        fail(f"{name} must be 1-128 characters of [A-Za-z0-9._-] starting with a letter or digit", got=repr(v)[:40])
    return v


def check_fields(obj: dict, required: Sequence[str], optional: Sequence[str], what: str) -> None:
    """Every ``required`` key present and no key outside ``required`` + ``optional``."""
    missing = [k for k in required if k not in obj]
    if missing:
        fail(f"{what} lacks fields", missing=",".join(missing))
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        fail(f"{what} has unknown fields", fields=",".join(unknown)[:80])


__all__ = ["check_fields", "check_ident", "fail"]
