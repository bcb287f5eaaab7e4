"""Build of foresight's three native binding layers, each with one job.

* ``foresight._uring``  (cffi, API mode): the C I/O engine in ``csrc/io`` over liburing,
  with a pread thread-pool fallback. Built without liburing when the header is missing.
* ``foresight._core``   (pybind11): C++ classes in ``csrc/core`` (coalescer, arena, checksums).
* ``foresight._*_kernels`` (Cython): loops over plans, plan indexes and shard writes in ``engine/``
  (``_plan_kernels``, ``_compact_kernels``, ``_format_kernels``).

``FORESIGHT_ONLY=_core,_plan_kernels python setup.py build_ext --inplace`` rebuilds a subset
(handy while working on one layer); by default everything is built.

``_core`` is checked right after its link (csrc/bindings/_core_build_check.py): it must keep any C++ runtime
linked into it private and pass C++ errors to Python whole, whatever the compiler wrapper or LDFLAGS did;
otherwise the build fails with the reason.
"""
from __future__ import annotations

import os
import sys

import pybind11
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "csrc", "io"))
sys.path.insert(0, os.path.join(HERE, "csrc", "bindings"))
from _core_build_check import BuildCheckError, MissingRuntimeError, check_core  # noqa: E402
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
            # Export PyInit__core alone, so a C++ runtime linked in stays private (see the map file).
            extra_link_args=["-Wl,--version-script=csrc/bindings/_core.map"],
            depends=["csrc/bindings/_core.map"] + [os.path.join("csrc", "core", f) for f in os.listdir("csrc/core")],
        )
    )

CYTHON_MODULES = sorted(f[:-4] for f in os.listdir("engine") if f.endswith("_kernels.pyx"))
cython_exts = [
    Extension(
        f"foresight.{name}",
        sources=[os.path.join("engine", name + ".pyx")],
        include_dirs=["csrc/core"],
        extra_compile_args=C_FLAGS,
    )
    for name in CYTHON_MODULES
    if wanted(name)
]
if cython_exts:
    ext_modules += cythonize(
        cython_exts,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False, "cdivision": True},
        quiet=True,
    )


class CheckedBuildExt(build_ext):
    """build_ext that checks the built ``_core`` (see the module docstring) before the build may succeed."""

    def build_extension(self, ext: Extension) -> None:
        super().build_extension(ext)
        if ext.name != "foresight._core":
            return
        path = self.get_ext_fullpath(ext.name)
        try:
            try:
                summary = check_core(path)
            except MissingRuntimeError as e:  # a C linker driver: name the runtime ourselves, once
                print(f"foresight: relinking _core with -lstdc++: {e}", file=sys.stderr)
                ext.extra_link_args = [*ext.extra_link_args, "-lstdc++"]
                self.force = True
                super().build_extension(ext)
                summary = check_core(path)
        except BuildCheckError as e:
            sys.exit(f"foresight: the native build is not usable: {e}")
        print(summary, file=sys.stderr)


setup(
    cmdclass={"build_ext": CheckedBuildExt},
    ext_modules=ext_modules,
    cffi_modules=["csrc/io/_uring_build.py:ffi"] if wanted("_uring") else [],
    zip_safe=False,
)
