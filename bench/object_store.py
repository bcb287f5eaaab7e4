"""Training from a bucket: foresight's plan-driven fetch and cache against the ways other loaders read S3.

SeaweedFS (``weed mini``, bound to 127.0.0.1) behind the WAN bed's delaying proxy
(:mod:`foresight.testing.wan`: one shared pipe per direction, ``--rtts`` round trips, ``--mbit`` cap)
serves two datasets: ``token`` (16 KiB samples) and ``media`` (128 KiB - 2 MiB samples). One random plan per
dataset (one epoch) is replayed, step by step, by:

* ``dl-boto3``: a torch DataLoader over a map-style Dataset whose ``__getitem__`` is one boto3 ranged GET per
  sample (what a map-style Dataset over S3 does), swept over ``--workers``; the best is the row;
* ``obstore-ranges``: ``obstore.get_ranges`` per step and object (object_store merges ranges less than 1 MiB
  apart), 4 steps in flight;
* ``s3torch``: s3torchconnector's CRT client, one ranged read per sample from DataLoader workers (its range-based
  reader unbuffered: a read fetches its own bytes; skipped with the reason printed when it does not import);
* ``mosaic``: Mosaic Streaming's own ``StreamingDataset`` (mosaicml-streaming, :mod:`mosaic_anchor`) over an MDS
  copy of the same samples in the same bucket (shards of the same size), with a ``cache_limit`` (10% of the
  dataset, or the least it accepts: 4 shards), its own shuffle (it takes no sample order from outside), in a torch
  DataLoader with workers; ``num_workers`` and ``predownload`` swept, the best is the row;
* ``mosaic-emul``: Mosaic's policy emulated over foresight's own shards: the whole shard objects each step needs,
  downloaded ahead (4 steps), kept in a local cache, each step's samples read from them into a batch;
* ``foresight``: ``open_dataset("s3://...", cache_dir=...)`` + :class:`PlanPrefetcher` + :class:`Loader`
  (``foresight-nofill``: the same without block fill, to show what it buys).

Reported per method: samples/s, requests per sample, bytes fetched / bytes the plan needs (its distinct samples),
CPU-s/GB (this process and its workers; the proxy and the server are the "network" and not counted), time to
the first batch (from the start, connection set-up, worker start and dataset open included), and the epoch's wall
time as a multiple of the link floor (the plan's bytes / the link's rate: 1.0 is link-bound). Every method is timed
alike (:func:`consume`): from before its client or dataset is made to its last batch in hand, every batch being the
step's samples packed in one buffer with ``offsets`` and ``lengths`` (the layout foresight's Loader delivers).
Requests are counted by each client (foresight's fetcher; one per GET for the per-sample anchors and Mosaic's
whole-shard downloads: a HEAD and 8 MiB ranged GETs each for the real one, boto3's ``download_file``); for
``obstore-ranges`` they are computed with object_store's merge rule (it does not report them).

The full preset keeps the datasets large enough for a realistic geometry (token 512 MiB: 8 shards of Mosaic's
default 64 MiB, 32,768 samples, 512 steps; media 1.5 GiB: 24 shards, about 1,460 samples) and fits about 35
minutes on the 2-core VM when quiet: every method replays the whole plan, except the per-sample anchors
(``dl-boto3``, ``s3torch``) on token, ten times slower there, which are timed over a span of **N steps** (64,
``--anchor-steps``) in whole rounds of ``workers`` batches: the difference of a pass of ``workers`` + N steps and a
pass of ``workers`` steps, both from the plan's start (the config column says "N steps: a K-step pass less a
J-step pass"). Their start, worker spawn and last-round drain cancel; their samples/s, CPU-s/GB and link floor are
the span's own, their time to the first batch its own figure. A span timed inside one pass overstates them: a
DataLoader fetches up to workers x ``DL_PREFETCH_FACTOR`` batches ahead and its workers drift apart, so some of
the span's bytes were fetched before any clock start (three full runs timed that way showed a 1 MiB-sample anchor
at 8x, 1.5x and 1.2-1.4x the link's rate and were not committed). Their requests per sample (1) and bytes ratio
(1.0) are exact by construction; the requests target compares
requests per sample. Worker counts are swept small (8, 16), Mosaic's workers (2, 4) and predownload with each
point over the first quarter of its epoch (timed from the start as its row is: its shard downloads are what its
configs change) and its ``shuffle_block_size`` sized to half its cache_limit, so that a block's shards fit its
cache (its default block spans the whole dataset, and its cache of 4 shards thrashed: 314 downloads of a 64 MiB
shard for under a quarter of the media epoch), every sweep once per dataset at the first round trip, the config it
chose then run at each round trip, 3 runs (median).
An estimate of each section is printed at the start and each section's elapsed time as it ends (``sections`` in
the JSON, beside the estimates, to recalibrate ``EST_*`` by).

Cache hit rates at a budget of 10% of the dataset, over a 3-epoch plan: foresight's PlanPrefetcher run live
(direct to the server), and the replays of :mod:`foresight.bucket.policy` (ours: furthest next use with the
loader's window pinned; LRU; the offline optimum) and Mosaic's shard cache (whole shards, oldest evicted first).

Usage::

    python bench/object_store.py --smoke          # tiny datasets, one round trip, one run: seconds
    python bench/object_store.py --preset quick   # ~200 MB (32 + 160 MiB), 10 and 30 ms, 2 runs, 16 workers
    python bench/object_store.py                  # full: 512 MiB + 1.5 GiB, 3 runs, token anchors over a span: ~35 min
    python bench/object_store.py --smoke --anchor-steps 2 --workers 1,2   # the full preset's anchor span, small
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest.mock import patch

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, machine, print_table  # noqa: E402
from read_path import Meter, result  # noqa: E402
from mosaic_anchor import (DownloadLog, block_for, cache_limit_for, import_streaming, pack_mds,  # noqa: E402
                           pack_samples, streaming_version, write_mds)

KiB, MiB = 1 << 10, 1 << 20
TOKEN_SAMPLE = 16 * KiB
LOOKAHEAD = 8
PREFETCH = 2
AHEAD = 4  # steps in flight for the obstore and Mosaic anchors
DL_PREFETCH_FACTOR = 4  # batches each DataLoader worker of the per-sample anchors holds ahead
OBSTORE_COALESCE = 1 * MiB  # object_store's OBJECT_STORE_COALESCE_DEFAULT
BUDGET_FRACTION = 0.10
HIT_EPOCHS = 3
HIT_LOOKAHEAD = PREFETCH + 2  # the least the loader allows: the pinned window is the budget the optimum keeps free
# mosaic_workers / mosaic_predownload: the StreamingDataset configurations swept (predownload in batches per worker;
# None: its default, 8 batches); the best one is the row.
# anchor_steps: per dataset, the per-sample anchors (dl-boto3, s3torch) are timed over a span of this many steps
# (rounded up to whole rounds of workers), as the difference of two runs from the plan's start (None or absent:
# the whole plan; see run_dataloader). mosaic_sweep_fraction: each Mosaic sweep point runs over
# this leading share of its epoch, timed from the start as its row is (1.0: the whole plan). sweep_once: every sweep
# runs at the first round trip only, its best config is then run at each round trip.
PRESETS = {
    "smoke": {"token_mib": 2, "media_mib": 8, "shard_mib": 1, "rtts": "10", "runs": 1, "workers": "2",
              "token_batch": 16, "media_batch": 2, "mosaic_workers": (2,), "mosaic_predownload": (None,),
              "anchor_steps": None, "mosaic_sweep_fraction": 1.0, "sweep_once": False,
              "mosaic_block_fit": False},
    # quick: 2 runs, 16 workers only (no sweep): 3 runs of the 8,16 sweep did not fit 25 minutes on the loaded
    # shared 2-core VM (the per-sample anchors take minutes per run at 30 ms)
    "quick": {"token_mib": 32, "media_mib": 160, "shard_mib": 16, "rtts": "10,30", "runs": 2, "workers": "16",
              "token_batch": 64, "media_batch": 8, "mosaic_workers": (2, 8), "mosaic_predownload": (None, 32),
              "anchor_steps": None, "mosaic_sweep_fraction": 1.0, "sweep_once": False,
              "mosaic_block_fit": False},
    # full: about 33 minutes on the 2-core VM when quiet (the estimate printed at the start; 2-3x that at load
    # 10-15). 512 MiB of token (8 shards of Mosaic's default 64 MiB, 32,768 samples, 512 steps) and 1.5 GiB of media
    # (24 shards, about 1,460 samples): foresight, obstore-ranges, mosaic-emul and the real Mosaic over the whole
    # plan, and so do the per-sample anchors on media (~16 s a run at the link's rate); on token, about ten times
    # slower than foresight there (dl-boto3 ~400, s3torch ~210 samples/s at 16 workers), they are timed over a span
    # of 64 steps: a run of workers + 64 steps less a run of workers steps (run_dataloader). Three heads timed
    # inside one run were stopped as biased (docs/buckets.md): batches the workers fetched before the clock started
    # made a 1 MiB-sample anchor show 1.2-8x the link's rate. Mosaic's
    # shuffle_block_size is sized to half its cache_limit (mosaic_block_fit): with its default block (262,144
    # samples, past the whole dataset) its cache of 4 of 24 media shards thrashed at this size, 314 downloads of a
    # 64 MiB shard for under a quarter of an epoch at 2 workers (minutes for one sweep point). With the block fitted,
    # media ran at 49-55 samples/s at 2 workers, 13-26 at 4 and 3.9-21.5 at 8 (each worker's block holds its own
    # shards in the one cache): 8 workers left out of the sweep (one point took 93 s)
    "full": {"token_mib": 512, "media_mib": 1536, "shard_mib": 64, "rtts": "10,30", "runs": 3,
             "workers": "8,16", "token_batch": 64, "media_batch": 8, "mosaic_workers": (2, 4),
             "mosaic_predownload": (None, 32), "anchor_steps": {"token": 64}, "mosaic_sweep_fraction": 0.25,
             "sweep_once": True, "mosaic_block_fit": True},
}


# -- data -----------------------------------------------------------------------------------------------------------


def make_dataset(root: Path, kind: str, total_mib: int, shard_mib: int):
    """A bytes dataset of random samples (16 KiB for ``token``, 128 KiB - 2 MiB for ``media``), written once."""
    from foresight.format import DatasetWriter, open_dataset

    path = root / f"{kind}-{total_mib}M-s{shard_mib}"
    if (path / "manifest.json").exists():
        return open_dataset(str(path))
    shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(7)
    total = total_mib * MiB
    with DatasetWriter(str(path), align=4096, shard_bytes=shard_mib * MiB, fsync=False) as w:
        written = 0
        while written < total:
            n = TOKEN_SAMPLE if kind == "token" else int(rng.integers(128 * KiB, 2 * MiB))
            w.add(rng.integers(0, 256, size=n, dtype=np.uint8).tobytes(), modality="bytes")
            written += n
    return open_dataset(str(path))


class Case:
    """One dataset in the bucket and its plan: ``steps[k]`` the distinct samples step k reads."""

    def __init__(self, kind: str, local, url: str, batch: int, epochs: float = 1.0, seed: int = 1) -> None:
        from foresight.bucket.policy import plan_accesses
        from foresight.plan import build_plan

        self.kind, self.local, self.url, self.batch = kind, local, url, batch
        self.mds_url: str | None = None  # the same samples as MDS shards (mosaic_anchor.write_mds)
        self.mds_shard_bytes: list[int] = []
        self.plan = build_plan([(local, 1.0)], seed=seed, global_batch_size=batch, epochs=epochs)
        self.acc = plan_accesses(self.plan)
        self.steps = [self.acc.of(k) for k in range(len(self.acc))]
        ext = local.lookup(np.arange(local.num_samples))
        self.shard, self.offset, self.length = ext.shard.astype(np.int64), ext.offset, ext.length
        self.keys = [f"{url.split('/', 3)[3]}/{os.path.basename(p)}" for p in local.shard_paths]
        self.bucket = url.split("/")[2]
        self.samples = int(self.acc.ids.size)
        self.read_bytes = int(self.length[self.acc.ids].sum())
        self.needed_bytes = int(self.length[np.unique(self.acc.ids)].sum())
        self.step0_bytes = int(self.length[self.steps[0]].sum()) if self.steps else 0
        self.head_steps: int | None = None  # set on a head(): the steps timed
        self.head_skip = 0  # set on a head(): the steps before the span
        self.whole = self  # the case a head() was cut from

    def head(self, steps: int, skip: int = 1) -> "Case":
        """This case cut to its first ``skip`` + ``steps`` steps, the figures (samples, bytes, the bytes the plan
        needs, hence the link floor) being those of the last ``steps``: the span the slow per-sample anchors are
        timed over (:func:`run_dataloader`). ``skip`` is at least 1 and leaves at least one step to time."""
        whole = self.whole
        skip = max(1, min(int(skip), len(whole.steps) - 1))
        view = copy.copy(whole)
        view.steps = whole.steps[:skip + steps]
        timed = np.concatenate(view.steps[skip:]) if len(view.steps) > skip else np.empty(0, dtype=np.int64)
        view.head_steps, view.head_skip = len(view.steps) - skip, skip
        view.samples = int(timed.size)
        view.read_bytes = int(self.length[timed].sum())
        view.needed_bytes = int(self.length[np.unique(timed)].sum())
        return view


def setup_upload() -> dict:
    """How the set-up uploads (direct to the server, untimed) the datasets and their MDS copies: 4 objects at a time,
    a 600 s request timeout. With every object at once (64, the default) and 30 s, 1.5 GiB of 64 MiB shards failed on
    the loaded 2-core VM: parts past the timeout, then SeaweedFS's own HTTP 500s. A fresh dict each call
    (resolve_options adds to the options it gets)."""
    return {"options": {"client_options": {"timeout": "600s"}}, "concurrency": 4}


LINK_BPS = [100e6]  # the WAN bed's cap in bytes/s (set from --mbit)
NETWORK_PIDS: list[int] = []  # the server's and the proxies' processes: the "network", not the methods' CPU


def start_meter() -> Meter:
    """A started Meter of this process and its workers, the server and the WAN proxy left out."""
    m = Meter(exclude=NETWORK_PIDS)
    m.start()
    return m


def consume(batches, meter: Meter, total: int) -> tuple[int, float, float, float]:
    """Take batches (dicts with ``lengths``) until ``total`` samples are in hand; (samples, time to the first
    batch, wall, CPU). Every method is timed alike: from before its client or dataset is made (connections,
    worker start and dataset open included) to its last batch in hand; the teardown after it (closing, joining
    workers) is left out. Samples past ``total`` (Mosaic pads its last batches with repeats) are not counted."""
    samples, ttfb = 0, None
    for batch in batches:
        if ttfb is None:
            ttfb = time.perf_counter() - meter._t0
        samples += len(batch["lengths"])
        if samples >= total:
            break
    wall, cpu = meter.stop()
    return min(samples, total), ttfb, wall, cpu


def row(case: Case, method: str, rtt: float, samples: int, wall: float, cpu: float, requests: float,
        fetched: int, ttfb: float, **extra) -> dict:
    r = result(samples, case.read_bytes, wall, cpu, **extra)
    floor = case.needed_bytes / LINK_BPS[0]  # the plan's bytes through the capped link: the least epoch time
    r.update(floor_s=floor, x_floor=wall / floor if floor else None)
    r.update(dataset=case.kind, method=method, rtt_ms=rtt, requests=requests,
             requests_per_sample=requests / samples if samples else None,
             bytes_ratio=fetched / case.needed_bytes, first_batch_s=ttfb)
    return r


# -- anchors --------------------------------------------------------------------------------------------------------


class Boto3Samples:
    """Map-style dataset: one boto3 ranged GET per sample (client made per worker process)."""

    def __init__(self, case: Case, env: dict) -> None:
        self.bucket, self.keys, self.env = case.bucket, case.keys, env
        self.shard, self.offset, self.length = case.shard, case.offset, case.length
        self._client, self._pid = None, -1

    def __len__(self) -> int:
        return len(self.shard)

    def __getitem__(self, i: int) -> np.ndarray:
        if self._pid != os.getpid():
            import boto3
            from botocore.config import Config

            self._client = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"],
                                        aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                                        region_name="us-east-1", config=Config(max_pool_connections=4))
            self._pid = os.getpid()
        off, n = int(self.offset[i]), int(self.length[i])
        body = self._client.get_object(Bucket=self.bucket, Key=self.keys[int(self.shard[i])],
                                       Range=f"bytes={off}-{off + n - 1}")["Body"].read()
        if len(body) != n:
            raise OSError(f"short ranged GET of sample {i}: {len(body)} of {n} bytes")
        return np.frombuffer(body, dtype=np.uint8)


class S3TorchSamples(Boto3Samples):
    """The same per-sample ranged read through s3torchconnector's CRT client."""

    def __getitem__(self, i: int) -> np.ndarray:
        if self._pid != os.getpid():
            from s3torchconnector import S3ReaderConstructor
            from s3torchconnector._s3client import S3Client, S3ClientConfig

            os.environ.update(self.env)  # the CRT takes its keys from the environment (this worker's only)
            self._client = S3Client("us-east-1", endpoint=self.env["AWS_ENDPOINT_URL"],
                                    s3client_config=S3ClientConfig(force_path_style=True))
            # buffer_size=0: a read fetches its own range only. The default 8 MiB buffer made every 16 KiB sample
            # an 8 MiB GET (up to the object's end): the link carried ~500x the token plan's bytes, which the
            # bytes ratio (counted as the samples' bytes) did not show, and capped the anchor near 16 samples/s
            self._reader = S3ReaderConstructor.range_based(buffer_size=0)
            self._pid = os.getpid()
        off, n = int(self.offset[i]), int(self.length[i])
        reader = self._client.get_object(self.bucket, self.keys[int(self.shard[i])], reader_constructor=self._reader)
        reader.seek(off)
        body = reader.read(n)
        if len(body) != n:
            raise OSError(f"short ranged read of sample {i}: {len(body)} of {n} bytes")
        return np.frombuffer(body, dtype=np.uint8)


def dataloader_pass(case: Case, steps: list[np.ndarray], env: dict, workers: int, cls) -> tuple:
    """One DataLoader over ``steps`` (a prefix of the plan), timed as every method is (:func:`consume`)."""
    import torch.utils.data as tud

    meter = start_meter()
    dl = tud.DataLoader(cls(case, env), batch_sampler=[s.tolist() for s in steps], num_workers=workers,
                        collate_fn=pack_samples, prefetch_factor=DL_PREFETCH_FACTOR, persistent_workers=False)
    it = iter(dl)
    try:
        return consume(it, meter, int(sum(s.size for s in steps)))
    finally:
        del it, dl
        gc.collect()


def span_figures(short: tuple, long: tuple) -> tuple[int, float, float]:
    """(samples, wall, CPU) of the steps a ``long`` pass ran past a ``short`` one, both from the plan's start
    (each a :func:`consume` result): their start, worker spawn and the drain of their last round cancel."""
    samples, wall, cpu = long[0] - short[0], long[2] - short[2], long[3] - short[3]
    if samples <= 0 or wall <= 0:
        raise ValueError(f"a span needs the long pass to take longer: {samples} samples in {wall:.3f} s")
    return samples, wall, max(cpu, 0.0)


def run_dataloader(case: Case, rtt: float, env: dict, workers: int, cls=Boto3Samples, method="dl-boto3") -> dict:
    """A per-sample anchor over the whole plan, or, on a head (``case.head_steps``), over a span of it: the
    difference of a pass of ``workers`` + the span's steps and a pass of ``workers`` steps, both from the start,
    the span rounded up to whole rounds of ``workers``. Timing a span inside one pass overstates the anchor: a
    DataLoader fetches up to ``workers x prefetch_factor`` batches ahead, and its workers drift apart, so whatever
    point the clock starts at, some of the span's bytes were already fetched (1.2-8x the link's rate on 1 MiB
    samples, docs/buckets.md). Two passes from the start differ only by the span's rounds: the anchor's start
    (which a whole-plan row pays) is left out of its rate, in its favour."""
    if case.head_steps is None:
        samples, ttfb, wall, cpu = dataloader_pass(case, case.steps, env, workers, cls)
        # one GET per sample, each exactly its bytes
        return row(case, method, rtt, samples, wall, cpu, samples, case.read_bytes, ttfb, config=f"workers={workers}")
    span = case.head(-(-case.head_steps // workers) * workers, skip=workers)
    base, n = span.head_skip, span.head_steps
    short = dataloader_pass(case, span.steps[:base], env, workers, cls)
    long = dataloader_pass(case, span.steps, env, workers, cls)
    samples, wall, cpu = span_figures(short, long)
    config = f"workers={workers}, {n} steps: a {base + n}-step pass less a {base}-step pass"
    return row(span, method, rtt, samples, wall, cpu, samples, span.read_bytes, long[1], config=config,
               head_steps=n, head_skip=base)


def obstore_requests(case: Case, ids: np.ndarray) -> tuple[int, int]:
    """Requests and bytes of one step's get_ranges calls under object_store's merge rule (gap <= 1 MiB)."""
    from foresight.io.coalesce import coalesce

    tr = coalesce(case.shard[ids].astype(np.int32), case.offset[ids], case.length[ids], max_gap=OBSTORE_COALESCE,
                  max_transfer=1 << 62, align=1)
    return int(tr.io_count), int(tr.t_length.sum())


def s3_store(case: Case, env: dict):
    """An obstore client of the case's bucket on the local S3 endpoint (path-style, plain HTTP)."""
    from obstore.store import S3Store

    return S3Store(case.bucket, config={"endpoint": env["AWS_ENDPOINT_URL"], "access_key_id": env["AWS_ACCESS_KEY_ID"],
                                        "secret_access_key": env["AWS_SECRET_ACCESS_KEY"], "region": "us-east-1",
                                        "virtual_hosted_style_request": False},
                   client_options={"allow_http": True})


def run_obstore(case: Case, rtt: float, env: dict) -> dict:
    import obstore

    meter = start_meter()
    store = s3_store(case, env)

    def step(ids: np.ndarray) -> dict:
        order, parts = [], []
        for s in np.unique(case.shard[ids]).tolist():
            sel = ids[case.shard[ids] == s]
            starts = case.offset[sel].tolist()
            ends = (case.offset[sel] + case.length[sel]).tolist()
            parts += obstore.get_ranges(store, case.keys[s], starts=starts, ends=ends)
            order.append(np.flatnonzero(case.shard[ids] == s))
        pos = np.empty(len(ids), dtype=np.int64)
        pos[np.concatenate(order)] = np.arange(len(ids))
        return pack_samples([parts[p] for p in pos.tolist()])  # the step's samples in plan order

    requests = fetched = 0
    for ids in case.steps:
        n, b = obstore_requests(case, ids)
        requests += n
        fetched += b
    with ThreadPoolExecutor(AHEAD) as pool:
        futures = [pool.submit(step, ids) for ids in case.steps]  # the pool's width bounds the steps in flight
        samples, ttfb, wall, cpu = consume((f.result() for f in futures), meter, case.samples)
    return row(case, "obstore-ranges", rtt, samples, wall, cpu, requests, fetched, ttfb, config=f"{AHEAD} steps ahead")


class ShardCache:
    """Mosaic Streaming's policy: whole shard objects, downloaded ahead, evicted oldest-first past ``limit``."""

    def __init__(self, case: Case, limit: int | None) -> None:
        self.case, self.limit = case, limit
        self.sizes = np.array([os.path.getsize(p) for p in case.local.shard_paths], dtype=np.int64)
        self.order: list[int] = []  # cached shards, oldest download first

    def need(self, shards: list[int]) -> list[int]:
        """Shards to download for a step (evicting the oldest others past the limit); the step's own stay."""
        missing = [s for s in shards if s not in self.order]
        self.order += missing
        if self.limit is not None:
            while sum(self.sizes[self.order]) > self.limit:
                victim = next((s for s in self.order if s not in shards), None)
                if victim is None:
                    break
                self.order.remove(victim)
        return missing


def run_mosaic_emul(case: Case, rtt: float, env: dict, cache_root: Path) -> dict:
    import obstore

    meter = start_meter()
    store = s3_store(case, env)
    cache_dir = Path(tempfile.mkdtemp(prefix="mosaic-", dir=cache_root))
    cache = ShardCache(case, None)
    done: dict[int, object] = {}
    counts = {"requests": 0, "fetched": 0}

    def download(s: int) -> None:
        data = obstore.get(store, case.keys[s]).bytes()
        (cache_dir / f"{s}.bin").write_bytes(data)

    def batches(pool: ThreadPoolExecutor):
        def schedule(k: int) -> None:
            if k >= len(case.steps):
                return
            for s in cache.need(np.unique(case.shard[case.steps[k]]).tolist()):
                done[s] = pool.submit(download, s)
                counts["requests"] += 1
                counts["fetched"] += int(cache.sizes[s])

        for k in range(AHEAD):
            schedule(k)
        for k, ids in enumerate(case.steps):
            schedule(k + AHEAD)
            fds = {}
            for s in np.unique(case.shard[ids]).tolist():
                done[s].result()
                fds[s] = os.open(cache_dir / f"{s}.bin", os.O_RDONLY)
            lengths = case.length[ids].astype(np.int64)
            offsets = np.zeros(len(ids), dtype=np.int64)
            np.cumsum(lengths[:-1], out=offsets[1:])
            data = np.empty(int(lengths.sum()), dtype=np.uint8)
            view = memoryview(data)
            for i, off, n in zip(ids.tolist(), offsets.tolist(), lengths.tolist()):  # from the local shard files
                os.preadv(fds[int(case.shard[i])], [view[off:off + n]], int(case.offset[i]))
            for fd in fds.values():
                os.close(fd)
            yield {"data": data, "offsets": offsets, "lengths": lengths}

    with ThreadPoolExecutor(8) as pool:
        samples, ttfb, wall, cpu = consume(batches(pool), meter, case.samples)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return row(case, "mosaic-emul", rtt, samples, wall, cpu, counts["requests"], counts["fetched"], ttfb,
               config=f"whole shards, {AHEAD} steps ahead, no cache_limit")


def run_mosaic(case: Case, rtt: float, env: dict, work: Path, workers: int, predownload: int | None,
               fraction: float = 1.0, block_fit: bool = False) -> dict:
    """Mosaic Streaming's StreamingDataset over the MDS copy, its own shuffle (py1e, as its users run it: it
    takes no sample order from outside), a cache_limit of 10% of the dataset (or the least it accepts), in a
    torch DataLoader with ``workers``; S3 through the proxy (``S3_ENDPOINT_URL``). ``fraction`` < 1: only that
    leading share of its epoch's samples (a sweep point: only its samples/s stands for the config).
    ``block_fit``: its ``shuffle_block_size`` sized to half the cache_limit (:func:`mosaic_anchor.block_for`)."""
    import torch.utils.data as tud

    StreamingDataset, _ = import_streaming()
    limit = cache_limit_for(case, BUDGET_FRACTION)
    block = block_for(case, limit) if block_fit else None
    log = DownloadLog(work)
    local = tempfile.mkdtemp(prefix="mds-", dir=work)
    run_env = dict(env, S3_ENDPOINT_URL=env["AWS_ENDPOINT_URL"], AWS_DEFAULT_REGION="us-east-1")
    with patch.dict(os.environ, run_env), log.patch():
        meter = start_meter()
        ds = StreamingDataset(remote=case.mds_url, local=local, batch_size=case.batch, shuffle=True, shuffle_seed=1,
                              predownload=predownload, cache_limit=limit, shuffle_block_size=block)
        # Drop the S3 client the dataset made here (it fetched index.json) before the workers fork: forked, they
        # would share its pooled keep-alive connections with this process and each other, and a response read by
        # the wrong process left the right one waiting out its 60 s read timeout (epochs of 3 s or 61 s on the
        # bed; once an IndexError on a shard). Each worker makes its own client, as after a pickle (spawn).
        for stream in ds.streams:
            stream._downloader.clean_up()
        dl = tud.DataLoader(ds, batch_size=case.batch, num_workers=workers, collate_fn=pack_mds,
                            persistent_workers=False)
        it = iter(dl)
        try:
            samples, ttfb, wall, cpu = consume(it, meter, max(1, round(case.samples * fraction)))
        finally:
            del it, dl, ds
            gc.collect()
    shutil.rmtree(local, ignore_errors=True)
    objects, requests, fetched = log.totals()
    return row(case, "mosaic", rtt, samples, wall, cpu, requests, fetched, ttfb,
               config=f"workers={workers} predownload={predownload or 8 * case.batch} "
                      f"cache_limit={'none' if limit is None else f'{limit / MiB:.0f}MiB'} shuffle=py1e"
                      + (f" shuffle_block_size={block}" if block else ""),
               objects_downloaded=objects)


def run_foresight(case: Case, rtt: float, env: dict, cache_root: Path, *, fill: bool = True) -> dict:
    from foresight.bucket.prefetch import FILL_BLOCK, PlanPrefetcher
    from foresight import open_dataset
    from foresight.loader import Loader

    cache_dir = tempfile.mkdtemp(prefix="fs-", dir=cache_root)
    env_patch = patch.dict(os.environ, env)  # the server's keys for this run, the old values back after
    env_patch.start()
    meter = start_meter()
    try:
        ds = open_dataset(case.url, cache_dir=cache_dir)
        t_open = time.perf_counter() - meter._t0
        base = ds.fetcher.stats.as_dict()
        first: dict = {}
        with ds, PlanPrefetcher(ds, case.plan, lookahead=LOOKAHEAD, fill_block=FILL_BLOCK if fill else 0) as pf, \
                Loader(case.plan, datasets=ds, prefetch=PREFETCH, on_step=pf.on_step) as loader:
            def batches():
                for batch in loader:
                    if not first:
                        first.update(ds.fetcher.stats.as_dict())  # what had been fetched when the first batch came
                    yield batch

            samples, ttfb, wall, cpu = consume(batches(), meter, case.samples)
            stats = ds.fetcher.stats.as_dict()
            if pf.error is not None:
                raise pf.error
    finally:
        env_patch.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return row(case, "foresight" if fill else "foresight-nofill", rtt, samples, wall, cpu,
               stats["requests"] - base["requests"], stats["bytes"] - base["bytes"], ttfb,
               config=f"lookahead={LOOKAHEAD} prefetch={PREFETCH}" + ("" if fill else " fill_block=0"),
               first_batch_requests=first.get("requests", 0) - base["requests"],
               first_batch_mb=(first.get("bytes", 0) - base["bytes"]) / 1e6, step0_mb=case.step0_bytes / 1e6,
               retries=stats["retries"] - base["retries"], open_s=t_open)


# -- hit rates -----------------------------------------------------------------------------------------------------


def mosaic_replay(case: Case, acc, budget: int) -> float | None:
    """Hit rate of Mosaic's shard cache (whole shards, oldest first) at ``budget`` bytes over ``acc``; None when
    one step's shards alone exceed the budget (the cache could not keep to it: no figure at that budget)."""
    cache = ShardCache(case, budget)
    hits = accesses = 0
    for k in range(len(acc)):
        ids = acc.of(k)
        shards = case.shard[ids]
        if int(cache.sizes[np.unique(shards)].sum()) > budget:
            return None
        cached = np.isin(shards, cache.order)
        hits += int(cached.sum())
        accesses += ids.size
        cache.need(np.unique(shards).tolist())
    return hits / accesses


def hit_rates(case: Case, env: dict, cache_root: Path) -> dict:
    """Foresight's live hit rate at 10% of the dataset over HIT_EPOCHS epochs, beside the replays."""
    from foresight.bucket.policy import compare_policies, plan_accesses
    from foresight.bucket.prefetch import PlanPrefetcher
    from foresight import open_dataset
    from foresight.loader import Loader
    from foresight.plan import build_plan

    sizes = case.local.sample_bytes()
    budget = int(sizes.sum() * BUDGET_FRACTION)
    # small steps, so the window the prefetcher pins (HIT_LOOKAHEAD steps) is a small share of the budget
    batch = max(1, int(budget // sizes.mean()) // 32)
    plan = build_plan([(case.local, 1.0)], seed=3, global_batch_size=batch, epochs=HIT_EPOCHS)
    acc = plan_accesses(plan)
    res = compare_policies(acc, sizes, budget_bytes=budget, window=len(acc))
    cache_dir = tempfile.mkdtemp(prefix="fs-hit-", dir=cache_root)
    env_patch = patch.dict(os.environ, env)  # the server's keys for this run, the old values back after
    env_patch.start()
    try:
        with open_dataset(case.url, cache_dir=cache_dir) as ds:
            with PlanPrefetcher(ds, plan, lookahead=HIT_LOOKAHEAD, budget_bytes=budget) as pf, \
                    Loader(plan, datasets=ds, prefetch=PREFETCH, on_step=pf.on_step) as loader:
                for _ in loader:
                    pass
            fetched = ds.cache.stats.misses + ds.cache.stats.gap_samples
    finally:
        env_patch.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
    accesses = res["optimum"].accesses
    return {"dataset": case.kind, "budget_fraction": BUDGET_FRACTION, "epochs": HIT_EPOCHS, "batch": batch,
            "accesses": accesses, "fetched_samples": fetched,  # live: 1 - fetched / accesses (< 0 on refetches)
            "foresight_live": 1 - fetched / accesses, "foresight_replay": res["window"].hit_rate,
            "lru": res["lru"].hit_rate, "optimum": res["optimum"].hit_rate,
            "mosaic_shards": mosaic_replay(case, acc, budget)}


# -- sweeps and the clock ------------------------------------------------------------------------------------------


def pick_best(case: Case, rtt: float, method: str, configs: list[tuple], keys: tuple[str, ...], sweep: list[dict],
              run, span: str = "") -> tuple:
    """Run each config once (``run(*config)``, a sweep point recorded in ``sweep``) and return the one with the most
    samples/s; a config that fails is recorded with why, not fatal. One config: returned, not run."""
    if len(configs) == 1:
        return configs[0]
    best_c, best = configs[0], -1.0
    for c in configs:
        point = {"dataset": case.kind, "rtt_ms": rtt, "method": method, **dict(zip(keys, c))}
        if span:
            point["span"] = span.strip(" ()")
        try:
            r = run(*c)
        except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
            point["failed"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
            print(f"   {method} sweep: {', '.join(f'{k}={v}' for k, v in zip(keys, c))}: failed ({point['failed']})",
                  flush=True)
            sweep.append(point)
            continue
        print(f"   {method} sweep: {r['config']}{span}: {r['samples_per_s']:,.1f} samples/s", flush=True)
        sweep.append(dict(point, samples_per_s=r["samples_per_s"]))
        if r["samples_per_s"] > best:
            best_c, best = c, r["samples_per_s"]
    return best_c


# Rough rates for the estimate printed at the start, for the 2-core VM when quiet (load 1-3, as the committed quick
# run in bench/reference/quick was measured): token in samples/s, media (link-bound) as the epoch's time over the
# link floor. obstore-ranges on token at the full preset's geometry (64 MiB shards: 0.89 GETs a sample for 4.6x the
# plan's bytes) ran 266 samples/s at load 13-17 (123 s an epoch); quiet, its 2.4 GB take ~25 s of the link and its
# 8 GETs a step one after another ~15-35 s more. The per-sample anchors after their first batch: dl-boto3 329-412,
# s3torch 202-218 samples/s at 16 workers (load 13-17, latency-bound: 4 and 8 workers gave a quarter and a half).
# A load of 10-15 makes the whole run 2-3x longer. EST_START_S: a run's own start (clients, Mosaic's index); the
# DataLoader anchors' per worker (each imports its client: about a CPU-second, on 2 cores).
EST_TOKEN_RATE = {"foresight": 3500, "foresight-nofill": 3000, "obstore-ranges": 700, "mosaic-emul": 4500,
                  "mosaic": 2000, "dl-boto3": 400, "s3torch": 210}
EST_MEDIA_X_FLOOR = {"foresight": 1.25, "foresight-nofill": 1.2, "obstore-ranges": 1.2, "mosaic-emul": 1.2,
                     "mosaic": 1.9, "dl-boto3": 1.7, "s3torch": 2.0}
EST_START_S = {"mosaic": 3.0}
EST_START_PER_WORKER_S = 0.5
EST_MOSAIC_MEDIA_SWEEP_SLOWDOWN = 2.0  # its media sweep points at 13-55 samples/s (fitted block, load 8-10)
EST_SETUP_BPS = 20e6  # writing the datasets (when not in --data-dir yet), uploading them, their MDS copies
EST_HIT_BPS = 100e6  # the hit-rate runs: 3 epochs direct from the server, and the replays


def anchor_span(steps: int, workers: int) -> int:
    """Steps a per-sample anchor replays to time a span of ``steps``: a pass of ``workers`` steps and one of
    ``workers`` + the span in whole rounds of ``workers`` (:func:`run_dataloader`)."""
    return 2 * workers + -(-steps // workers) * workers


def anchor_steps_of(cfg: dict, kind: str) -> int | None:
    """The span the per-sample anchors are timed over on ``kind`` (None: the whole plan)."""
    steps = cfg["anchor_steps"]
    return steps.get(kind) if isinstance(steps, dict) else steps


def estimate(cfg: dict, kinds: list[str], rtts: list[float], runs: int, workers: list[int], methods: list[str],
             hit_rates: bool) -> dict[str, float]:
    """Seconds each section of the run should take (setup, each dataset at each round trip, the hit rates), from
    the rates above: a guide to plan a run by, printed at its start and set beside each section's elapsed time."""
    out = {}
    total_bytes = 0
    for kind in kinds:
        total_bytes += cfg[f"{kind}_mib"] * MiB
    out["setup"] = total_bytes / EST_SETUP_BPS
    for rtt in rtts:
        for kind in kinds:
            batch, nbytes = cfg[f"{kind}_batch"], cfg[f"{kind}_mib"] * MiB
            head = anchor_steps_of(cfg, kind)
            mean = TOKEN_SAMPLE if kind == "token" else (128 * KiB + 2 * MiB) / 2
            samples = nbytes / mean

            def secs(method: str, n: float, slowdown: float = 1.0, workers: int = 0) -> float:
                if kind == "token":
                    rate = EST_TOKEN_RATE[method]
                else:
                    rate = LINK_BPS[0] / mean / EST_MEDIA_X_FLOOR[method]
                return EST_START_S.get(method, 0.5) + EST_START_PER_WORKER_S * workers + n * slowdown / rate

            per_run = 0.0
            sweeps = 0.0
            swept = not cfg["sweep_once"] or rtt == rtts[0]
            for m in methods:
                if m in ("dl-boto3", "s3torch"):
                    # a span: two passes from the start, each with its own start
                    def anchor(w: int) -> float:
                        if head is None:
                            return secs(m, samples, workers=w)
                        return secs(m, anchor_span(head, w) * batch, workers=w) + secs(m, 0, workers=w)

                    per_run += anchor(max(workers))  # the most workers: the sweeps' usual choice (latency-bound)
                    sweeps += sum(anchor(w) for w in workers) \
                        if swept and len(workers) > 1 else 0.0
                elif m == "mosaic":
                    per_run += secs(m, samples)
                    grid = [(w, p) for w in cfg["mosaic_workers"] for p in cfg["mosaic_predownload"]]
                    slow = EST_MOSAIC_MEDIA_SWEEP_SLOWDOWN if kind == "media" else 1.0
                    sweeps += sum(secs(m, samples * cfg["mosaic_sweep_fraction"], slow) for _ in grid) \
                        if swept and len(grid) > 1 else 0.0
                else:
                    per_run += secs(m, samples)
            out[f"{kind} {rtt:g} ms"] = sweeps + runs * per_run
    if hit_rates:
        out["hit rates"] = HIT_EPOCHS * total_bytes / EST_HIT_BPS
    return out


class Clock:
    """Elapsed time per section of the run beside the estimate made at its start (printed as each ends)."""

    def __init__(self, estimates: dict[str, float]) -> None:
        self.estimates, self.sections = estimates, []
        self.t0 = self.t = time.perf_counter()
        total = sum(estimates.values())
        print(f"estimate: {total / 60:.0f} min ({total:.0f} s): "
              + ", ".join(f"{k} {v:.0f} s" for k, v in estimates.items()), flush=True)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        est = self.estimates.get(name)
        self.sections.append({"section": name, "elapsed_s": round(now - self.t, 1),
                              "estimate_s": None if est is None else round(est, 1)})
        print(f"   [{name}: {now - self.t:.0f} s" + ("" if est is None else f" (estimate {est:.0f} s)")
              + f"; {now - self.t0:.0f} s since the start, {sum(self.estimates.values()):.0f} s estimated in all]",
              flush=True)
        self.t = now


# -- the report -----------------------------------------------------------------------------------------------------


def median_row(rows: list[dict]) -> dict:
    """The run with the median samples/s, with the spread of all runs."""
    rows = sorted(rows, key=lambda r: r["samples_per_s"])
    mid = dict(rows[len(rows) // 2])
    mid["runs"] = len(rows)
    mid["samples_per_s_all"] = [round(r["samples_per_s"], 1) for r in rows]
    for key in ("first_batch_s", "cpu_s_per_gb"):
        mid[key] = statistics.median(r[key] for r in rows)
    return mid


def check_targets(rows: list[dict], hits: list[dict]) -> list[dict]:
    out = []
    for (kind, rtt) in sorted({(r["dataset"], r["rtt_ms"]) for r in rows}):
        here = {r["method"]: r for r in rows if r["dataset"] == kind and r["rtt_ms"] == rtt}
        fs = here.get("foresight")
        if fs is None:
            continue
        per_sample = here.get("dl-boto3")
        # the anchors are the loaders themselves; Mosaic's policy emulated stands in for Mosaic only where its own
        # StreamingDataset did not run, and is compared with on its own lines otherwise (an idealised Mosaic: no
        # MDS decoding, no workers, no shared-memory coordination; see the module doc)
        anchors = [r for m, r in here.items() if not m.startswith("foresight")
                   and not (m == "mosaic-emul" and "mosaic" in here)]
        best = max(anchors, key=lambda r: r["samples_per_s"]) if anchors else None
        where = f"{kind} {rtt:g} ms"
        emul = here.get("mosaic-emul") if "mosaic" in here else None
        if emul:
            out.append({"target": "samples/s >= 1.5x mosaic-emul's (informative)", "where": where,
                        "value": fs["samples_per_s"] / emul["samples_per_s"],
                        "met": fs["samples_per_s"] >= 1.5 * emul["samples_per_s"], "ceiling": emul.get("x_floor")})
            out.append({"target": "CPU-s/GB <= 1/3 of mosaic-emul's (informative)", "where": where,
                        "value": fs["cpu_s_per_gb"] / emul["cpu_s_per_gb"] if emul["cpu_s_per_gb"] else None,
                        "met": fs["cpu_s_per_gb"] * 3 <= emul["cpu_s_per_gb"]})
        if per_sample:
            # per sample: the per-sample anchor may have run over a prefix of the plan (one GET a sample either way)
            ratio = fs["requests_per_sample"] / per_sample["requests_per_sample"]
            out.append({"target": "requests <= 1/10 of per-sample GETs", "where": where, "value": ratio,
                        "met": ratio <= 0.1})
        out.append({"target": "bytes <= 1.25x the plan's", "where": where, "value": fs["bytes_ratio"],
                    "met": fs["bytes_ratio"] <= 1.25})
        if best:
            # ceiling: the most any method can reach over this anchor on this link (its epoch over the link floor)
            out.append({"target": f"samples/s >= 1.5x best anchor ({best['method']})", "where": where,
                        "value": fs["samples_per_s"] / best["samples_per_s"],
                        "met": fs["samples_per_s"] >= 1.5 * best["samples_per_s"], "ceiling": best.get("x_floor")})
            out.append({"target": f"CPU-s/GB <= 1/3 of {best['method']}'s", "where": where,
                        "value": fs["cpu_s_per_gb"] / best["cpu_s_per_gb"] if best["cpu_s_per_gb"] else None,
                        "met": fs["cpu_s_per_gb"] * 3 <= best["cpu_s_per_gb"]})
        if rtt >= 30:
            out.append({"target": "first batch <= 1 s at 30 ms", "where": where, "value": fs["first_batch_s"],
                        "met": fs["first_batch_s"] <= 1.0})
    for h in hits:
        out.append({"target": "hit rate within 1 point of the optimum, above LRU", "where": h["dataset"],
                    "value": h["foresight_live"],
                    "met": h["foresight_live"] >= h["optimum"] - 0.01 and h["foresight_live"] > h["lru"]})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dataset"], r["rtt_ms"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (kind, rtt) in zip(axes[0], groups):
        here = [r for r in rows if r["dataset"] == kind and r["rtt_ms"] == rtt]
        ax.bar([r["method"] for r in here], [r["samples_per_s"] for r in here],
               color=["tab:orange" if r["method"].startswith("foresight") else "tab:gray" for r in here])
        ax.set_title(f"{kind}, {rtt:g} ms round trip")
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="full")
    ap.add_argument("--smoke", action="store_true", help="the smoke preset")
    ap.add_argument("--rtts", default=None, help="round trips in ms, comma-separated")
    ap.add_argument("--mbit", type=float, default=800.0, help="the link's cap per direction (Mbit/s)")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--workers", default=None, help="DataLoader worker counts swept for the per-sample anchors")
    ap.add_argument("--datasets", default="token,media", help="which datasets, comma-separated (token, media)")
    ap.add_argument("--data-dir", default="/tmp/foresight-bench/object-store")
    ap.add_argument("--out", default=str(RESULTS), help="where the JSON and PNG go")
    ap.add_argument("--methods", default=None,
                    help="only these methods, comma-separated (e.g. foresight,mosaic): a before/after subset")
    ap.add_argument("--no-hit-rates", action="store_true", help="skip the cache hit-rate runs")
    ap.add_argument("--anchor-steps", type=int, default=None,
                    help="time the per-sample anchors (dl-boto3, s3torch) over a span of this many steps of every "
                         "dataset: a pass of workers + N steps less a pass of workers steps (0: the whole plan; "
                         "default: the preset's)")
    args = ap.parse_args(argv)
    only = set(args.methods.split(",")) if args.methods else None

    def wanted(method: str) -> bool:
        return only is None or method in only

    LINK_BPS[0] = args.mbit * 1e6 / 8
    preset = "smoke" if args.smoke else args.preset
    cfg = dict(PRESETS[preset])
    if args.anchor_steps is not None:
        cfg["anchor_steps"] = args.anchor_steps or None
    rtts = [float(x) for x in (args.rtts or cfg["rtts"]).split(",") if x]
    runs = args.runs or cfg["runs"]
    workers = [int(x) for x in (args.workers or cfg["workers"]).split(",") if x]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_root = Path(args.data_dir)
    data_root.mkdir(parents=True, exist_ok=True)

    from foresight.testing.seaweed import SeaweedServer
    from foresight.bucket.upload import upload_dataset
    from foresight.testing.wan import WanLink

    # lazy: paid here, before any timed run. The Loader imports torch on its first batch (about 1.1 CPU-s, tens of
    # seconds' worth on a loaded VM): the first method to run paid it in its first batch and its CPU
    import torch.utils.data  # noqa: F401
    import foresight.loader  # noqa: F401

    t_start = time.perf_counter()
    kinds = [k for k in args.datasets.split(",") if k]
    if not kinds or set(kinds) - {"token", "media"}:
        ap.error(f"--datasets takes token and/or media, got {args.datasets!r}")
    all_methods = ["foresight", "foresight-nofill", "obstore-ranges", "mosaic-emul", "mosaic", "dl-boto3", "s3torch"]
    clock = Clock(estimate(cfg, kinds, rtts, runs, workers, [m for m in all_methods if wanted(m)],
                           not args.no_hit_rates))
    chosen: dict[tuple[str, str], tuple] = {}  # (dataset, method) -> the config its sweep chose
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the server (the finally below)
    work = Path(tempfile.mkdtemp(prefix="foresight-objstore-"))
    server = SeaweedServer(str(work / "seaweed"))
    server.start()
    NETWORK_PIDS.append(server.proc.pid)
    rows, sweep, hits, skipped = [], [], [], {}
    try:
        direct = server.env()
        env_patch = patch.dict(os.environ, direct)  # the server's keys for this run, the old values back after
        env_patch.start()
        cases = []
        for kind in kinds:
            mib, batch = cfg[f"{kind}_mib"], cfg[f"{kind}_batch"]
            local = make_dataset(data_root, kind, mib, cfg["shard_mib"])
            url = f"s3://bench/{kind}"
            upload_dataset(local.path, url, **setup_upload())
            cases.append(Case(kind, local, url, batch))
        # importability only: the CRT starts threads on import, which the DataLoader's forked workers would lack
        for name, module in (("s3torch", "s3torchconnector"), ("dl-boto3", "boto3")):
            if importlib.util.find_spec(module) is None:
                skipped[name] = f"{module} is not installed (bash scripts/setup.sh installs the bench anchors)"
        try:
            import_streaming()
            print(f"mosaic: mosaicml-streaming {streaming_version()}'s StreamingDataset over MDS copies of the "
                  f"datasets ({cfg['shard_mib']} MiB shards)")
            for case in cases:
                case.mds_url = write_mds(case, work, cfg["shard_mib"] * MiB, **setup_upload())
        except ImportError as e:
            skipped["mosaic"] = str(e)
        env_patch.stop()
        for name, why in skipped.items():
            print(f"{name}: skipped ({why})")
        clock.lap("setup")
        for rtt in rtts:
            with WanLink(("127.0.0.1", server.ports["s3.port"]), rtt_ms=rtt, mbit=args.mbit) as link:
                NETWORK_PIDS.append(link.pid)
                env = dict(direct, AWS_ENDPOINT_URL=f"http://127.0.0.1:{link.port}")
                for case in cases:
                    print(f"-- {case.kind}, {rtt:g} ms, {args.mbit:g} Mbit/s: {len(case.steps)} steps, "
                          f"{case.samples} samples, {case.needed_bytes / MiB:.0f} MiB", flush=True)
                    print(f"   link floor (the plan's bytes / the link's rate): "
                          f"{case.needed_bytes / LINK_BPS[0]:.2f} s", flush=True)
                    methods = {
                        "foresight": lambda: run_foresight(case, rtt, env, work),
                        "foresight-nofill": lambda: run_foresight(case, rtt, env, work, fill=False),
                        "obstore-ranges": lambda: run_obstore(case, rtt, env),
                        "mosaic-emul": lambda: run_mosaic_emul(case, rtt, env, work),
                    }
                    swept = not cfg["sweep_once"] or rtt == rtts[0]  # else: the first round trip's choices
                    span = anchor_steps_of(cfg, case.kind)
                    head = case if span is None else case.head(span)
                    if "mosaic" not in skipped and wanted("mosaic"):
                        configs = [(w, p if p is None else p * case.batch) for w in cfg["mosaic_workers"]
                                   for p in cfg["mosaic_predownload"]]
                        if swept:
                            frac = cfg["mosaic_sweep_fraction"]
                            chosen[case.kind, "mosaic"] = pick_best(
                                case, rtt, "mosaic", configs, ("workers", "predownload"), sweep,
                                lambda *c: run_mosaic(case, rtt, env, work, *c, fraction=frac,
                                                      block_fit=cfg["mosaic_block_fit"]),
                                "" if frac >= 1 else f" (the first {frac:.0%} of its epoch)")
                        methods["mosaic"] = lambda c=chosen[case.kind, "mosaic"]: run_mosaic(
                            case, rtt, env, work, *c, block_fit=cfg["mosaic_block_fit"])
                    for m, cls in (("dl-boto3", Boto3Samples), ("s3torch", S3TorchSamples)):
                        if m in skipped or not wanted(m):
                            continue
                        if swept:
                            chosen[case.kind, m] = pick_best(
                                head, rtt, m, [(w,) for w in workers], ("workers",), sweep,
                                lambda w, cls=cls, m=m: run_dataloader(head, rtt, env, w, cls, m))
                        methods[m] = lambda w=chosen[case.kind, m][0], cls=cls, m=m: run_dataloader(head, rtt, env,
                                                                                                  w, cls, m)
                    methods = {m: fn for m, fn in methods.items() if wanted(m)}
                    got: dict[str, list] = {m: [] for m in methods}
                    for _ in range(runs):  # interleaved, so load on the shared VM touches every method alike
                        for m, fn in methods.items():
                            try:
                                got[m].append(fn())
                            except Exception as e:  # noqa: BLE001 - an anchor that fails is reported, not fatal
                                if m.startswith("foresight"):
                                    raise
                                why = f"{type(e).__name__}: {' | '.join(str(e).strip().splitlines()[-2:])[:300]}"
                                print(f"{m}: failed ({why})")
                                skipped[m] = why
                                break
                    rows += [median_row(v) for v in got.values() if v]
                    clock.lap(f"{case.kind} {rtt:g} ms")
        os.environ.update(direct)
        for case in cases if not args.no_hit_rates else []:
            hits.append(hit_rates(case, direct, work))
        if hits:
            clock.lap("hit rates")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    cols = ["dataset", "rtt_ms", "method", "samples_per_s", "wall_s", "x_floor", "requests_per_sample",
            "bytes_ratio", "cpu_s_per_gb", "first_batch_s", "first_batch_mb", "config"]
    print_table(rows, cols, title=f"\nobject store ({preset}; medians of {runs} runs, {args.mbit:g} Mbit/s link)")
    print_table(hits, ["dataset", "foresight_live", "foresight_replay", "optimum", "lru", "mosaic_shards"],
                title=f"\ncache hit rate at {BUDGET_FRACTION:.0%} of the dataset, {HIT_EPOCHS} epochs")
    targets = check_targets(rows, hits)
    print_table(targets, ["target", "where", "value", "met", "ceiling"],
                title="\ntargets (ceiling: the most any method can reach over that anchor on this link)")
    name = "object_store" + ("_smoke" if preset == "smoke" else "")
    payload = {"machine": machine(), "preset": preset, "smoke": preset == "smoke", "runs": runs, "mbit": args.mbit,
               "rtts_ms": rtts, "rows": rows, "worker_sweep": sweep, "hit_rates": hits, "targets": targets,
               "skipped": skipped, "elapsed_s": time.perf_counter() - t_start, "sections": clock.sections,
               "anchor_steps": {c.kind: anchor_steps_of(cfg, c.kind) for c in cases},
               "mosaic_sweep_fraction": cfg["mosaic_sweep_fraction"],
               "sweep_once": cfg["sweep_once"], "mosaic_block_fit": cfg["mosaic_block_fit"],
               "datasets": [{"kind": c.kind, "samples": c.local.num_samples, "bytes": int(c.length.sum()),
                             "steps": len(c.steps), "shards": len(c.keys)} for c in cases]}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    plot(rows, out_dir / f"{name}.png")
    print(f"\nwrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
