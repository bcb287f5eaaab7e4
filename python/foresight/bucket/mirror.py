"""A small directory of objects under a bucket prefix (a plan) kept whole in the local cache: fetched once, reused
while its marker object is unchanged, and published from there.

``mirror_prefix(url, cache_dir, marker="plan.json")`` fetches every object directly under ``url`` into
``cache_dir/bucket/prefix`` (the place :func:`~foresight.bucket.dataset.local_dir_of` gives a bucket dataset: under
the endpoint's own directory when an endpoint is set) and
returns that directory. Beside it, ``.NAME.foresight-mirror.json`` records the marker's ETag: the next call heads the
marker alone and reuses the copy when the ETag is the same (one request), else fetches the whole prefix again into
a temporary directory renamed into place. ``.NAME.foresight-mirror.lock`` makes the processes of a host fetch it
once between them. :func:`publish_prefix` is the other way: the caller writes the directory where the mirror
would be, it is uploaded with the marker last, and the mirror's record is written so no process fetches it back.

Example::

    local = mirror_prefix("s3://data/plans/p1", "/nvme/cache", marker="plan.json", what="plan")
    publish_prefix("s3://data/plans/p2", "/nvme/cache", lambda d: save_plan(plan, d, overwrite=True),
                   marker="plan.json", what="plan", overwrite=False)
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator

from foresight.errors import BucketError
from foresight.io.durable import fsync_dir

from .config import open_store
from .dataset import local_dir_of
from .fetch import ObjectRef, RangedFetcher
from .upload import refuse_existing, upload_dir
from .url import BucketURL

__all__ = ["mirror_prefix", "publish_prefix", "holds", "refuse_existing_at"]


def refuse_existing_at(url: str | BucketURL, marker: str, what: str, *,
                       options: dict[str, Any] | None = None) -> None:
    """:class:`BucketError` (reason ``exists``) when ``marker`` is already under ``url``: what a command that would
    replace a dataset or plan without ``--overwrite`` checks before its work."""
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    with RangedFetcher(open_store(url, options), url) as fetcher:
        refuse_existing(fetcher, marker, what)


def holds(url: str | BucketURL, marker: str, *, options: dict[str, Any] | None = None) -> bool:
    """Whether ``marker`` (``plan.json``) is directly under ``url``: one HEAD. False when the bucket is missing
    too; the caller's next step names that."""
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    with RangedFetcher(open_store(url, options), url) as fetcher:
        return fetcher.exists(marker)


def _side(local: str, suffix: str) -> str:
    parent, base = os.path.split(local)
    return os.path.join(parent, f".{base}.foresight-mirror.{suffix}")


@contextlib.contextmanager
def _locked(local: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with open(_side(local, "lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one process of the host fetches; the others wait, then reuse
        # temporary directories of a process killed while it held the lock (only a holder makes them)
        parent, base = os.path.split(local)
        for name in os.listdir(parent):
            if name.startswith(f".{base}.tmp-"):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        yield


def _recorded(local: str) -> dict[str, Any] | None:
    try:
        with open(_side(local, "json"), "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _intact(local: str, seen: dict[str, Any]) -> bool:
    """Whether every file the record lists is in the local copy at its recorded size (a copy cut short or
    emptied by a hand or a disk cleaner is fetched again, not opened as damaged on every load)."""
    files = seen.get("files")
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all(os.path.getsize(os.path.join(local, name)) == size for name, size in files.items())
    except (OSError, TypeError):
        return False


def _record(local: str, marker: ObjectRef, refs: list[ObjectRef]) -> None:
    path = _side(local, "json")
    files = {r.key.rsplit("/", 1)[-1]: r.size for r in refs}
    with open(f"{path}.tmp-{os.getpid()}", "w") as f:
        json.dump({"url": str(marker.url), "size": marker.size, "etag": marker.etag, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp-{os.getpid()}", path)


def _install(tmp: str, local: str) -> None:
    """Move the plain files of ``tmp`` into ``local`` (each renamed into place) and remove the plain files of the
    older copy they do not replace; then remove ``tmp``. File by file, not the directory swapped whole: ``local``
    may hold other URLs' copies (a dataset at ``s3://b/p/data`` under a plan at ``s3://b/p``: a directory) and
    their mirrors' records (dotfiles), which are left as they are."""
    os.makedirs(local, exist_ok=True)
    names = {n for n in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, n))}
    for name in os.listdir(local):
        path = os.path.join(local, name)
        if name not in names and not name.startswith(".") and (os.path.islink(path) or not os.path.isdir(path)):
            os.unlink(path)
    for name in sorted(names):
        os.replace(os.path.join(tmp, name), os.path.join(local, name))
    fsync_dir(local)
    shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(os.path.dirname(local))


def mirror_prefix(url: str | BucketURL, cache_dir: str | os.PathLike, *, marker: str, what: str,
                  options: dict[str, Any] | None = None) -> str:
    """The local copy of every object directly under ``url`` (fetched unless the recorded copy's ``marker`` ETag is
    still the bucket's). Raises :class:`BucketError` (``not_found``) naming ``url`` when it holds no ``marker``:
    "no plan.json: not a plan"."""
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    local = local_dir_of(url, cache_dir, options)
    with _locked(local), RangedFetcher(open_store(url, options), url) as fetcher:
        try:
            head = fetcher.head(marker)
        except BucketError as e:
            if e.reason != "not_found" or "bucket" in e.context:
                raise
            raise BucketError(f"no {marker} under it: not a {what} (or not uploaded completely)", "not_found",
                              object=str(url)) from None
        seen = _recorded(local)
        if seen is not None and seen.get("etag") == head.etag and seen.get("size") == head.size \
                and os.path.isfile(os.path.join(local, marker)) and _intact(local, seen):
            return local
        refs = fetcher.list(deep=False)
        names = [r.key.rsplit("/", 1)[-1] for r in refs]
        marker_ref = next((r for r, n in zip(refs, names) if n == marker), head)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(local)}.tmp-", dir=os.path.dirname(local))
        try:
            fetcher.map(lambda rn: fetcher.download(rn[0], os.path.join(tmp, rn[1])), list(zip(refs, names)))
            fsync_dir(tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_side(local, "json"))  # a copy cut short by a crash is fetched again
            _install(tmp, local)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _record(local, marker_ref, refs)
        return local


def publish_prefix(url: str | BucketURL, cache_dir: str | os.PathLike, write: Callable[[str], Any], *, marker: str,
                   what: str, overwrite: bool = False, options: dict[str, Any] | None = None) -> str:
    """``write(local_dir)`` fills the mirror's place of ``url`` under ``cache_dir``; its files are then uploaded,
    ``marker`` last (see :func:`~foresight.bucket.upload.upload_dir`: an existing one is refused unless
    ``overwrite``). Returns the local directory, recorded as the mirror of what was uploaded."""
    url = url if isinstance(url, BucketURL) else BucketURL.parse(url)
    local = local_dir_of(url, cache_dir, options)
    with _locked(local):
        if not overwrite:  # refused before the local write, which may replace a mirror of the plan already there
            refuse_existing_at(url, marker, what, options=options)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_side(local, "json"))  # the local copy is about to differ from what the bucket holds
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(local)}.tmp-", dir=os.path.dirname(local))
        try:  # written beside, then moved in file by file: another URL's copy nested in ``local`` stays
            write(os.path.join(tmp, "new"))
            _install(os.path.join(tmp, "new"), local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        refs = upload_dir(local, url, marker=marker, overwrite=overwrite, what=what, options=options)
        _record(local, refs[-1], refs)
    return local
