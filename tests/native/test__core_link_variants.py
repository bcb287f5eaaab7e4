"""C++ errors reach Python whole however the build links the C++ runtime.

A compiler wrapper (or LDFLAGS) that links libstdc++ statically gave a ``_core`` whose error messages stopped at
the first number (``'arena: release of slot '``), or that crashed, once another libstdc++ was in the process
(torch's): the two copies merged their locale state. Each variant here is built by setup.py in a temp dir (its
build check must pass), then imported in a fresh interpreter next to a small library that uses the shared
libstdc++'s iostreams, loaded before and after it, and driven through the error paths and the test files of
the C++ core.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Formats a number through std::ostringstream with the shared libstdc++, as torch's libraries do.
PROBE_CPP = """
#include <cstring>
#include <sstream>
extern "C" int probe_format(long value, char* out, int size) {
    std::ostringstream s;
    s << "value " << value << " end";
    std::strncpy(out, s.str().c_str(), size);
    return static_cast<int>(s.str().size());
}
"""

# argv: the variant's .so, the probe library, "before"/"after" (when the probe loads), then pytest arguments.
SCRIPT = textwrap.dedent(
    r"""
    import ctypes, importlib.util, sys
    import numpy as np

    def probe():
        lib = ctypes.CDLL(sys.argv[2])
        buf = ctypes.create_string_buffer(64)
        lib.probe_format(42, buf, 64)
        assert buf.value == b"value 42 end", buf.value

    if sys.argv[3] == "before":
        probe()
    import foresight
    from foresight.errors import FormatError
    spec = importlib.util.spec_from_file_location("foresight._core", sys.argv[1])
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    sys.modules["foresight._core"] = foresight._core = core  # what every `import` of _core below gets
    if sys.argv[3] == "after":
        probe()

    def raises(cls, message, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except cls as e:
            assert str(e) == message, f"{str(e)!r} != {message!r}"
        else:
            raise AssertionError(f"no {cls.__name__}: {message}")

    i32 = lambda *v: np.array(v, np.int32)
    i64 = lambda *v: np.array(v, np.int64)
    arena = core.Arena(4096, 2)
    raises(ValueError, "arena: release of slot 1, which is not acquired", arena.release, 1)
    raises(ValueError, "arena: release of slot 7 but the arena has 2 slots", arena.release, 7)
    arena.close()
    raises(ValueError, "arena: used after close()", arena.slot, 0)
    raises(ValueError, "arena: acquire on a closed arena", arena.acquire, 1.0)
    opts = dict(max_gap=0, max_transfer=1 << 20, align=4096)
    raises(ValueError, "coalesce: extent 0 has negative offset -5", core.coalesce, i32(0), i64(-5), i64(1), **opts)
    raises(ValueError, "coalesce: align must be a power of two >= 1, got 3", core.coalesce, i32(0), i64(0),
           i64(1), max_gap=0, max_transfer=1, align=3)
    raises(FormatError, "coalesce: extent 1 (file 0, offset 100, length 50) ends at 150, past the end of the file "
           "(120 bytes)", core.coalesce, i32(0, 0), i64(0, 100), i64(1, 50), file_sizes=i64(120), **opts)
    raises(ValueError, "xxh3_batch: slice 0 (offset 95, length 10) is outside the buffer of 100 bytes",
           core.xxh3_batch, bytes(100), i64(95), i64(10))
    raises(TypeError, "gather: dst must be a contiguous writable buffer (bytes, bytearray, numpy array, "
           "memoryview), got bytes", core.gather, bytes(8), i64(0), i64(1), bytes(8))
    for kind, cls in [("input", ValueError), ("format", FormatError), ("closed", ValueError), ("system", OSError),
                      ("std", RuntimeError)]:
        raises(cls, f"check: {kind} error 987654321 (-987654321) reached Python whole" if kind != "system" else
               f"[Errno 987654321] check: system error 987654321 (-987654321) reached Python whole",
               core._raise_for_check, kind, 987654321)
    raises(MemoryError, "foresight._core: out of memory", core._raise_for_check, "bad_alloc", 1)
    probe()  # the shared libstdc++ still formats numbers too
    if sys.argv[4:]:
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[4:]]))
    """
)

CORE_TESTS = ["tests/test_arena.py", "tests/test_coalesce.py", "tests/native/test__core.py"]


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "g++")


@pytest.fixture(scope="module")
def probe_library(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("probe")
    (tmp / "probe.cpp").write_text(PROBE_CPP)
    out = tmp / "libprobe.so"
    subprocess.run([*compiler(), "-shared", "-fPIC", "-O1", str(tmp / "probe.cpp"), "-o", str(out)], check=True)
    return str(out)


def build_variant(tmp, env: dict[str, str]) -> tuple[str, str]:
    """setup.py's build of _core alone, in a copy of the sources, with `env` added; the built file and the
    build's stderr."""
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp / "csrc")
    shutil.copy(os.path.join(ROOT, "setup.py"), tmp)
    (tmp / "engine").mkdir()  # setup.py lists the Cython modules there; none is built here
    env = {**os.environ, "FORESIGHT_ONLY": "_core", "LDFLAGS": "", **env}
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "obj"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "errors cross the binding whole" in proc.stderr  # setup.py's own check ran and passed
    built = list((tmp / "out" / "foresight").glob("_core*.so"))
    assert len(built) == 1, built
    return str(built[0]), proc.stderr


VARIANTS = {
    "static-libstdc++": {"LDFLAGS": "-static-libstdc++"},
    "static-libstdc++-and-libgcc": {"LDFLAGS": "-static-libstdc++ -static-libgcc"},
    # A C driver links C++ objects without libstdc++, as a compiler wrapper may: setup.py relinks with it.
    "c-driver": {"CC": "gcc", "CXX": "gcc"},
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_errors_cross_the_binding_whole_in_a_variant(tmp_path, probe_library, variant):
    if "CXX" in VARIANTS[variant] and not shutil.which(VARIANTS[variant]["CXX"]):
        pytest.skip(f"no {VARIANTS[variant]['CXX']} here")
    core, log = build_variant(tmp_path, VARIANTS[variant])
    assert ("relinking _core with -lstdc++" in log) == (variant == "c-driver"), log[-3000:]
    for order in ("before", "after"):
        tests = CORE_TESTS if order == "before" else []  # the whole files once; the error paths both ways
        proc = subprocess.run([sys.executable, "-c", SCRIPT, core, probe_library, order, *tests], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{variant}, probe {order}:\n{proc.stdout[-4000:]}{proc.stderr[-3000:]}"


def _build_check():
    sys.path.insert(0, os.path.join(ROOT, "csrc", "bindings"))
    try:
        import _core_build_check
    finally:
        sys.path.pop(0)
    return _core_build_check


def test_the_installed_core_exports_its_init_alone():
    from foresight import _core

    needed, defined, _ = _build_check().dynamic_info(_core.__file__)
    assert defined == ["PyInit__core"]
    assert any(lib.startswith("libc.so") for lib in needed), needed


def test_the_build_check_refuses_a_module_that_exports_more(probe_library):
    check = _build_check()
    with pytest.raises(check.BuildCheckError, match=r"exports 1 symbols besides PyInit__core .*'probe_format'"):
        check.check_core(probe_library)
