"""One meaning of "a resource you close": ``with`` closes it, and so does garbage collection, quietly.

Example::

    class Arena(Closing):
        def close(self) -> None: ...

    with Arena(...) as a:   # a.close() on the way out
        ...
"""
from __future__ import annotations

from typing import Self


class Closing:
    """Mixin: ``__enter__`` returns self, ``__exit__`` calls :meth:`close`, ``__del__`` calls it as a safety net
    (never raising from a finalizer; prefer ``close()`` or ``with``). ``close`` must be idempotent."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise (a half-built object lands here too)
            pass
