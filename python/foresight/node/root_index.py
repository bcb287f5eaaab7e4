"""What a node's data root holds -- datasets (``manifest.json``) and plans (``plan.json``) -- kept current by cheap
rescans: a walk that stats each manifest and re-reads (and re-hashes) only those whose stat changed.

A dataset's fingerprint is the xxh3-128 of its manifest, which holds the xxh3 of every shard and map, so a dataset
added, removed or repacked in place shows as a name appearing, disappearing or changing fingerprint. The node
rescans every ``--rescan-s`` seconds and whenever a job registers a dataset it does not know or whose manifest
changed since the last scan (one ``stat`` per named dataset).

Example::

    index = RootIndex("/data")
    index.datasets                      # {"media": {"fingerprint": "...", "shards": 3}}
    changes = index.rescan()            # Changes(added={...}, removed={...}, changed={name: (old, new)})
    index.stale(["media"])              # True when media/manifest.json changed since the last scan
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field

import xxhash

MANIFEST = "manifest.json"


def _stat_key(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def scan_root(root: str, depth: int = 3, cache: dict | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """Datasets and plans under ``root``: ``{name: {fingerprint, shards}}`` and ``{digest: name}``, names relative
    to ``root``. ``cache`` (``{manifest path: (stat key, info)}``, updated here) spares re-reading unchanged
    manifests."""
    datasets, plans = {}, {}
    root = os.path.realpath(root)
    seen = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.count(os.sep) >= depth:
            dirnames[:] = []
        if rel == ".":
            continue
        if MANIFEST in filenames:
            path = os.path.join(dirpath, MANIFEST)
            key = _stat_key(path)
            hit = None if cache is None else cache.get(path)
            info = hit[1] if hit is not None and hit[0] == key else _manifest_info(path)
            if cache is not None:
                cache[path] = (key, info)
                seen.add(path)
            if info is not None:
                datasets[rel] = info
            dirnames[:] = []
        elif "plan.json" in filenames:
            try:
                with open(os.path.join(dirpath, "plan.json"), "rb") as f:
                    digest = json.loads(f.read(16 << 20)).get("digest")
                if isinstance(digest, str):
                    plans[digest] = rel
            except (OSError, ValueError, AttributeError):
                pass  # not a plan this node can serve; it stays unlisted
            dirnames[:] = []
    if cache is not None:
        for gone in set(cache) - seen:
            del cache[gone]
    return datasets, plans


def _manifest_info(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(256 << 20)
    except OSError:
        return None  # unreadable: not a dataset yet
    return manifest_info(raw)


def manifest_info(raw: bytes) -> dict | None:
    """``{fingerprint, shards}`` of a manifest's bytes (the fingerprint a dataset opened from them has); None when
    they do not parse (half-written: a pack in progress)."""
    try:
        return {"fingerprint": xxhash.xxh3_128_hexdigest(raw), "shards": len(json.loads(raw).get("shards", []))}
    except (ValueError, AttributeError):
        return None


@dataclass
class Changes:
    added: dict = field(default_factory=dict)     # name -> fingerprint
    removed: dict = field(default_factory=dict)   # name -> fingerprint
    changed: dict = field(default_factory=dict)   # name -> (old fingerprint, new fingerprint)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


class RootIndex:
    """See the module docstring; thread-safe. A rescan replaces ``datasets`` and ``plans`` (it does not mutate
    them), so a reader holding one sees a consistent view."""

    def __init__(self, root: str, depth: int = 3) -> None:
        self.root = os.path.realpath(root)
        self.depth = depth
        self._cache: dict = {}
        self._lock = threading.Lock()
        self.datasets, self.plans = self._scan()

    def _scan(self) -> tuple[dict[str, dict], dict[str, str]]:
        """``(datasets, plans)`` as they are now (a subclass reads another kind of root)."""
        return scan_root(self.root, self.depth, self._cache)

    def rescan(self) -> Changes:
        with self._lock:
            datasets, plans = self._scan()
            old, self.datasets, self.plans = self.datasets, datasets, plans
        fp = {n: d["fingerprint"] for n, d in datasets.items()}
        was = {n: d["fingerprint"] for n, d in old.items()}
        return Changes(added={n: f for n, f in fp.items() if n not in was},
                       removed={n: f for n, f in was.items() if n not in fp},
                       changed={n: (was[n], f) for n, f in fp.items() if n in was and was[n] != f})

    def stale(self, names: list[str]) -> bool:
        """True when one of the dataset ``names`` is unknown or its manifest changed since the last scan."""
        for name in names:
            path = os.path.join(self.root, name, MANIFEST)
            hit = self._cache.get(path)
            if name not in self.datasets or hit is None or hit[0] != _stat_key(path):
                return True
        return False


__all__ = ["Changes", "RootIndex", "manifest_info", "scan_root"]
