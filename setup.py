"""Build of foresight's three native binding layers, each with one job.

* ``foresight._uring``  (cffi, API mode): the C I/O engine in ``csrc/io`` over liburing,
  with a pread thread-pool fallback. Built without liburing when the header is missing.
* ``foresight._core``   (pybind11): C++ classes in ``csrc/core`` (coalescer, arena, checksums).
* ``foresight._engine_*`` (Cython): loops over plans and indexes in ``engine/``.

``FORESIGHT_ONLY=_core,_engine_plan python setup.py build_ext --inplace`` rebuilds a subset
(handy while working on one layer); by default everything is built.
"""
from __future__ import annotations

import os
import sys

import pybind11
from Cython.Build import cythonize
from setuptools import Extension, setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "io"))
from _uring_build import HAVE_LIBURING  # noqa: E402  (reports the liburing check once)

ONLY = {name for name in os.environ.get("FORESIGHT_ONLY", "").split(",") if name}


def wanted(name: str) -> bool:
    return not ONLY or name in ONLY


C_FLAGS = ["-O2", "-g0", "-Wall", "-Wextra", "-Wno-unused-parameter"]
CXX_FLAGS = C_FLAGS + ["-std=c++17", "-fvisibility=hidden"]

ext_modules: list[Extension] = []

if wanted("_core"):
    ext_modules.append(
        Extension(
            "foresight._core",
            sources=sorted(
                [os.path.join("csrc", "core", f) for f in os.listdir("csrc/core") if f.endswith(".cpp")]
            )
            + ["csrc/bindings/_core.cpp"],
            include_dirs=[pybind11.get_include(), "csrc/core"],
            language="c++",
            extra_compile_args=CXX_FLAGS,
        )
    )

CYTHON_MODULES = sorted(f[:-4] for f in os.listdir("engine") if f.startswith("_engine_") and f.endswith(".pyx"))
cython_exts = [
    Extension(
        f"foresight.{name}",
        sources=[os.path.join("engine", name + ".pyx")],
        include_dirs=["engine/includes", "csrc/core"],
        extra_compile_args=C_FLAGS,
    )
    for name in CYTHON_MODULES
    if wanted(name)
]
if cython_exts:
    ext_modules += cythonize(
        cython_exts,
        include_path=["engine/includes"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False, "cdivision": True},
        quiet=True,
    )

setup(
    ext_modules=ext_modules,
    cffi_modules=["csrc/io/_uring_build.py:ffi"] if wanted("_uring") else [],
    zip_safe=False,
)
