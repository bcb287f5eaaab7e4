"""Loads foresight's compiled modules, with one ImportError that lists the likely causes.

Example::

    from foresight._native import load
    _core = load("_core")
"""
from __future__ import annotations

import importlib
from types import ModuleType

_WHAT = {
    "_uring": "the C I/O engine, cffi",
    "_core": "the C++ core, pybind11",
    "_plan_kernels": "the plan loops, Cython",
    "_format_kernels": "the shard-writer loops, Cython",
    "_compact_kernels": "the compact plan loops, Cython",
}


def load(name: str) -> ModuleType:
    """``foresight.<name>``, or an ImportError saying what to do about it."""
    if name not in _WHAT:
        raise ValueError(f"unknown native module {name!r}; known: {sorted(_WHAT)}")
    try:
        return importlib.import_module(f"foresight.{name}")
    except ImportError as e:
        raise ImportError(
            f"foresight.{name} ({_WHAT[name]}) failed to load: {e}. Likely causes: the package was not built "
            "(`bash scripts/setup.sh`, or `python setup.py build_ext --inplace` in the source tree), it was "
            "built for another Python version, or a system library it links is missing (libstdc++, liburing)."
        ) from e


__all__ = ["load"]
