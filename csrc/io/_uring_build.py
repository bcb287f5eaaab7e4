"""cffi (API mode) builder for ``foresight._uring``: the C I/O engine in ``csrc/io``.

The cffi declarations are in ``csrc/cdef/_uring.h``: they mirror ``csrc/io/fs_io.h`` with ``...`` for
constants and struct layouts, so API mode compiles them against the real header and any drift between
the two fails the build instead of misreading memory. The engine links liburing when its
header is present; otherwise it is built with the pread thread-pool backend alone and says so
once at build time.
"""
from __future__ import annotations

import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.dirname(HERE)


def _have_liburing() -> bool:
    if os.environ.get("FORESIGHT_NO_LIBURING"):
        return False
    # CPATH: where the compiler also looks (bench/gpu_device.sh points it at liburing unpacked from a .deb)
    include_dirs = [d for d in os.environ.get("CPATH", "").split(":") if d] + ["/usr/include", "/usr/local/include"]
    return any(os.path.exists(os.path.join(d, "liburing.h")) for d in include_dirs)


HAVE_LIBURING = _have_liburing()
if not HAVE_LIBURING and not os.environ.get("_FORESIGHT_LIBURING_REPORTED"):
    os.environ["_FORESIGHT_LIBURING_REPORTED"] = "1"
    print(
        "foresight: liburing.h not found (apt-get install liburing-dev); building the I/O engine "
        "with the pread thread-pool backend only",
        file=sys.stderr,
    )

ffi = FFI()
with open(os.path.join(CSRC, "cdef", "_uring.h")) as f:
    ffi.cdef(f.read())

_sources = sorted(os.path.join("csrc", "io", f) for f in os.listdir(HERE) if f.endswith(".c"))
ffi.set_source(
    "foresight._uring",
    '#include "fs_io.h"\n',
    sources=_sources,
    include_dirs=[os.path.join("csrc", "io")],
    depends=sorted(os.path.join("csrc", "io", f) for f in os.listdir(HERE) if f.endswith(".h")),
    libraries=["uring", "pthread"] if HAVE_LIBURING else ["pthread"],
    define_macros=[("FS_HAVE_LIBURING", "1")] if HAVE_LIBURING else [],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-D_GNU_SOURCE"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
