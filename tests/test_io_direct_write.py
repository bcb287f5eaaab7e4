"""The writer of received bytes (the bucket cache's GETs, a replication site's units): large writes O_DIRECT
through aligned bounce buffers, and a file system that refuses O_DIRECT at the first write (some FUSE and network
file systems open the descriptor, then fail the write with EINVAL) falls back to buffered writes with every byte in
place."""
from __future__ import annotations

import errno
import os

import numpy as np

from foresight.io import direct_write
from foresight.io.direct_write import DIRECT_MIN, CacheWriter


def _writer(tmp_path, size):
    path = str(tmp_path / "shard.bin")
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    return path, fd, CacheWriter([path], [fd])


def test_a_large_unaligned_write_lands_every_byte_and_goes_direct(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, size=3 * DIRECT_MIN + 123, dtype=np.uint8)
    path, fd, w = _writer(tmp_path, data.size + 5000)
    try:
        assert w.pwrite(0, data, 777) == data.size
        assert w.stats["direct_bytes"] >= DIRECT_MIN and not w.stats["fallbacks"]
    finally:
        w.close()
        os.close(fd)
    with open(path, "rb") as f:
        f.seek(777)
        assert f.read(data.size) == data.tobytes()


def test_a_write_refused_with_einval_falls_back_to_buffered_writes(tmp_path, monkeypatch, caplog):
    data = np.random.default_rng(2).integers(0, 256, size=direct_write.BOUNCE_BYTES * 2 + 4096 * 3 + 11,
                                            dtype=np.uint8)
    path, fd, w = _writer(tmp_path, data.size + 10000)
    real_pwrite, refused = os.pwrite, []

    def pwrite(f, buf, off):  # the direct descriptor takes the first piece, then refuses (a fault injected)
        if f in w._direct_fds.values() and off > 8192:
            refused.append(off)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(f, buf, off)

    monkeypatch.setattr(direct_write.os, "pwrite", pwrite)
    try:
        assert w.pwrite(0, data, 5) == data.size
        assert w.stats["fallbacks"] == 1 and refused and not w.direct
        assert w.pwrite(0, data, 5) == data.size  # later writes go buffered at once
        assert len(refused) == 1
    finally:
        w.close()
        os.close(fd)
    assert "refuses O_DIRECT" in caplog.text
    with open(path, "rb") as f:
        f.seek(5)
        assert f.read(data.size) == data.tobytes()
