"""A storage node over a bucket: the data root is ``s3://bucket/prefix``, read through the cache tier.

:class:`BucketRootIndex` is :class:`~foresight.node.root_index.RootIndex` over a bucket: one listing of the prefix
finds every ``<name>/manifest.json`` (names as under a local root, at most ``depth + 1`` parts, none hidden), each
manifest is fetched once per ETag and fingerprinted as a local one is (so a client holding the local copy finds
its dataset by the same fingerprint). A plan directory in the bucket (``<name>/plan.json`` and its arrays) is
copied into the local root once per version of its objects and listed by digest like an uploaded one. Datasets
open through :func:`foresight.open_dataset` with the cache directory, as ``cache_dir/bucket/prefix/<name>``; the
node's local root (plans, the datasets' caches) is ``cache_dir/bucket/prefix`` (under the endpoint's own place when
an endpoint is set: :func:`~foresight.bucket.dataset.local_dir_of`). A missing bucket or wrong keys
fail the first listing: the node does not start, with one line naming the bucket (and never a secret).

:class:`JobPrefetch` drives one :class:`~foresight.bucket.prefetch.PlanPrefetcher` per bucket dataset of a job
over the job's rank share from the step it registered at, limited to the samples the node reads for the job (the
shards it serves, the modalities the job decodes; :meth:`~foresight.node.jobs.NodeJob.node_samples`). The node
reports each step its client has taken (:meth:`JobPrefetch.advance`: a step served or reported as progress, which
the node never reads again), so the bytes of the ``lookahead`` steps after it are fetched (coalesced,
block-filled) before the node's queue prepares them (``lookahead`` is above the job's lead: every step the queue
may be reading is pinned under a budget), and under a budget what the plan needs furthest in the future is
evicted first.

Example::

    index = BucketRootIndex("s3://data/root", "/nvme/cache")
    index.datasets                        # {"media": {"fingerprint": "...", "shards": 3}}
    ds = index.open("media")              # a BucketDataset under /nvme/cache/data/root/media
    pf = JobPrefetch(job, start_step=0, lookahead=8, budget_bytes=None)
    pf.advance(step)                      # the client took step: fetch on ahead
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

from foresight._closing import Closing
from foresight.bucket import BucketDataset, BucketURL, ObjectRef, RangedFetcher, RetryPolicy
from foresight.bucket.config import open_store
from foresight.bucket.dataset import local_dir_of
from foresight.bucket.opener import open_dataset
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.errors import BucketError, ProtocolError
from foresight.node.plans import is_plan_file
from foresight.node.root_index import MANIFEST, Changes, RootIndex, manifest_info, scan_root
from foresight.plan.files import PLAN_JSON

log = logging.getLogger("foresight.node")

__all__ = ["BucketRootIndex", "JobPrefetch", "bucket_status"]


class BucketRootIndex(RootIndex):
    """See the module docstring. ``options``/``retry`` are the bucket's (:func:`open_bucket_dataset`'s)."""

    def __init__(self, url: str, cache_dir: str | os.PathLike, *, options: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy(), depth: int = 3) -> None:
        self.url = BucketURL.parse(url)
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.options, self.retry = options, retry
        self._manifests: dict[str, tuple[str | None, dict | None]] = {}  # dataset name -> (ETag, info)
        self._plans: dict[str, list] = {}  # plan directory -> its objects (name, ETag, size) as copied
        self.failed_scans = 0
        self._fetcher = RangedFetcher(open_store(self.url, options), self.url, concurrency=8, retry=retry)
        try:
            local = local_dir_of(self.url, self.cache_dir, options)
            os.makedirs(local, exist_ok=True)
            super().__init__(local, depth)
        except BaseException:
            self._fetcher.close()
            raise

    def _scan(self) -> tuple[dict[str, dict], dict[str, str]]:
        skip = len(self.url.prefix) + 1 if self.url.prefix else 0
        found: dict[str, ObjectRef] = {}
        plan_files: dict[str, dict[str, ObjectRef]] = {}  # directory -> {file name: object} of plan-like files
        for ref in self._fetcher.list():
            parts = ref.key[skip:].split("/")
            if not 2 <= len(parts) <= self.depth + 2 or any(p.startswith(".") or not p for p in parts[:-1]):
                continue
            if parts[-1] == MANIFEST:
                found["/".join(parts[:-1])] = ref
            elif is_plan_file(parts[-1]):
                plan_files.setdefault("/".join(parts[:-1]), {})[parts[-1]] = ref
        self._mirror_plans({d: files for d, files in plan_files.items() if PLAN_JSON in files and d not in found})
        # a dataset inside another's directory is not one (a local scan stops at the first manifest too)
        names = [n for n in sorted(found) if not any(n.startswith(f"{o}/") for o in found if o != n)]
        new = [n for n in names if self._manifests.get(n, (None,))[0] != found[n].etag or found[n].etag is None]
        infos = self._fetcher.map(lambda n: manifest_info(self._fetcher.get_whole(found[n])), new)
        manifests = {n: self._manifests[n] for n in names if n not in new}
        manifests.update({n: (found[n].etag, info) for n, info in zip(new, infos)})
        self._manifests = manifests
        datasets = {n: info for n, (_, info) in sorted(manifests.items()) if info is not None}
        _, plans = scan_root(self.root, self.depth, self._cache)  # plans: uploaded by clients, kept locally
        return datasets, plans

    def _mirror_plans(self, plan_dirs: dict[str, dict[str, ObjectRef]]) -> None:
        """Copy each plan directory of the bucket into the local root (again when one of its objects changed), so
        the local scan lists it by digest as it lists an uploaded plan. A plan that fails to copy is logged and
        left unlisted (a half-written upload to the bucket: the next scan tries again)."""
        for rel, files in sorted(plan_dirs.items()):
            signature = sorted((name, ref.etag, ref.size) for name, ref in files.items())
            if self._plans.get(rel) == signature:
                continue
            final = os.path.join(self.root, *rel.split("/"))
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".incoming-", dir=os.path.dirname(final))
            try:
                names = sorted(files)
                for name, data in zip(names, self._fetcher.map(lambda n: self._fetcher.get_whole(files[n]), names)):
                    with open(os.path.join(tmp, name), "wb") as f:
                        f.write(data)
                if os.path.isdir(final):  # replaced in the bucket: the old copy goes (a plan open on it keeps its
                    old = tempfile.mkdtemp(prefix=".replaced-", dir=os.path.dirname(final))  # open files)
                    os.rename(final, os.path.join(old, "plan"))
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(tmp, final)
                self._plans[rel] = signature
            except BucketError as e:
                log.warning("plan in the bucket not copied; left unlisted", extra={"plan": rel, "error": str(e)})
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    def rescan(self) -> Changes:
        """As :meth:`RootIndex.rescan`; a bucket that cannot be listed now (down past the retry budget) keeps the
        last listing, with a warning and :attr:`failed_scans` counted (the start-up scan raises instead)."""
        try:
            return super().rescan()
        except BucketError as e:
            self.failed_scans += 1
            log.warning("bucket root not rescanned; the last listing stays", extra={"root": str(self.url),
                                                                                   "error": str(e)[:300]})
            return Changes()

    def stale(self, names: list[str]) -> bool:
        """True when a name is unknown or its manifest's ETag changed since the last scan (one HEAD per name)."""
        for name in names:
            if name not in self.datasets:
                return True
            try:
                etag = self._fetcher.head(f"{name}/{MANIFEST}").etag
            except OSError:
                return True  # gone (or unreachable): the rescan says which
            if etag != self._manifests[name][0]:
                return True
        return False

    def local_path(self, name: str) -> str:
        """Where dataset ``name``'s cache is (the node's key for it); ProtocolError when the bucket has none."""
        if name not in self.datasets:
            raise ProtocolError("no such dataset under the node's data root", name=name, root=str(self.url))
        return os.path.realpath(os.path.join(self.root, name))

    def open(self, name: str) -> BucketDataset:
        """Dataset ``name`` through the cache tier (its objects headed, its maps fetched: nothing of its shards)."""
        self.local_path(name)
        return open_dataset(str(self.url.child(name)), cache_dir=self.cache_dir, options=self.options,
                            retry=self.retry)

    def close(self) -> None:
        self._fetcher.close()


class JobPrefetch(Closing):
    """One :class:`PlanPrefetcher` per bucket dataset of ``job`` (a :class:`~foresight.node.jobs.NodeJob`)."""

    def __init__(self, job: Any, *, start_step: int, lookahead: int, budget_bytes: int | None) -> None:
        self.job = job.job
        self._reported: set[int] = set()
        self.prefetchers: list[tuple[int, PlanPrefetcher]] = []
        try:
            for d, ds in enumerate(job.datasets):
                if isinstance(ds, BucketDataset):
                    self.prefetchers.append((d, PlanPrefetcher(
                        ds, job.plan, dataset=d, rank=job.rank, world_size=job.world_size, start_step=start_step,
                        lookahead=lookahead, budget_bytes=budget_bytes, keep=job.node_samples(d))))
        except BaseException:
            self.close()
            raise

    def advance(self, step: int) -> None:
        """The client took ``step``: each prefetcher may fetch up to ``lookahead`` steps past it. A prefetcher
        that stopped (its error logged by it) is reported once here; the node's reads fetch on demand."""
        for d, pf in self.prefetchers:
            pf.advance(step)
            if pf.error is not None and d not in self._reported:
                self._reported.add(d)
                log.warning("bucket prefetch of a job stopped; its steps are fetched when read",
                            extra={"job": self.job, "dataset": d, "error": str(pf.error)[:300]})

    def stats(self) -> dict[str, int]:
        """The prefetchers' counters summed (``stopped``: how many ended on an error)."""
        out: dict[str, int] = {"stopped": 0}
        for _, pf in self.prefetchers:
            for k, v in pf.stats.items():
                out[k] = out.get(k, 0) + int(v)
            out["stopped"] += pf.error is not None
        return out

    def close(self) -> None:
        for _, pf in self.__dict__.get("prefetchers", []):
            pf.close()


def bucket_status(opened: dict[tuple[str, str], Any]) -> dict[str, dict]:
    """Per opened bucket dataset (by its bucket URL): the fetcher's requests, bytes and retries and the cache's
    hits, misses and evictions, as the node's ``status`` reports them."""
    out = {}
    for (kind, _), ds in list(opened.items()):
        if kind == "dataset" and isinstance(ds, BucketDataset):
            out[str(ds.url)] = dict(ds.fetcher.stats.as_dict(), **ds.cache.stats.as_dict(),
                                    cached_bytes=int(ds.cache.cached_bytes()))
    return out
