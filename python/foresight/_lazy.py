"""A package's lazy attributes: a ``{name: submodule}`` table turned into the package's ``__getattr__`` (PEP 562),
so importing the package stays cheap and each submodule (Flight, etcd, torch behind it) loads on first use.

Example::

    _EXPORTS = {"NodeServer": "server", "NodeSource": "client"}
    __getattr__ = lazy_attributes(__name__, _EXPORTS, globals())
    __all__ = sorted(_EXPORTS)
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_attributes(package: str, table: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``name`` from ``package.<table[name]>``, kept in ``namespace`` (the
    package's globals) so the next access is a plain lookup; AttributeError for a name not in ``table``."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        namespace[name] = value
        return value

    return __getattr__


__all__ = ["lazy_attributes"]
