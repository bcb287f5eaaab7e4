"""A plan directory's files, for both plan kinds: the digest, the atomic save, and the checks of plan.json's
fields and of the ``.npy`` arrays (:mod:`.store` reads the expanded kind, :mod:`.compact_store` the compact one).

A plan directory may be ``s3://bucket/prefix``: :func:`local_plan_dir` (what every plan opener calls first) gives
its copy in the bucket cache (``FORESIGHT_BUCKET_CACHE``), fetched once and reused while the bucket's
``plan.json`` is unchanged; :func:`save_plan` writes it there and uploads it, ``plan.json`` last
(:mod:`foresight.bucket.mirror`).

Example::

    digest = compute_digest(plan.header(), plan.arrays, plan.array_dtypes)     # "sha256:<hex>"
    save_plan(plan, "plan/", overwrite=True)                                  # temp dir, fsync, rename
    save_plan(plan, "s3://data/plans/p1")                                     # the same, then uploaded
"""
from __future__ import annotations

import errno
import hashlib
import json
import numbers
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Collection

import numpy as np

from foresight.bucket.mirror import mirror_prefix, publish_prefix
from foresight.bucket.opener import resolve_cache_dir
from foresight.bucket.url import is_bucket_url
from foresight.errors import FormatError, PlanError
from foresight.io.durable import aside_path, fsync_dir, recover_overwrite
from foresight.plan.locations import write_sources

PLAN_JSON = "plan.json"
MAX_JSON_BYTES = 64 << 20
CHUNK = 1 << 22  # elements per chunk of the structural checks and hashing (bounded memory)
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")

def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def compute_digest(header: dict[str, Any], arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> str:
    """sha256 over the canonical header and each array's little-endian bytes, in a fixed order (``dtypes``:
    the plan kind's arrays)."""
    h = hashlib.sha256(canonical_json(header))
    for name, dtype in dtypes.items():
        arr = arrays[name]
        for lo in range(0, arr.shape[0], CHUNK):
            h.update(np.ascontiguousarray(arr[lo : lo + CHUNK], dtype=dtype).data)
    return "sha256:" + h.hexdigest()


def local_plan_dir(path: str | os.PathLike) -> str:
    """The local directory of the plan at ``path``: ``path`` itself, or for ``s3://bucket/prefix`` its copy in the
    bucket cache (fetched whole unless the cached copy's ``plan.json`` ETag is the bucket's; a prefix without
    ``plan.json`` is a :class:`~foresight.errors.BucketError` naming it)."""
    path = os.fspath(path)
    if is_bucket_url(path):
        return mirror_prefix(path, resolve_cache_dir(path), marker=PLAN_JSON, what="plan")
    return path


def save_plan(plan: Any, path: str, *, overwrite: bool = False) -> str:
    """Write ``plan`` to the directory ``path``: files go to a temp dir beside it, are fsynced,
    then the dir is renamed into place, so a crash never leaves a half-written plan at ``path`` (an overwrite that
    crashed between its two renames leaves the old plan aside: the next save or load renames it back).

    ``s3://bucket/prefix``: written so into its place in the bucket cache, then uploaded with ``plan.json`` last
    (an existing plan there is refused unless ``overwrite``); ``plan.path`` is the local copy, returned."""
    if is_bucket_url(path):
        return publish_prefix(path, resolve_cache_dir(path), lambda local: save_plan(plan, local, overwrite=True),
                              marker=PLAN_JSON, what="plan", overwrite=overwrite)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    _recover(path)
    if os.path.lexists(path) and not overwrite:
        raise PlanError("plan directory already exists (pass overwrite=True to replace it)", path=path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    current = tmp
    try:
        for name, dtype in plan.array_dtypes.items():  # each plan kind names its arrays
            current = os.path.join(tmp, name + ".npy")
            with open(current, "wb") as f:
                np.save(f, np.asarray(plan.arrays[name]).astype(dtype, copy=False), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
        doc = dict(plan.header(), digest=plan.digest)
        current = os.path.join(tmp, PLAN_JSON)
        with open(current, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        current = tmp
        write_sources(tmp, getattr(plan, "source_locations", None))  # outside the digest: machine-specific
        fsync_dir(tmp)
        os.chmod(tmp, 0o755)
        current = path
        if os.path.lexists(path):
            aside = aside_path(path)  # a crash before the next rename: load_plan renames it back
            os.rename(path, aside)
            os.rename(tmp, path)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, path)
        fsync_dir(parent)
    except OSError as e:
        # np.save reports a short write ("N requested and M written") with no errno and no file name: tell a full
        # disk apart (no free blocks left), name the file, and say that nothing was left behind
        code = e.errno
        if code is None:
            try:
                code = errno.ENOSPC if os.statvfs(parent).f_bavail == 0 else errno.EIO
            except OSError:
                code = errno.EIO
        shutil.rmtree(tmp, ignore_errors=True)
        reason = os.strerror(code) + ("" if e.errno is not None else f" ({e})")
        raise OSError(code, f"{reason}; the plan {path} was not written (its partial files were removed)",
                      current) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    plan.path = path
    return path


def _recover(path: str) -> None:
    """Finish an overwrite that crashed between its two renames (earlier versions kept the old plan in
    ``.NAME.old-XXXXXXXX/plan``)."""
    recover_overwrite(path, lambda d: os.path.isfile(os.path.join(d, PLAN_JSON)), legacy_inner="plan")


class _Bad(Exception):
    pass


def _field(obj: Any, key: str, kinds: tuple, where: str, *, optional: bool = False) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise _Bad(f"{where}.{key} is missing")
    value = obj[key]
    if value is None and optional:
        return None
    ok = any(
        (k is int and isinstance(value, int) and not isinstance(value, bool))
        or (k is float and isinstance(value, numbers.Real) and not isinstance(value, bool))
        or (k not in (int, float) and isinstance(value, k))
        for k in kinds
    )
    if not ok:
        raise _Bad(f"{where}.{key} has the wrong type ({type(value).__name__})")
    return value


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise _Bad(message)


PLAN_KEYS = ("format", "format_version", "digest", "inputs", "summary", "arrays")


def _check_envelope(doc: Any, format_name: str, versions: Collection[int],
                    unsupported: Callable[[int], str]) -> tuple[int, str, dict, dict, dict]:
    """The plan.json envelope both plan kinds share: an object of exactly :data:`PLAN_KEYS`, of ``format_name``, a
    ``format_version`` in ``versions`` (else ``unsupported(version)`` is the message), a sha256 digest, and the
    inputs, summary and arrays objects. Returns (version, digest, inputs, summary, arrays); raises ``_Bad`` (the
    caller names the file).

    Example::

        version, digest, inputs, summary, arrays = _check_envelope(doc, FORMAT_NAME, (1,), lambda v: f"v{v}?")
    """
    _require(isinstance(doc, dict), "plan.json must hold an object")
    _require(_field(doc, "format", (str,), "plan") == format_name, "not a foresight plan (format)")
    version = _field(doc, "format_version", (int,), "plan")
    _require(version in versions, unsupported(version))
    digest = _field(doc, "digest", (str,), "plan")
    _require(bool(_DIGEST_RE.fullmatch(digest)), "digest is not 'sha256:' + 64 hex digits")
    inputs = _field(doc, "inputs", (dict,), "plan")
    summary = _field(doc, "summary", (dict,), "plan")
    arrays = _field(doc, "arrays", (dict,), "plan")
    extra = set(doc) - set(PLAN_KEYS)
    _require(not extra, f"unexpected keys {sorted(extra)}")
    return version, digest, inputs, summary, arrays


def _load_array(path: str, name: str, spec: dict[str, Any]) -> np.ndarray:
    file = os.path.join(path, name + ".npy")
    if not os.path.isfile(file):
        raise FormatError("plan array file is missing", path=file)
    try:
        arr = np.load(file, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001  numpy raises ValueError/OSError/EOFError/SyntaxError... on bad headers
        raise FormatError(f"unreadable .npy file: {type(e).__name__}: {e}", path=file) from None
    if not isinstance(arr, np.ndarray) or arr.dtype.str != spec["dtype"] or arr.ndim != 1:
        raise FormatError(f"{name} must be a 1-D {spec['dtype']} array", path=file,
                          dtype=getattr(arr, "dtype", None), shape=getattr(arr, "shape", None))
    if list(arr.shape) != spec["shape"]:
        raise FormatError(f"{name} has the wrong length", path=file, expected=spec["shape"][0], actual=arr.shape[0])
    return arr
