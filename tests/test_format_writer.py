"""Shard writer and reader: round trips, alignment, sharding, lookups, checksums, errors."""
from __future__ import annotations

import errno
import json
import os
import pickle

import numpy as np
import pytest
import xxhash
from foresight.errors import ChecksumError, FormatError
from foresight.format import DatasetWriter, Extents, Modality, ShardedDataset, open_dataset
from format_helpers import random_tokens, split
from full_disk import full_disk  # noqa: F401 (a fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _pack_mixed(out, *, align, shard_bytes, seed=0):
    rng = np.random.default_rng(seed)
    tokens, lengths = random_tokens(rng, 300)
    expected: list[tuple[int, bytes, dict]] = []
    with DatasetWriter(out, align=align, shard_bytes=shard_bytes) as w:
        w.add(b"first", modality="bytes", meta={"k": 1})
        expected.append((Modality.BYTES, b"first", {"k": 1}))
        w.add_many(tokens, lengths, modality=Modality.TOKENS)
        expected += [(Modality.TOKENS, t.tobytes(), {}) for t in split(tokens, lengths)]
        w.add("ünïcode text", modality="text", meta={"lang": "x"})
        expected.append((Modality.TEXT, "ünïcode text".encode(), {"lang": "x"}))
        big = rng.integers(0, 255, size=3 * shard_bytes, dtype=np.uint8)  # bigger than a shard: alone
        w.add(big, modality=Modality.IMAGE, meta={"big": True})
        expected.append((Modality.IMAGE, big.tobytes(), {"big": True}))
        w.add_many(np.array([7, 8, 9], np.uint16), [0, 1, 2], modality="tokens", meta=[None, {"m": 2}, {}])
        expected += [(Modality.TOKENS, b"", {}), (Modality.TOKENS, np.array([7], np.uint16).tobytes(), {"m": 2}),
                     (Modality.TOKENS, np.array([8, 9], np.uint16).tobytes(), {})]
    return expected


@pytest.mark.parametrize("align", [0, 512, 4096])
def test_round_trip_mixed(tmp_path, align):
    out = tmp_path / "ds"
    expected = _pack_mixed(out, align=align, shard_bytes=64 << 10)
    ds = open_dataset(out)
    assert isinstance(ds, ShardedDataset) and ds.kind == "foresight"
    assert ds.num_samples == len(expected) == len(ds)
    assert ds.align == align and ds.token_dtype == np.dtype(np.uint16)
    assert ds.modalities == ["tokens", "text", "image", "bytes"]
    assert len(ds.shard_paths) > 3 and all(p.endswith(".bin") for p in ds.shard_paths)
    for i, (mod, payload, meta) in enumerate(expected):
        assert ds.read(i) == payload, i
        assert ds.meta(i) == meta
    codes = ds.modality_codes()
    assert codes.dtype == np.uint8 and list(codes) == [m for m, _, _ in expected]
    sizes = ds.sample_bytes()
    assert sizes.dtype == np.int64 and list(sizes) == [len(p) for _, p, _ in expected]
    counts = ds.token_counts()
    assert list(counts) == [len(p) // 2 if m == Modality.TOKENS else 0 for m, p, _ in expected]
    sums = ds.checksums()
    assert sums.dtype == np.uint64 and [int(s) for s in sums] == [xxhash.xxh3_64_intdigest(p) for _, p, _ in expected]
    ext = ds.lookup(np.arange(ds.num_samples))
    assert isinstance(ext, Extents) and ext.shard.dtype == np.int32
    assert ext.offset.dtype == np.int64 and ext.length.dtype == np.int64
    if align:
        assert (ext.offset % align == 0).all()
        assert all(os.path.getsize(p) % align == 0 for p in ds.shard_paths)
    # Extents point at the bytes: read them raw and verify in one batch.
    views = []
    for s, o, n in zip(ext.shard, ext.offset, ext.length):
        with open(ds.shard_paths[s], "rb") as f:
            f.seek(o)
            views.append(f.read(n))
    ds.verify(np.arange(ds.num_samples), views)
    ds.verify_files()
    # The manifest records what the contract promises.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "foresight-shards" and manifest["format_version"] == 1
    assert manifest["writer"].startswith("foresight ")
    assert [s["first_sample"] for s in manifest["shards"]] == list(np.searchsorted(ext.shard, range(len(ds.shard_paths))))


def test_lookup_matches_bruteforce_in_any_order(tmp_path):
    expected = _pack_mixed(tmp_path / "ds", align=4096, shard_bytes=32 << 10)
    ds = open_dataset(tmp_path / "ds")
    full = ds.lookup(np.arange(ds.num_samples))
    rng = np.random.default_rng(5)
    ids = rng.integers(0, len(expected), size=1000)
    part = ds.lookup(ids)
    for a, b in zip(part, full):
        assert np.array_equal(a, b[ids])
    assert all(x.size == 0 for x in ds.lookup(np.array([], np.int64)))
    with pytest.raises(IndexError, match="out of range"):
        ds.lookup(np.array([0, len(expected)]))
    with pytest.raises(IndexError):
        ds.read(-1)


def test_fingerprint_is_content_based(tmp_path):
    for name in ("a", "b"):
        _pack_mixed(tmp_path / name, align=4096, shard_bytes=64 << 10)
    _pack_mixed(tmp_path / "c", align=4096, shard_bytes=64 << 10, seed=1)
    fa, fb, fc = (open_dataset(tmp_path / n).fingerprint for n in "abc")
    assert fa == fb != fc


def test_empty_dataset_and_pickle(tmp_path):
    with DatasetWriter(tmp_path / "empty"):
        pass
    ds = open_dataset(tmp_path / "empty")
    assert ds.num_samples == 0 and ds.shard_paths == [] and ds.modalities == [] and ds.token_dtype is None
    assert ds.lookup(np.zeros(0, np.int64)).shard.size == 0
    assert ds.sample_bytes().size == 0 and ds.token_counts().size == 0
    _pack_mixed(tmp_path / "ds", align=0, shard_bytes=1 << 20)
    ds = open_dataset(tmp_path / "ds")
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.fingerprint == ds.fingerprint and clone.read(1) == ds.read(1)


def test_checksum_mismatch_names_shard_offset_sample(tmp_path):
    expected = _pack_mixed(tmp_path / "ds", align=4096, shard_bytes=64 << 10)
    ds = open_dataset(tmp_path / "ds")
    victim = 5
    ext = ds.lookup(np.array([victim]))
    path, off = ds.shard_paths[ext.shard[0]], int(ext.offset[0])
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    ds = open_dataset(tmp_path / "ds")  # the map is intact, so opening still works
    with pytest.raises(ChecksumError) as err:
        ds.read(victim)
    msg = str(err.value)
    assert f"shard={ext.shard[0]}" in msg and f"offset={off}" in msg and f"sample={victim}" in msg
    assert path in msg
    assert ds.read(victim, verify=False) != expected[victim][1]
    with pytest.raises(ChecksumError, match=f"sample={victim}"):
        ds.verify([0, victim], [expected[0][1], ds.read(victim, verify=False)])
    with pytest.raises(FormatError, match="shard checksum"):
        ds.verify_files()


def test_writer_argument_checks(tmp_path):
    with pytest.raises(ValueError, match="power of two"):
        DatasetWriter(tmp_path / "x", align=1000)
    with pytest.raises(ValueError, match="allowed"):
        DatasetWriter(tmp_path / "x", token_dtype="float32")
    with pytest.raises(ValueError, match="allowed"), DatasetWriter(tmp_path / "x") as w:
        w.add(b"x", modality="pixels")
    with DatasetWriter(tmp_path / "x", token_dtype="uint16") as w:
        with pytest.raises(ValueError, match="dtype int32"):
            w.add(np.zeros(3, np.int32), modality="tokens")
        with pytest.raises(ValueError, match="lengths sum"):
            w.add_many(np.zeros(3, np.uint16), [1, 1], modality="tokens")
        with pytest.raises(ValueError, match="whole number"):
            w.add(b"abc", modality="tokens")
    with pytest.raises(FileExistsError):
        DatasetWriter(tmp_path / "x")


def test_exception_aborts_and_overwrite_replaces(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError), DatasetWriter(out) as w:
        w.add(b"x", modality="bytes")
        raise RuntimeError("boom")
    assert not out.exists() and os.listdir(tmp_path) == []
    with DatasetWriter(out) as w:
        w.add(b"old", modality="bytes")
    with DatasetWriter(out, overwrite=True) as w:
        w.add(b"new", modality="bytes")
    assert open_dataset(out).read(0) == b"new"
    assert os.listdir(tmp_path) == ["ds"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 5000), max_size=40),
    align=st.sampled_from([0, 512, 4096]),
    shard_bytes=st.integers(1, 40000),
    batched=st.booleans(),
)
def test_property_round_trip(tmp_path_factory, lengths, align, shard_bytes, batched):
    out = tmp_path_factory.mktemp("p") / "ds"
    rng = np.random.default_rng(len(lengths))
    data = rng.integers(0, 255, size=sum(lengths), dtype=np.uint8)
    parts = split(data, np.array(lengths, np.int64))
    with DatasetWriter(out, align=align, shard_bytes=shard_bytes, fsync=False) as w:
        if batched:
            w.add_many(data, lengths, modality="bytes")
        else:
            for p in parts:
                w.add(p, modality="bytes")
    ds = open_dataset(out)
    assert ds.num_samples == len(lengths)
    for i, p in enumerate(parts):
        assert ds.read(i) == p.tobytes()
    ext = ds.lookup(np.arange(ds.num_samples))
    if align:
        assert (ext.offset % align == 0).all()
    # Shards respect the size cap unless a single sample is bigger than it.
    for s, path in enumerate(ds.shard_paths):
        in_shard = ext.length[ext.shard == s]
        assert os.path.getsize(path) <= max(shard_bytes + align, int(in_shard.max()) + align) or in_shard.size == 1


def test_verify_packed_batch(tmp_path):
    expected = _pack_mixed(tmp_path / "ds", align=0, shard_bytes=1 << 20)
    ds = open_dataset(tmp_path / "ds")
    ids = np.array([3, 1, 2, 0])
    payloads = [expected[i][1] for i in ids]
    positions = np.cumsum([0] + [len(p) for p in payloads[:-1]])
    buf = np.frombuffer(b"".join(payloads), np.uint8).copy()
    ds.verify_packed(ids, buf, positions)
    buf[positions[2]] ^= 1
    with pytest.raises(ChecksumError, match="sample=2"):
        ds.verify_packed(ids, buf, positions)
    with pytest.raises(ValueError, match="do not fit"):
        ds.verify_packed(ids, buf[:3], positions)


def test_closed_writer_refuses_more(tmp_path):
    w = DatasetWriter(tmp_path / "ds")
    w.add(b"a", modality="bytes")
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.add(b"b", modality="bytes")


def test_native_and_numpy_scatter_agree():
    from foresight.format.writer import _scatter, _scatter_numpy

    rng = np.random.default_rng(9)
    lengths = rng.integers(0, 50, size=30).astype(np.int64)
    src = rng.integers(0, 255, size=int(lengths.sum()), dtype=np.uint8)
    src_off = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    dst_off = np.concatenate(([0], np.cumsum((lengths + 63) // 64 * 64)[:-1])).astype(np.int64)
    a = np.zeros(int(dst_off[-1] + lengths[-1]), np.uint8)
    b = a.copy()
    _scatter(src, src_off, lengths, a, dst_off)
    _scatter_numpy(src, src_off, lengths, b, dst_off)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="out of bounds"):
        _scatter(src, src_off, lengths + 1000, a, dst_off)


# --- failure paths leave nothing behind and name the file -----------------------------------------------------------
def _tokens(nbytes: int) -> tuple[np.ndarray, list[int]]:
    n = nbytes // 2
    return np.arange(n, dtype=np.uint16), [n // 2, n - n // 2]


def test_full_disk_during_add_leaves_nothing_and_names_the_shard(full_disk):
    with pytest.raises(OSError) as err:
        with DatasetWriter(full_disk / "ds", align=0, buffer_bytes=64 << 10) as w:
            w.add_many(*_tokens(2 << 20), modality="tokens")
    assert err.value.errno == errno.ENOSPC and "shard-00000.bin" in str(err.value)
    assert f"the pack into {full_disk / 'ds'} stopped" in str(err.value)
    assert os.listdir(full_disk) == []
    with pytest.raises(ValueError, match="already closed"):  # the failed writer takes nothing more
        w.add(b"x", modality="bytes")


def test_full_disk_at_close_leaves_nothing_and_names_the_shard(full_disk):
    w = DatasetWriter(full_disk / "ds", align=0)
    w.add_many(*_tokens(1200 << 10), modality="tokens")  # fits the 8 MiB buffer: the disk fills at the flush
    with pytest.raises(OSError) as err:
        w.close()
    assert err.value.errno == errno.ENOSPC and "shard-00000.bin" in str(err.value)
    assert os.listdir(full_disk) == []
    w.abort()  # harmless afterwards


def test_abort_on_a_full_disk_keeps_the_callers_error(full_disk):
    with pytest.raises(KeyError, match="the caller's"):
        with DatasetWriter(full_disk / "ds", align=0) as w:
            w.add_many(*_tokens(1200 << 10), modality="tokens")
            raise KeyError("the caller's")  # abort() must not replace this with the ENOSPC of its flush
    assert os.listdir(full_disk) == []
    w = DatasetWriter(full_disk / "ds2", align=0)
    w.add_many(*_tokens(1200 << 10), modality="tokens")
    w.abort()
    assert os.listdir(full_disk) == []


def test_full_disk_while_replacing_keeps_the_old_dataset(full_disk):
    with DatasetWriter(full_disk / "ds", align=0) as w:
        w.add(b"old", modality="bytes")
    with pytest.raises(OSError, match="No space left"):
        with DatasetWriter(full_disk / "ds", align=0, overwrite=True) as w:
            w.add_many(*_tokens(2 << 20), modality="tokens")
    assert os.listdir(full_disk) == ["ds"] and open_dataset(full_disk / "ds").read(0) == b"old"


# The child writes under RLIMIT_FSIZE (no root needed): files past the limit fail with EFBIG, so the map or the
# manifest fails while the shard before it was written.
_FSIZE_CHILD = """
import json, os, resource, signal, sys
import numpy as np
from foresight.format import DatasetWriter
out, where = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
w = DatasetWriter(out, align=0, fsync=False, extra={"blob": "x" * (100 << 10)} if where == "manifest" else None)
if where == "map":  # 1000 one-byte samples whose meta makes a ~110 KiB map
    w.add_many(np.zeros(1000, np.uint8), np.ones(1000, np.int64), modality="bytes", meta=[{"n": "y" * 100}] * 1000)
else:
    w.add(b"tiny", modality="bytes")
try:
    w.close()
except OSError as e:
    print(json.dumps({"type": type(e).__name__, "errno": e.errno, "text": str(e)}))
"""


@pytest.mark.parametrize("where,name", [("map", "shard-00000.map"), ("manifest", "manifest.json.tmp")])
def test_failure_inside_close_leaves_nothing_and_names_the_file(tmp_path, where, name):
    import subprocess
    import sys

    parent = tmp_path / "d"
    proc = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(parent / "ds"), where], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    err = json.loads(proc.stdout)
    assert err["errno"] == errno.EFBIG and name in err["text"], err
    assert os.listdir(parent) == []


def test_failure_at_the_rename_leaves_nothing(tmp_path):
    w = DatasetWriter(tmp_path / "ds", align=0)
    w.add(b"x", modality="bytes")
    (tmp_path / "ds").mkdir()  # someone else created OUT meanwhile
    with pytest.raises(FileExistsError, match="appeared while packing"):
        w.close()
    assert os.listdir(tmp_path) == ["ds"] and os.listdir(tmp_path / "ds") == []


def test_out_under_a_file_is_named(tmp_path):
    (tmp_path / "somefile").write_text("")
    with pytest.raises(NotADirectoryError, match="Not a directory") as err:
        DatasetWriter(tmp_path / "somefile" / "ds")
    assert err.value.filename == str(tmp_path / "somefile")
