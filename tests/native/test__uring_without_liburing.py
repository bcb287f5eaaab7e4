"""A build on a machine without liburing still succeeds, says so once, and runs on the pread pool."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import os, shutil, sys
    # A copy of csrc/ in the temp dir: the builder's source paths are relative, as setup.py needs them.
    shutil.copytree(os.path.join(sys.argv[1], "csrc"), os.path.join(sys.argv[2], "csrc"))
    os.chdir(sys.argv[2])
    sys.path.insert(0, os.path.join(sys.argv[2], "csrc", "io"))
    import _uring_build
    _uring_build.ffi.compile(tmpdir=".")
    sys.path.insert(0, sys.argv[2])
    import importlib.util, glob
    so = glob.glob(os.path.join(sys.argv[2], "foresight", "_uring*.so"))[0]
    spec = importlib.util.spec_from_file_location("foresight._uring", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ffi, lib = mod.ffi, mod.lib
    out, info = ffi.new("struct fs_engine **"), ffi.new("struct fs_engine_info *")
    assert lib.fs_io_have_liburing() == 0
    assert lib.fs_engine_create(ffi.NULL, out) == 0            # auto: falls back to the pool
    assert lib.fs_engine_info(out[0], info) == 0
    assert info.backend == lib.FS_BACKEND_PREAD, info.backend
    lib.fs_engine_destroy(out[0])
    opts = ffi.new("struct fs_engine_opts *")
    opts.backend = lib.FS_BACKEND_URING
    assert lib.fs_engine_create(opts, out) < 0                 # asked for io_uring explicitly: a clear refusal
    print("ok")
    """
)


def test_build_without_liburing_falls_back(tmp_path):
    env = dict(os.environ, FORESIGHT_NO_LIBURING="1")
    env.pop("_FORESIGHT_LIBURING_REPORTED", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ROOT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")
    assert proc.stderr.count("liburing.h not found") == 1  # said once
