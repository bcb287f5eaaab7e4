"""A checkpoint tier in a bucket (``s3://bucket/prefix``): drained copies, commit order, retention, restore.

Each commit is its own set of objects, ``<prefix>/step-00000100.seq-00000007/`` holding the local copy's
``data-*.bin`` and ``index.json`` and, written last, ``COMMIT``. Objects are only ever created and deleted, never
overwritten, so a re-save of a step (a rollback) never touches the objects of the commit it supersedes. The drain
(:meth:`BucketTier.upload`) sends every data object and the index as multipart uploads (parts and objects
concurrently), checks each one's size and ETag with a HEAD, and only then puts the COMMIT marker: the local
marker's fields plus ``objects`` (each object's size and ETag), under its own xxh3. A set without COMMIT (an upload
cut short) is never a commit; a COMMIT whose objects are missing or differ from what it records (a torn set) is
listed with ``error`` set, so ``load("latest")`` passes over it with a warning and never restores it.

Retention (:meth:`BucketTier.retain`) deletes the oldest commits beyond ``keep`` (commit order, as on disk) and,
given ``max_age_s``, those whose COMMIT is older than that, COMMIT first so that a crash mid-delete leaves an
uncommitted set, never a torn commit; the newest commit is never deleted. Sets without COMMIT older than the newest
commit (uploads a crash cut short, deletes cut short) are deleted with it. :func:`expired` and :func:`delete_set`
are that policy and that order, shared with the replicas of a bucket evaluation site
(:mod:`foresight.replication.bucket_site`).
Restore (:meth:`BucketTier.read_checkpoint`) reads the index and each data object through the ranged fetcher
(coalesced, concurrent GETs pinned to the recorded ETags) and checks every tensor's xxh3, as from disk.

One Checkpointer writes a bucket prefix at a time (object stores have no ``flock``; nothing enforces it).

Example::

    tier = BucketTier("s3://ckpt/run1")
    tier.upload("/nvme/ckpt/step-00000100", 100)      # data and index, then COMMIT
    tier.commits()[-1]                                # Commit(step=100, seq=7, path="s3://ckpt/run1/step-...")
    tensors, index = tier.read_checkpoint(tier.commits()[-1])
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from foresight.bucket.fetch import ObjectRef
from foresight.bucket.multipart import abort_left_open
from foresight.bucket.objects import BucketPrefix
from foresight.bucket.url import is_bucket_url
from foresight.checkpoint import store
from foresight.checkpoint.reader import index_columns, tensor_views, verify_and_copy
from foresight.errors import BucketError, CheckpointError

__all__ = ["BucketTier", "commit_name", "delete_set", "is_commit_name", "expired", "is_bucket_url"]

_COMMIT_RE = re.compile(r"^step-(\d+)\.(?:seq-(\d+)|unsequenced)$")


def commit_name(step: int, seq: int | None) -> str:
    """The key prefix of one commit: ``step-00000100.seq-00000007``."""
    return f"{store.step_name(step)}." + ("unsequenced" if seq is None else f"seq-{seq:08d}")


def is_commit_name(name: str) -> bool:
    """Whether ``name`` is a commit's key prefix (:func:`commit_name`'s form)."""
    return _COMMIT_RE.match(name) is not None


def expired(ordered: Sequence[Any], keep: int | None, max_age_s: float | None,
            modified: Callable[[Any], float | None], now: float | None = None) -> list[Any]:
    """The commits of ``ordered`` (oldest first) a retention policy deletes: those beyond the newest ``keep`` and,
    given ``max_age_s``, those whose marker (``modified(c)``: the server's time, epoch s) is at least that old;
    never the newest. ``keep`` and ``max_age_s`` None: none.

    >>> expired(["a", "b", "c"], 1, None, lambda c: None)
    ['a', 'b']
    """
    now = time.time() if now is None else now
    cut = len(ordered) - max(1, keep) if keep is not None else 0
    out = []
    for i, c in enumerate(ordered[:-1]):
        t = modified(c) if max_age_s is not None else None
        if i < cut or (t is not None and now - t >= max_age_s):
            out.append(c)
    return out


def delete_set(objects: BucketPrefix, name: str, objs: Sequence[str], marker: str) -> None:
    """Delete the object set ``name/`` (``objs``: its object names), its ``marker`` first: a crash mid-delete
    leaves an uncommitted set (deleted by the next retention), never a commit missing objects."""
    if marker in objs:
        objects.delete([f"{name}/{marker}"])
    rest = [f"{name}/{n}" for n in objs if n != marker]
    if rest:
        objects.delete(rest)


class BucketTier:
    """The checkpoints under one bucket URL; ``bucket_options`` go to
    :class:`~foresight.bucket.objects.BucketPrefix` (``options``, ``retry``, ``part_bytes``, ...)."""

    def __init__(self, root: str, *, objects: BucketPrefix | None = None, **bucket_options: Any) -> None:
        self.root = root
        self._owned = objects is None  # ``objects``: a client of this very prefix, shared (closed by its owner)
        self._options = bucket_options.get("options")  # endpoint and keys, for the multipart calls of a drain
        self.objects = BucketPrefix(root, **bucket_options) if objects is None else objects
        # commit name -> its verified marker, as last listed; replaced whole, never mutated (the drain thread lists
        # while a load on another thread reads)
        self._markers: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        if self._owned:
            self.objects.close()

    def __enter__(self) -> "BucketTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- listing -----------------------------------------------------------------------------------------------
    def _sets(self) -> dict[str, dict[str, ObjectRef]]:
        """Every commit-shaped object set under the prefix: commit name -> {object name: ref}."""
        sets: dict[str, dict[str, ObjectRef]] = {}
        for name, ref in self.objects.list().items():
            head, _, rest = name.partition("/")
            if rest and _COMMIT_RE.match(head):
                sets.setdefault(head, {})[rest] = ref
        return sets

    def commits(self, sets: dict[str, dict[str, ObjectRef]] | None = None) -> list[store.Commit]:
        """The commits in the bucket, oldest first; those whose marker is unreadable or whose objects are missing
        or differ from what the marker records come last, with ``error`` set. ``sets``: a listing just made."""
        sets = self._sets() if sets is None else sets
        names = sorted(n for n, objs in sets.items() if store.COMMIT in objs)
        markers = self.objects.fetcher.map(lambda n: self._read_marker(n, sets[n]), names)
        good, bad = [], []
        listed: dict[str, dict[str, Any]] = {}
        for name, got in zip(names, markers):
            if got is None:  # deleted since the listing (retention): no longer a commit
                continue
            m = _COMMIT_RE.match(name)
            step = int(m.group(1))
            path = str(self.objects.url.child(name))
            if isinstance(got, CheckpointError):
                bad.append(store.Commit(step, None, path, got))
            else:
                listed[name] = got
                good.append(store.Commit(step, got.get("seq"), path))
        self._markers = listed
        return sorted(good, key=lambda c: c.order) + sorted(bad, key=lambda c: c.step)

    def _read_marker(self, name: str, objs: dict[str, ObjectRef]) -> dict[str, Any] | CheckpointError | None:
        """The verified marker of commit ``name``, the CheckpointError saying why it is not a usable commit, or
        None when the marker is gone since the listing (a retention deleting the commit, marker first)."""
        marker_url = str(self.objects.url.child(f"{name}/{store.COMMIT}"))
        try:
            marker = store.parse_marker(self.objects.get(objs[store.COMMIT]), marker_url)
        except CheckpointError as e:
            return e
        except BucketError as e:
            if e.reason != "not_found":
                raise
            return None
        m = _COMMIT_RE.match(name)
        seq = None if m.group(2) is None else int(m.group(2))
        recorded = marker.get("objects")
        if marker.get("step") != int(m.group(1)) or marker.get("seq") != seq or not isinstance(recorded, dict):
            return CheckpointError("COMMIT marker does not belong to its commit (step, seq or object list)",
                                   path=marker_url)
        for obj, want in recorded.items():
            there = objs.get(obj)
            if there is None or there.size != want.get("size") or (want.get("etag") and there.etag != want["etag"]):
                what = "missing" if there is None else f"{there.size} bytes, ETag {there.etag}"
                return CheckpointError(f"torn object set: {obj} is {what}, COMMIT records {want.get('size')} "
                                       f"bytes, ETag {want.get('etag')}", path=str(self.objects.url.child(name)))
        return marker

    def steps(self) -> list[int]:
        return sorted({c.step for c in self.commits() if c.error is None})

    def holds_commit(self, step: int, marker: dict[str, Any]) -> bool:
        """Whether this very commit (same seq and index) is already complete in the bucket."""
        name = commit_name(step, marker.get("seq"))
        if name not in self._markers:
            self.commits()
        there = self._markers.get(name)
        return there is not None and there["index_xxh3"] == marker["index_xxh3"]

    # -- drain ---------------------------------------------------------------------------------------------------
    def upload(self, src: str, step: int) -> str:
        """Upload the committed local checkpoint directory ``src``: every data object and the index (multipart,
        concurrently; each checked by size and ETag), then its COMMIT marker. Returns the commit's URL."""
        marker = store.read_marker(src)
        name = commit_name(step, marker.get("seq"))
        files = sorted(n for n in os.listdir(src) if n != store.COMMIT)

        def put(fname: str) -> tuple[str, dict[str, Any]]:
            ref = self.objects.put(f"{name}/{fname}", os.path.join(src, fname))
            return fname, {"size": ref.size, "etag": ref.etag}

        objects = dict(self.objects.fetcher.map(put, files))
        self.objects.put(f"{name}/{store.COMMIT}", store.sealed_marker(marker, objects=objects))
        self._markers = {**self._markers, name: dict(marker, objects=objects)}
        # a create retried after its reply was lost left an upload open (empty): the commit is whole, abort it
        abort_left_open(self.objects.fetcher, [f"{name}/{f}" for f in files], under=f"{name}/",
                        options=self._options)
        return str(self.objects.url.child(name))

    def retain(self, keep: int | None, *, max_age_s: float | None = None, now: float | None = None) -> list[int]:
        """Delete the oldest commits beyond the newest ``keep`` and those whose COMMIT is ``max_age_s`` old (never
        the newest, never one whose marker is unreadable: :func:`expired`), and the uncommitted sets older than
        the newest commit. Returns the steps deleted."""
        sets = self._sets()
        ordered = [c for c in self.commits(sets) if c.error is None]
        doomed = expired(ordered, keep, max_age_s, lambda c: sets[_leaf(c)][store.COMMIT].modified, now)
        newest_seq = ordered[-1].seq if ordered and ordered[-1].seq is not None else -1
        for c in doomed:
            name = _leaf(c)
            delete_set(self.objects, name, list(sets.get(name, {})), store.COMMIT)
            self._markers = {k: v for k, v in self._markers.items() if k != name}
        for name, objs in sets.items():
            m = _COMMIT_RE.match(name)
            if store.COMMIT not in objs and m.group(2) is not None and int(m.group(2)) < newest_seq:
                self.objects.delete([f"{name}/{n}" for n in objs])
        return [c.step for c in doomed]

    # -- restore -------------------------------------------------------------------------------------------------
    def read_checkpoint(self, commit: store.Commit, *, verify: bool = True,
                        targets: Callable[[dict[str, Any]], dict[int, torch.Tensor]] | None = None,
                        ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Read a commit listed by :meth:`commits`; return (tensors in index order, index), as
        :func:`~foresight.checkpoint.reader.read_checkpoint` does from disk. Each data object is fetched in
        coalesced, concurrent ranged GETs pinned to the ETag its COMMIT records."""
        name = commit.path.rsplit("/", 1)[1]
        marker = self._markers.get(name)
        if marker is None:
            raise CheckpointError("checkpoint is not committed in the bucket", path=commit.path)
        recorded = marker["objects"]
        url = self.objects.url

        def ref(obj: str) -> ObjectRef:
            if obj not in recorded:
                raise CheckpointError("object missing from the COMMIT marker's list", path=f"{commit.path}/{obj}")
            return ObjectRef(url.child(f"{name}/{obj}"), int(recorded[obj]["size"]), recorded[obj].get("etag"))

        index_path = f"{commit.path}/{store.INDEX}"
        index = store.check_index(self.objects.get(ref(store.INDEX)), marker, index_path,
                                  f"{commit.path}/{store.COMMIT}")
        offsets, nbytes, file_ids, expected, dtypes = index_columns(index, index_path)
        wanted = targets(index) if targets is not None else None
        regions: list[np.ndarray] = []
        for f in index["files"]:
            obj = ref(f["name"])
            size_needed = int(f["bytes"])
            if obj.size < size_needed:
                raise CheckpointError("data object is truncated", path=str(obj.url), expected=size_needed,
                                      size=obj.size)
            # the whole file is one extent: the fetcher splits it into concurrent GETs of max_transfer each
            got = self.objects.fetch(obj, np.array([0]), np.array([size_needed])) if size_needed else None
            regions.append(got.region if got is not None else np.empty(0, np.uint8))
        buffers = [torch.from_numpy(r) for r in regions]
        tensors = tensor_views(buffers, index, file_ids, offsets, nbytes, dtypes, commit.path)
        for fi, f in enumerate(index["files"]):
            ids = np.flatnonzero(file_ids == fi)
            if len(ids):
                verify_and_copy(ids, memoryview(regions[fi]), offsets, nbytes, expected, tensors, wanted, verify,
                                f"{commit.path}/{f['name']}", index["tensors"]["name"])
        return tensors, index


def _leaf(c: store.Commit) -> str:
    return c.path.rsplit("/", 1)[1]


def open_tiers(roots: list[str], bucket_options: dict[str, Any] | None = None) -> dict[str, BucketTier]:
    """A :class:`BucketTier` for each ``s3://`` root of ``roots`` (closed by the caller); BucketError as one line
    naming the bucket when one cannot be listed (missing bucket, wrong keys)."""
    tiers: dict[str, BucketTier] = {}
    try:
        for root in roots:
            if is_bucket_url(root) and root not in tiers:
                tiers[root] = BucketTier(root, **(bucket_options or {}))
    except BaseException:
        close_tiers(tiers)
        raise
    return tiers


def close_tiers(tiers: dict[str, BucketTier]) -> None:
    for tier in tiers.values():
        tier.close()


def tier_commits(root: str, buckets: dict[str, BucketTier]) -> list[store.Commit]:
    """The commits of a tier root, a directory or a bucket (one of ``buckets``)."""
    return buckets[root].commits() if root in buckets else store.commits(root)


READ_ERRORS = (CheckpointError, BucketError)  # what a restore from either kind of tier raises for a bad copy
