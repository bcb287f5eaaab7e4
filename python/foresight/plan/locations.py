"""Where a plan's datasets live: recorded beside the plan, found again when it is opened alone.

``plan.json`` names its datasets by fingerprint only (its digest must not depend on where data sits), so the
locations go to a second file, ``sources.json``, outside the digest: for each source its absolute path and its path
relative to the plan directory (so a plan moved together with its data still finds it), its kind, fingerprint mode
and fingerprint, and for a bucket dataset its ``s3://`` URL (tried last: a plan fetched from a bucket onto a host
that has not cached its datasets yet opens them through their bucket). :func:`open_plan_datasets` opens them again and checks each fingerprint; a dataset that moved is looked
up under the ``search`` directories (and ``FORESIGHT_DATA_PATH``, ``:``-separated) by fingerprint, or refused with an
error that says where it was expected and how to point at it.

Example::

    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=8, seq_len=2048, num_steps=100)
    plan.save("plan/")                       # writes plan/sources.json beside plan/plan.json
    datasets = open_plan_datasets(load_plan("plan/"))
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from foresight.bucket.config import ENDPOINT_PLACE_PREFIX
from foresight.bucket.opener import open_dataset
from foresight.errors import BucketError, FormatError, PlanError

SOURCES_JSON = "sources.json"
SEARCH_ENV = "FORESIGHT_DATA_PATH"
_SEARCH_DEPTH = 3


def describe_sources(datasets: Sequence[Any]) -> list[dict[str, Any]]:
    """What to record for each dataset a plan was built from (those without a path record none)."""
    out = []
    for ds in datasets:
        path = getattr(ds, "path", None)
        url = getattr(ds, "url", None)  # a bucket dataset: found again through its bucket on a host without its cache
        etags = getattr(ds, "object_etags", None)  # and its objects as they were: one replaced since is refused
        out.append({"path": os.path.abspath(path) if path else None, "kind": getattr(ds, "kind", None),
                    **({"url": str(url)} if url is not None else {}),
                    **({"objects": dict(etags)} if etags else {}),
                    "fingerprint_mode": getattr(ds, "fingerprint_kind", "index"),
                    "fingerprint": str(ds.fingerprint), "num_samples": int(ds.num_samples)})
    return out


def write_sources(plan_dir: str, sources: list[dict[str, Any]] | None) -> None:
    """Write ``sources.json`` into ``plan_dir`` (each path absolute and relative to the plan directory)."""
    if not sources or not any(s.get("path") for s in sources):
        return
    plan_dir = os.path.abspath(plan_dir)
    doc = [dict(s, relative=os.path.relpath(s["path"], plan_dir) if s.get("path") else None) for s in sources]
    with open(os.path.join(plan_dir, SOURCES_JSON), "w") as f:
        json.dump({"sources": doc}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_sources(plan_dir: str) -> list[dict[str, Any]] | None:
    """The recorded locations, or None for a plan saved without them. Malformed files raise FormatError."""
    path = os.path.join(plan_dir, SOURCES_JSON)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
        sources = doc["sources"]
        if not isinstance(sources, list) or not all(isinstance(s, dict) and isinstance(s.get("fingerprint"), str)
                                                    for s in sources):
            raise ValueError("sources must be a list of objects with a fingerprint")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FormatError(f"malformed dataset locations: {e}", path=path) from e
    return sources


def _open(path: str, mode: str):
    return open_dataset(path, fingerprint=mode if mode in ("index", "content") else "index")


def _candidates(search: Sequence[str]):
    """Dataset directories and Megatron prefixes under the search roots (bounded depth; a bucket cache's endpoint
    place does not count as a level)."""
    for root in search:
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            # a bucket cache's endpoint place (cache/_endpoint-.../bucket/prefix) is not a level of the user's tree
            if rel.count(os.sep) - rel.startswith(ENDPOINT_PLACE_PREFIX) >= _SEARCH_DEPTH:
                dirnames[:] = []
            if "manifest.json" in filenames:
                dirnames[:] = []
                yield dirpath
            for name in filenames:
                if name.endswith(".idx"):
                    yield os.path.join(dirpath, name[:-4])


def _refuse_replaced_objects(ds: Any, recorded: Any) -> None:
    """:class:`BucketError` (reason ``changed``) naming the first object of bucket dataset ``ds`` whose ETag is not
    the one the plan recorded (replaced after the plan was built: a Megatron ``.bin`` of the same size would
    otherwise serve other bytes under the same index fingerprint); ``ds`` is closed then."""
    now = getattr(ds, "object_etags", None)
    if not isinstance(recorded, dict) or not now:
        return
    for url, etag in now.items():
        if url in recorded and recorded[url] != etag:
            ds.close()
            raise BucketError(f"object replaced since the plan was built (ETag {etag}, the plan recorded "
                              f"{recorded[url]}): rebuild the plan, or pass the datasets explicitly", "changed",
                              object=url)


def open_plan_datasets(plan, *, search: Sequence[str] = ()) -> list:
    """Open the datasets ``plan`` was built from, in order, each checked against its fingerprint.

    Looks at the recorded path first, then under ``search`` and ``$FORESIGHT_DATA_PATH`` for a dataset with the
    same fingerprint. Raises :class:`PlanError` naming the dataset and where it was expected when one is missing or
    changed.
    """
    if plan.path is None:
        raise PlanError("the plan has not been saved, so it records no dataset locations: pass the datasets")
    sources = read_sources(plan.path)
    if sources is None:
        raise PlanError("this plan records no dataset locations (saved before they were recorded, or built from "
                        "in-memory sources): pass the datasets explicitly", path=plan.path)
    expected = plan.inputs["sources"]
    if len(sources) != len(expected):
        raise PlanError(f"{SOURCES_JSON} lists {len(sources)} datasets, the plan has {len(expected)}", path=plan.path)
    roots = list(search) + [p for p in os.environ.get(SEARCH_ENV, "").split(":") if p]
    out = []
    for i, (loc, want) in enumerate(zip(sources, expected)):
        fingerprint = want["fingerprint"]
        path = loc.get("path")
        tried = [os.path.normpath(os.path.join(plan.path, loc["relative"]))] if loc.get("relative") else []
        tried += [path] if path and path not in tried else []
        tried += [loc["url"]] if isinstance(loc.get("url"), str) else []  # its bucket, through FORESIGHT_BUCKET_CACHE
        found, why = None, "no path was recorded"
        for where in tried:
            try:
                ds = _open(where, loc.get("fingerprint_mode", "index"))
            except (BucketError, ValueError) as e:  # a FormatError; or a bucket URL and no cache directory
                why = f"it is not there ({e})"
                continue
            if str(ds.fingerprint) == fingerprint and int(ds.num_samples) == want["num_samples"]:
                _refuse_replaced_objects(ds, loc.get("objects"))
                found = ds
                break
            why = f"the dataset there has changed (fingerprint {ds.fingerprint}, {ds.num_samples} samples)"
            ds.close()
        if found is None:
            for cand in _candidates(roots):
                try:
                    ds = _open(cand, loc.get("fingerprint_mode", "index"))
                except FormatError:
                    continue
                if str(ds.fingerprint) == fingerprint and int(ds.num_samples) == want["num_samples"]:
                    found = ds
                    break
        if found is None:
            raise PlanError(f"dataset {i} of the plan was expected at {path}, but {why}; move it back, pass "
                            f"search=[...] or set {SEARCH_ENV} to a directory that holds it, or pass the datasets "
                            "explicitly", path=plan.path, fingerprint=fingerprint,
                            searched=roots or None)
        out.append(found)
    return out
