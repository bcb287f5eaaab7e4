"""Checks a freshly built ``foresight._core`` before setup.py lets it stand.

A build can link the C++ runtime in ways that break errors at run time while every plain call still works:
a compiler wrapper that links libstdc++ statically (or drops it), a foreign ``LDFLAGS``. So after the link:

1. the ELF file must export ``PyInit__core`` alone (csrc/bindings/_core.map): a C++ runtime linked in then
   stays private to the module instead of merging its GNU_UNIQUE objects with another libstdc++ in the process;
2. C++ runtime symbols it leaves undefined need a C++ runtime among its NEEDED libraries;
3. imported in a fresh interpreter, every exception kind must reach Python as the right class with its whole
   message, through real paths and ``_core._raise_for_check``.

Usage (setup.py does this after building ``_core``)::

    from _core_build_check import check_core
    print(check_core("python/foresight/_core.cpython-312-x86_64-linux-gnu.so"))

``FORESIGHT_SKIP_CORE_CHECK=1`` skips step 3, for a cross build whose module cannot run where it is built.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys

EXPORTED = {"PyInit__core"}
CXX_RUNTIMES = ("libstdc++", "libc++")
# Mangled prefixes of the C++ runtime's own symbols (std::, the ABI support library, the personality routine).
CXX_RUNTIME_PREFIXES = ("_ZNSt", "_ZSt", "_ZNKSt", "_ZTISt", "_ZTVSt", "_ZdlPv", "_Znwm", "__cxa_", "__gxx_personality")
LIBC_CXA = {"__cxa_atexit", "__cxa_finalize", "__cxa_thread_atexit_impl"}  # glibc's, not the C++ runtime's

# Run in a fresh interpreter on the built file: each kind must arrive as its class with its whole message.
IMPORT_CHECK = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("foresight._core", sys.argv[1])
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
n = 1234567
for kind, cls in [("input", ValueError), ("format", ValueError), ("closed", ValueError), ("system", OSError),
                  ("std", RuntimeError), ("bad_alloc", MemoryError)]:
    try:
        core._raise_for_check(kind, n)
    except cls as e:
        want = "foresight._core: out of memory" if kind == "bad_alloc" else \
            f"check: {kind} error {n} ({-n}) reached Python whole"
        got = e.strerror if kind == "system" else str(e)
        assert got == want, f"{kind}: {got!r} != {want!r}"
    else:
        raise AssertionError(f"{kind}: nothing raised")
arena = core.Arena(4096, 1)
try:
    arena.release(0)
except ValueError as e:
    assert str(e) == "arena: release of slot 0, which is not acquired", repr(str(e))
print("errors cross the binding whole")
"""


class BuildCheckError(RuntimeError):
    """The built module would lose or garble errors at run time; the message says why and what to do."""


class MissingRuntimeError(BuildCheckError):
    """The linker driver left the C++ runtime out (a C driver, or a wrapper): relinking with -lstdc++ mends it."""


def _elf_sections(data: bytes) -> list[tuple[int, int, int, int]]:
    """(type, offset, size, link) of each section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):  # Elf64_Shdr: name, type, flags, addr, offset, size, link, ...
        _, sh_type, _, _, offset, size, link = struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize)
        sections.append((sh_type, offset, size, link))
    return sections


def _cstr(data: bytes, at: int) -> str:
    return data[at:data.index(b"\0", at)].decode("ascii", "replace")


def dynamic_info(path: str) -> tuple[list[str], list[str], list[str]]:
    """(NEEDED libraries, defined dynamic symbols, undefined non-weak dynamic symbols) of an ELF shared object."""
    with open(path, "rb") as f:
        data = f.read()
    sections = _elf_sections(data)
    needed, defined, undefined = [], [], []
    for sh_type, offset, size, link in sections:
        strtab = sections[link][1]
        if sh_type == 11:  # SHT_DYNSYM: name, info, other, shndx, value, size
            for at in range(offset + 24, offset + size, 24):  # entry 0 is the null symbol
                name, info, _, shndx = struct.unpack_from("<IBBH", data, at)
                bind = info >> 4
                if shndx and bind in (1, 2, 10):  # GLOBAL, WEAK, GNU_UNIQUE
                    defined.append(_cstr(data, strtab + name))
                elif not shndx and bind == 1:  # a weak reference may stay unresolved
                    undefined.append(_cstr(data, strtab + name))
        elif sh_type == 6:  # SHT_DYNAMIC: (tag, value) pairs; DT_NEEDED = 1
            for at in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == 1:
                    needed.append(_cstr(data, strtab + value))
    return needed, defined, undefined


def check_core(path: str) -> str:
    """Raises BuildCheckError unless the module at ``path`` keeps its C++ runtime private and errors cross
    its binding whole; returns a one-line summary of how it is linked."""
    compiler = f"CXX={os.environ.get('CXX', '(default)')} LDFLAGS={os.environ.get('LDFLAGS', '')!r}"
    try:
        needed, defined, undefined = dynamic_info(path)
    except ValueError:  # not an ELF file we can read: the run-time check below still decides
        needed, defined, undefined = [], sorted(EXPORTED), []
    extra = sorted(set(defined) - EXPORTED)
    if extra:
        raise BuildCheckError(
            f"foresight._core ({path}) exports {len(extra)} symbols besides PyInit__core (e.g. {extra[:3]}): the "
            f"linker ignored csrc/bindings/_core.map, so a C++ runtime linked into it would mix with another "
            f"module's libstdc++ and break errors at run time. Link with a GNU-compatible linker ({compiler}).")
    dynamic_runtime = any(lib.startswith(CXX_RUNTIMES) for lib in needed)
    runtime_refs = [s for s in undefined if s.startswith(CXX_RUNTIME_PREFIXES) and s not in LIBC_CXA]
    if runtime_refs and not dynamic_runtime:
        raise MissingRuntimeError(
            f"foresight._core ({path}) calls the C++ runtime ({runtime_refs[:3]}) but links none (NEEDED: "
            f"{needed}): the compiler driver dropped libstdc++ ({compiler}). Link C++ with g++/clang++, or add "
            f"LDFLAGS=-lstdc++.")
    linked = "shared libstdc++" if dynamic_runtime else "C++ runtime linked in, kept private to the module"
    if os.environ.get("FORESIGHT_SKIP_CORE_CHECK") == "1":
        return f"foresight: _core built ({linked}); run-time error check skipped (FORESIGHT_SKIP_CORE_CHECK=1)"
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, path], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise BuildCheckError(
            f"foresight._core ({path}; {linked}; NEEDED {needed}) was built, but C++ errors do not cross its "
            f"binding intact ({how}):\n{(proc.stdout + proc.stderr)[-2000:]}\nBuilt with {compiler}; try the "
            f"system compiler (CC=gcc CXX=g++).")
    return f"foresight: _core checked ({linked}): errors cross the binding whole"
