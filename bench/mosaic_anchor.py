"""Mosaic Streaming's own ``StreamingDataset`` as an anchor of the object-store bench: the bench's samples written as
MDS shards (``MDSWriter``), read back from the bucket with a ``cache_limit`` in a torch DataLoader with workers.

``mosaicml-streaming`` pins ``numpy<2.2`` and imports ``transformers`` and ``torchvision`` in its package
``__init__`` files (for its dataset recipes and ``StreamingDataLoader``), which this venv does not carry
(``scripts/setup.sh`` installs it ``--no-deps`` beside its compression codecs). So :func:`import_streaming`
loads ``streaming.base.dataset`` and the MDS writer with those two ``__init__`` files skipped: the dataset, its
downloader, its cache and its shuffle are the package's own code, unchanged.

Example::

    StreamingDataset, MDSWriter = import_streaming()      # ImportError (with why) when not installed
    url = write_mds(case, tmp, shard_bytes=16 << 20)        # s3://bench/token-mds
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path
from unittest.mock import patch

import numpy as np

MULTIPART = 8 << 20  # boto3's TransferConfig multipart threshold and chunk: Mosaic's download_file splits above it


def import_streaming():
    """``(StreamingDataset, MDSWriter)`` of the installed mosaicml-streaming, its recipe ``__init__`` files
    skipped (see the module doc); ImportError when it is not installed."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mosaicml-streaming is not installed (bash scripts/setup.sh installs the bench anchors)")
        root = list(spec.submodule_search_locations)[0]
        for name, path in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
            pkg = types.ModuleType(name)
            pkg.__path__ = [path]
            sys.modules[name] = pkg
    from streaming.base.dataset import StreamingDataset
    from streaming.base.format.mds.writer import MDSWriter

    return StreamingDataset, MDSWriter


def streaming_version() -> str:
    from streaming._version import __version__

    return __version__


def write_mds(case, work: Path, shard_bytes: int, **upload) -> str:
    """Write ``case``'s samples (same ids, same bytes) as MDS shards of about ``shard_bytes`` and upload them beside
    the foresight copy (``<url>-mds``; ``upload``: :func:`foresight.bucket.upload.upload_dir`'s ``options`` and
    ``concurrency``); returns the URL."""
    from foresight.bucket.upload import upload_dir

    _, MDSWriter = import_streaming()
    # MDSWriter closes a shard before a sample that would pass the limit, even an empty one: room for two samples
    shard_bytes = max(shard_bytes, 2 * int(case.length.max()) + 4096)
    out = work / f"{case.kind}-mds"
    shutil.rmtree(out, ignore_errors=True)
    fds = [os.open(p, os.O_RDONLY) for p in case.local.shard_paths]
    try:
        with MDSWriter(out=str(out), columns={"data": "bytes"}, size_limit=shard_bytes, compression=None) as w:
            for i in range(case.local.num_samples):
                w.write({"data": os.pread(fds[int(case.shard[i])], int(case.length[i]), int(case.offset[i]))})
    finally:
        for fd in fds:
            os.close(fd)
    url = case.url + "-mds"
    upload_dir(out, url, marker="index.json", what="MDS dataset", **upload)
    index = json.loads((out / "index.json").read_text())
    case.mds_shard_bytes = [int(s["raw_data"]["bytes"]) for s in index["shards"]]
    shutil.rmtree(out, ignore_errors=True)
    return url


def cache_limit_for(case, fraction: float) -> int:
    """``fraction`` of the MDS dataset, raised to the least Mosaic accepts (four times its largest shard)."""
    total, largest = sum(case.mds_shard_bytes), max(case.mds_shard_bytes)
    return max(int(total * fraction), 4 * largest + (1 << 20))


def block_for(case, limit: int) -> int:
    """A ``shuffle_block_size`` (samples) whose shards fill half of ``limit``, so that a block's shards fit the
    cache (its default block, 262,144 samples or more, spans a whole dataset of this bench's size: a random order
    over every shard, which a cache of a few shards thrashes on)."""
    mean = sum(case.mds_shard_bytes) / max(1, case.local.num_samples)
    return max(1, int(limit / 2 / mean))


def gets_of(size: int) -> int:
    """Requests of one boto3 ``download_file`` of ``size`` bytes: a HEAD, then one GET, or ranged GETs of 8 MiB."""
    return 1 + (1 if size <= MULTIPART else -(-size // MULTIPART))


class DownloadLog:
    """Counts Mosaic's shard downloads across its DataLoader workers (forked: the patched class is inherited):
    one line per object, appended to a file (O_APPEND: whole lines from any process)."""

    def __init__(self, work: Path) -> None:
        self.path = Path(tempfile.mkstemp(prefix="mosaic-downloads-", dir=work)[1])

    def patch(self):
        from streaming.base.storage.download import S3Downloader

        real, log = S3Downloader._download_file_impl, str(self.path)

        def counted(self, remote: str, local: str, timeout: float) -> None:
            real(self, remote, local, timeout)
            fd = os.open(log, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, f"{os.path.getsize(local)} {remote}\n".encode())
            finally:
                os.close(fd)

        return patch.object(S3Downloader, "_download_file_impl", counted)

    def totals(self) -> tuple[int, int, int]:
        """(objects downloaded, requests, bytes)."""
        sizes = [int(line.split(" ", 1)[0]) for line in self.path.read_text().splitlines() if line]
        self.path.unlink()
        return len(sizes), sum(gets_of(s) for s in sizes), sum(sizes)


def pack_samples(samples) -> dict:
    """A step's samples as one batch, the layout foresight's Loader delivers: ``data`` (one uint8 buffer, the
    samples back to back), ``offsets`` and ``lengths`` (int64) into it."""
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    data = np.empty(int(lengths.sum()), dtype=np.uint8)
    for s, off, n in zip(samples, offsets.tolist(), lengths.tolist()):
        data[off:off + n] = np.frombuffer(s, dtype=np.uint8)
    return {"data": data, "offsets": offsets, "lengths": lengths}


def pack_mds(samples: list[dict]) -> dict:
    """DataLoader ``collate_fn`` for MDS samples (``{"data": bytes}``): :func:`pack_samples`."""
    return pack_samples([s["data"] for s in samples])
