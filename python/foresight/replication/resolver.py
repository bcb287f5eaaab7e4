"""The namespace resolver: checkpoint names -> the nearest complete copy, through etcd.

Keys (etcd3 via its HTTP gateway, :mod:`etcd3gw`)::

    /foresight/ckpt/<name>/copies/<site>            {"site", "path", "endpoint", "source"}   lease = replica TTL
    /foresight/ckpt/<name>/readers/<site>/<uuid>    {"pid"}                                  lease kept alive

A copy is registered only once complete (the source after its COMMIT, a replica after it verified and was
renamed into place). :meth:`Resolver.resolve` prefers this site's copy, then the training site's source, then
any other site's. A replica's key carries a lease with its TTL; once it expired, :meth:`Resolver.reclaim` deletes
the directory, but never while a reader key for it exists at this site (a reader holds one, under a lease it
keeps alive, for as long as it reads: a crashed reader releases it within the TTL).

Example::

    with Resolver("http://127.0.0.1:2379", site="eval-b") as res:
        with res.open("job/step-00001000") as (loc, source):   # loc.local: read from this site
            merge_checkpoint(source, "/eval/merged")
        res.reclaim("/eval/replicas")
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from foresight.checkpoint import store
from foresight.checkpoint.checkpointer import load
from foresight.checkpoint.dcp_reader import ForesightStorageReader
from foresight.checksum import xxh3_many
from foresight.errors import CheckpointError, NodeError
from foresight.replication.source import LocalSource, RemoteSource
from foresight.replication.units import DCP_METADATA, ReplicaBuilder, check_name, plan_units

PREFIX = "/foresight/ckpt/"
READER_TTL = 10


def etcd_client(endpoint: str) -> Any:
    """An etcd3gw client whose calls raise :class:`NodeError` ("etcd unreachable", naming the endpoint) when etcd is
    down or restarting, as the cluster layer's calls do, instead of etcd3gw's own exceptions (which a node reported
    as an internal error, and its callers could not tell from a bug)."""
    import etcd3gw

    u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return _EtcdErrors(etcd3gw.client(host=u.hostname or "127.0.0.1", port=u.port or 2379,
                                      protocol=u.scheme or "http", timeout=10), endpoint)


class _EtcdErrors:
    """See :func:`etcd_client`: every method of the wrapped client, its failures as :class:`NodeError`."""

    def __init__(self, client: Any, endpoint: str) -> None:
        self._client, self._endpoint = client, endpoint

    def __getattr__(self, name: str) -> Any:
        from etcd3gw.exceptions import Etcd3Exception

        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Etcd3Exception as e:
                raise NodeError(f"etcd unreachable: {type(e).__name__} {e}".strip(), endpoint=self._endpoint,
                                call=name) from e

        return call


def is_complete(path: str) -> bool:
    return store.is_committed(path) or os.path.isfile(os.path.join(path, DCP_METADATA))


@dataclass(frozen=True)
class Location:
    name: str
    site: str
    path: str
    endpoint: str
    local: bool


class Resolver:
    """Registers, finds, holds and reclaims checkpoint copies for one ``site``."""

    def __init__(self, etcd: str, *, site: str) -> None:
        self.site = site
        self._etcd = etcd_client(etcd)

    def close(self) -> None:
        session = getattr(self._etcd, "session", None)
        if session is not None:
            session.close()

    def __enter__(self) -> Resolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- copies ----------------------------------------------------------------------------------
    def register(self, name: str, path: str, endpoint: str, *, ttl: int | None = None, source: bool = False) -> None:
        """Publish a complete copy of ``name`` at this site (under a lease of ``ttl`` seconds if given)."""
        check_name(name)
        if not is_complete(path):
            raise CheckpointError("refusing to register an incomplete checkpoint", path=path, name=name)
        lease = self._etcd.lease(ttl) if ttl else None
        value = json.dumps({"site": self.site, "path": path, "endpoint": endpoint, "source": source})
        self._etcd.put(f"{PREFIX}{name}/copies/{self.site}", value, lease=lease)

    def unregister(self, name: str) -> None:
        self._etcd.delete(f"{PREFIX}{check_name(name)}/copies/{self.site}")

    def copies(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(v) for v, _ in self._etcd.get_prefix(f"{PREFIX}{check_name(name)}/copies/")]

    def resolve(self, name: str) -> Location:
        """The nearest complete copy: this site's, else the source, else any; CheckpointError if none."""
        copies = self.copies(name)
        mine = [c for c in copies if c["site"] == self.site and is_complete(c["path"])]
        others = sorted((c for c in copies if c["site"] != self.site), key=lambda c: not c.get("source"))
        for c in mine + others:
            return Location(name, c["site"], c["path"], c["endpoint"], c["site"] == self.site)
        raise CheckpointError("no complete copy of the checkpoint is registered", name=name, site=self.site)

    # -- readers ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[Location]:
        """Resolve ``name`` and keep this site's copy from being reclaimed until the block ends."""
        key = f"{PREFIX}{check_name(name)}/readers/{self.site}/{uuid.uuid4().hex}"
        lease = self._etcd.lease(READER_TTL)
        self._etcd.put(key, json.dumps({"pid": os.getpid()}), lease=lease)  # before resolving: see reclaim
        stop = threading.Event()

        def keep_alive() -> None:
            while not stop.wait(READER_TTL / 3):
                try:
                    lease.refresh()
                except Exception:  # noqa: BLE001 - etcd briefly unreachable: try again next period
                    pass

        t = threading.Thread(target=keep_alive, name="foresight-reader-lease", daemon=True)
        t.start()
        try:
            yield self.resolve(name)
        finally:
            stop.set()
            t.join()
            lease.revoke()

    @contextlib.contextmanager
    def open(self, name: str, *, token: str = "") -> Iterator[tuple[Location, Any]]:
        """Hold ``name`` and yield ``(location, source)``: a local directory or the remote site's node."""
        with self.hold(name) as loc:
            if loc.local:
                yield loc, LocalSource(loc.path)
                return
            src = RemoteSource(loc.endpoint, name, token=token)
            try:
                yield loc, src
            finally:
                src.close()

    def pull(self, name: str, root: str, *, token: str = "", ttl: int | None = None) -> str:
        """A local directory holding ``name``: this site's copy, or the nearest copy fetched into ``root`` (as a
        verified replica, registered under ``ttl``). ``foresight.checkpoint.load`` and the DCP reader read it::

            path = res.pull("job/step-00001000", "/eval/replicas")
            foresight.checkpoint.load(1000, root=os.path.dirname(path))
        """
        import numpy as np

        loc = self.resolve(name)
        if loc.local:
            return loc.path
        src = RemoteSource(loc.endpoint, name, token=token)
        try:
            meta = {}
            for f in (store.INDEX, store.COMMIT, DCP_METADATA):
                try:
                    meta[f] = src.read_file(f)
                except CheckpointError:
                    pass
            rb = ReplicaBuilder(root, name)
            for f, body in meta.items():
                store.write_small_file(os.path.join(rb.tmp, f), body)
            units = plan_units(src.list_files(), 64 << 20)
            for u in units:
                region, _ = src.read_extents([u.file], np.zeros(1, np.int32), np.array([u.offset]), np.array([u.length]))
                rb.write_unit(u.header(int(xxh3_many(region, np.array([0]), np.array([u.length]))[0])), [region])
            path = rb.finalize(meta, len(units))
        finally:
            src.close()
        self.register(name, path, "", ttl=ttl)
        return path

    def load(self, name: str, root: str, *, token: str = "", **kwargs: Any) -> Any:
        """``foresight.checkpoint.load`` of ``name`` (``job/step-00001000``) from the nearest copy, pulled into
        ``root`` if this site has none; held against reclaim while it is read. ``kwargs`` go to ``load``."""
        m = re.match(r"^step-(\d+)$", name.rsplit("/", 1)[-1])
        if m is None:
            raise CheckpointError("not a foresight checkpoint name (.../step-N)", name=name)
        with self.hold(name):
            path = self.pull(name, root, token=token)
            return load(int(m.group(1)), root=os.path.dirname(path), **kwargs)

    def dcp_reader(self, name: str, root: str, *, token: str = "", **kwargs: Any) -> Any:
        """A :class:`~foresight.checkpoint.dcp_reader.ForesightStorageReader` over the nearest copy of ``name`` (pulled
        into ``root`` if this site has none)."""
        return ForesightStorageReader(self.pull(name, root, token=token), **kwargs)

    def readers(self, name: str) -> int:
        return len(self._etcd.get_prefix(f"{PREFIX}{check_name(name)}/readers/{self.site}/"))

    # -- reclaim ---------------------------------------------------------------------------------
    def reclaim(self, root: str, *, stale_after: float = 24 * 3600) -> list[str]:
        """Delete replicas under ``root`` (``<job>/<step>``) whose copy key expired and that no reader holds, and
        hidden leftovers (a cut transfer's ``.replica-*`` not resumed for ``stale_after`` seconds, ``.trash-*``)."""
        removed = []
        for job in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            jdir = os.path.join(root, job)
            if job.startswith(".") or not os.path.isdir(jdir):
                continue
            for leaf in sorted(os.listdir(jdir)):
                path = os.path.join(jdir, leaf)
                if leaf.startswith((".replica-", ".trash-")):
                    try:
                        idle = time.time() - os.stat(path).st_mtime
                    except FileNotFoundError:
                        continue
                    if leaf.startswith(".trash-") or idle > stale_after:
                        shutil.rmtree(path, ignore_errors=True)
                        removed.append(f"{job}/{leaf}")
                    continue
                if leaf.startswith(".") or not is_complete(path):
                    continue
                name = f"{job}/{leaf}"
                if any(c["site"] == self.site for c in self.copies(name)) or self.readers(name):
                    continue
                trash = os.path.join(jdir, f".trash-{leaf}.{uuid.uuid4().hex[:8]}")
                os.rename(path, trash)  # first, so a half-deleted replica never looks complete
                shutil.rmtree(trash, ignore_errors=True)
                removed.append(name)
        return removed
