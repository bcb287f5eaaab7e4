"""Every parser (manifest, shard map, Megatron .idx) turns bad input into a FormatError naming the file.

Hypothesis mutates valid files (truncation, flipped bytes, overwritten ranges, rewritten fields); the only allowed
outcomes are a clean open whose extents stay inside the shard files, or FormatError. Anything else (another
exception type, a crash) fails the test.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import xxhash
from foresight.errors import FormatError
from foresight.format import DatasetWriter, open_dataset, write_megatron_dataset
from foresight.format.shard_map import read_map
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

# FORESIGHT_FUZZ_EXAMPLES=5000 for a long local campaign; CI keeps it small.
FUZZ = settings(max_examples=int(os.environ.get("FORESIGHT_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "ds"
    rng = np.random.default_rng(0)
    with DatasetWriter(out, align=512, shard_bytes=8 << 10, fsync=False) as w:
        lengths = rng.integers(1, 900, size=40)
        w.add_many(rng.integers(0, 9, size=int(lengths.sum())).astype(np.uint16), lengths, modality="tokens")
        w.add(b"image bytes", modality="image", meta={"fps": 25, "keyframes": [0, 12]})
    return out


@pytest.fixture(scope="module")
def good_megatron(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("mg") / "m"
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50, size=n).astype(np.int32) for n in (3, 0, 9, 4)]
    write_megatron_dataset(prefix, docs + [[np.arange(2, dtype=np.int32), np.arange(5, dtype=np.int32)]], np.int32)
    return prefix


def _copy(src, dst):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


_REFERENCE: dict[str, list[bytes]] = {}  # the unmutated dataset's samples, by fixture path


def _reference(path) -> list[bytes]:
    key = str(path)
    if key not in _REFERENCE:
        ds = open_dataset(path)
        _REFERENCE[key] = [ds.read(i) for i in range(ds.num_samples)]
    return _REFERENCE[key]


def _check_opened(ds, reference: list[bytes] | None = None):
    """A dataset that opened must only point inside its shard files, and never hand out a wrong byte: each sample
    reads back as the original or fails with an error naming the file."""
    ext = ds.lookup(np.arange(ds.num_samples))
    sizes = np.array([os.path.getsize(p) for p in ds.shard_paths] or [0], np.int64)
    assert (ext.offset >= 0).all() and (ext.length >= 0).all()
    assert (ext.offset + ext.length <= sizes[ext.shard]).all()
    if reference is None:
        return
    assert ds.num_samples == len(reference), "a mutated file changed the sample count without an error"
    for i in range(ds.num_samples):
        try:
            got = ds.read(i, verify=True)
        except FormatError as e:  # ChecksumError included
            assert any(p in str(e) for p in ds.shard_paths) or "path=" in str(e), e
            continue
        assert got == reference[i], f"sample {i} read back different bytes without an error"


def _expect_format_error_or_ok(fn, *names, reference: list[bytes] | None = None):
    """Either a FormatError naming one of ``names``, or a dataset that reads back exactly (see _check_opened)."""
    try:
        ds = fn()
    except FormatError as e:
        assert any(n in str(e) for n in names), f"error does not name the file: {e}"
        return None
    _check_opened(ds, reference)
    return ds


def _mutate(data: bytes, kind: str, pos: int, blob: bytes) -> bytes:
    pos = pos % (len(data) + 1)
    if kind == "truncate":
        return data[:pos]
    if kind == "flip":
        if not data:
            return data
        pos %= len(data)
        return data[:pos] + bytes([data[pos] ^ (blob[0] if blob and blob[0] else 0x5A)]) + data[pos + 1 :]
    if kind == "overwrite":
        return data[:pos] + blob + data[pos + len(blob) :]
    return data[:pos] + blob + data[pos:]  # insert


mutations = st.tuples(st.sampled_from(["truncate", "flip", "overwrite", "insert"]), st.integers(0, 1 << 20),
                      st.binary(min_size=1, max_size=16))


# --- manifest ------------------------------------------------------------------------------------------------------
@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_manifest_arbitrary(good_dataset, tmp_path_factory, raw):
    ds_dir = _copy(good_dataset, tmp_path_factory.getbasetemp() / "fuzz_manifest_any")
    (ds_dir / "manifest.json").write_bytes(raw)
    with pytest.raises(FormatError, match="manifest.json"):
        open_dataset(ds_dir)


@FUZZ
@given(path=st.lists(st.sampled_from(["shards", 0, 1, "bin", "map", "num_samples", "first_sample", "bin_bytes",
                                      "map_bytes", "map_xxh3", "align", "token_dtype", "modalities",
                                      "format_version", "total_bytes", "format", "writer", "extra"]),
                     min_size=1, max_size=3),
       value=json_values, delete=st.booleans())
def test_fuzz_manifest_fields(good_dataset, tmp_path_factory, path, value, delete):
    ds_dir = _copy(good_dataset, tmp_path_factory.getbasetemp() / "fuzz_manifest_fields")
    doc = json.loads((ds_dir / "manifest.json").read_text())
    node = doc
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            assume(False)  # no such field: not an example (hypothesis draws another) rather than a silent pass
    try:
        if delete:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        assume(False)
    (ds_dir / "manifest.json").write_text(json.dumps(doc))
    _expect_format_error_or_ok(lambda: open_dataset(ds_dir), f"path={ds_dir}/", reference=_reference(good_dataset))


@FUZZ
@given(m=mutations)
def test_fuzz_manifest_bytes(good_dataset, tmp_path_factory, m):
    ds_dir = _copy(good_dataset, tmp_path_factory.getbasetemp() / "fuzz_manifest_bytes")
    p = ds_dir / "manifest.json"
    p.write_bytes(_mutate(p.read_bytes(), *m))
    _expect_format_error_or_ok(lambda: open_dataset(ds_dir), f"path={ds_dir}/", reference=_reference(good_dataset))


# --- shard maps ----------------------------------------------------------------------------------------------------
def _reseal(ds_dir, shard, data):
    """Write a changed map and update the manifest so that only the map parser can object."""
    manifest = json.loads((ds_dir / "manifest.json").read_text())
    entry = manifest["shards"][shard]
    (ds_dir / entry["map"]).write_bytes(data)
    entry["map_bytes"], entry["map_xxh3"] = len(data), xxhash.xxh3_64_hexdigest(data)
    (ds_dir / "manifest.json").write_text(json.dumps(manifest))
    return ds_dir / entry["map"]


@FUZZ
@given(m=mutations, shard=st.integers(0, 1), sealed=st.booleans())
def test_fuzz_map_bytes(good_dataset, tmp_path_factory, m, shard, sealed):
    ds_dir = _copy(good_dataset, tmp_path_factory.getbasetemp() / "fuzz_map")
    manifest = json.loads((ds_dir / "manifest.json").read_text())
    entry = manifest["shards"][shard]
    path = ds_dir / entry["map"]
    data = _mutate(path.read_bytes(), *m)
    if sealed:
        _reseal(ds_dir, shard, data)
    else:
        path.write_bytes(data)
    _expect_format_error_or_ok(lambda: open_dataset(ds_dir), entry["map"])
    # The map parser on its own (no checksum in front of it).
    try:
        sm = read_map(str(path), rows=entry["num_samples"], bin_bytes=entry["bin_bytes"], align=512,
                      token_itemsize=2, first_sample=entry["first_sample"])
    except FormatError as e:
        assert entry["map"] in str(e)
    else:
        assert (sm.offset + sm.length <= entry["bin_bytes"]).all()
        for row in range(len(sm)):
            try:
                sm.meta_json(row)
            except FormatError as e:
                assert entry["map"] in str(e)


@pytest.mark.parametrize("column,value,message", [
    ("offset", 1 << 40, "past the end"),
    ("offset", 3, "not aligned"),
    ("length", 1 << 62, "past the end"),
    ("modality", 9, "unknown modality"),
    ("length", 3, "multiple of 2"),
])
def test_map_values_checked(good_dataset, tmp_path, column, value, message):
    import pyarrow as pa
    from foresight.format.shard_map import write_map

    ds_dir = _copy(good_dataset, tmp_path / "ds")
    path = ds_dir / "shard-00000.map"
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    cols = {name: table.column(name).to_numpy().copy() for name in ("offset", "length", "modality", "checksum")}
    cols[column][2] = value
    meta = table.column("meta").combine_chunks()
    offsets = np.frombuffer(meta.buffers()[1], np.int64)[: len(meta) + 1]
    write_map(str(path), **cols, meta_offsets=offsets, meta_data=b"", fsync=False)
    _reseal(ds_dir, 0, path.read_bytes())
    with pytest.raises(FormatError, match=message) as err:
        open_dataset(ds_dir)
    assert "shard-00000.map" in str(err.value) and "sample=2" in str(err.value)


def test_truncated_bin_is_named(good_dataset, tmp_path):
    ds_dir = _copy(good_dataset, tmp_path / "ds")
    with open(ds_dir / "shard-00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(FormatError, match="shard-00001.bin"):
        open_dataset(ds_dir)
    os.unlink(ds_dir / "shard-00001.map")
    with pytest.raises(FormatError, match="shard-00001"):
        open_dataset(ds_dir)


# --- Megatron .idx -------------------------------------------------------------------------------------------------
def _idx_copy(prefix, dst):
    dst.mkdir(exist_ok=True)
    for ext in (".idx", ".bin"):
        shutil.copy(str(prefix) + ext, dst / ("m" + ext))
    return dst / "m"


@FUZZ
@given(m=mutations)
def test_fuzz_idx_bytes(good_megatron, tmp_path_factory, m):
    prefix = _idx_copy(good_megatron, tmp_path_factory.getbasetemp() / "fuzz_idx")
    idx = prefix.with_suffix(".idx")
    idx.write_bytes(_mutate(idx.read_bytes(), *m))
    _expect_format_error_or_ok(lambda: open_dataset(prefix), "m.idx", "m.bin", reference=_reference(good_megatron))


@FUZZ
@given(field=st.sampled_from(["version", "code", "n", "d", "length", "pointer", "doc"]),
       value=st.integers(-(2**63), 2**64 - 1), index=st.integers(0, 6))
def test_fuzz_idx_fields(good_megatron, tmp_path_factory, field, value, index):
    prefix = _idx_copy(good_megatron, tmp_path_factory.getbasetemp() / "fuzz_idx_fields")
    idx = prefix.with_suffix(".idx")
    data = bytearray(idx.read_bytes())
    n, d = struct.unpack_from("<QQ", data, 18)
    where = {"version": (9, "<Q"), "code": (17, "<B"), "n": (18, "<Q"), "d": (26, "<Q"),
             "length": (34 + 4 * (index % n), "<i"), "pointer": (34 + 4 * n + 8 * (index % n), "<q"),
             "doc": (34 + 12 * n + 8 * (index % d), "<q")}[field]
    fmt = where[1]
    bits = struct.calcsize(fmt) * 8
    value %= 1 << bits
    if fmt[1].islower() and value >= 1 << (bits - 1):
        value -= 1 << bits
    struct.pack_into(fmt, data, where[0], value)
    idx.write_bytes(bytes(data))
    _expect_format_error_or_ok(lambda: open_dataset(prefix), "m.idx", "m.bin", reference=_reference(good_megatron))


@pytest.mark.parametrize("patch,message", [
    (lambda b: b[:20], "truncated .idx header"),
    (lambda b: b"XXIDIDX\x00\x00" + b[9:], "bad magic"),
    (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "unsupported .idx version"),
    (lambda b: b[:17] + bytes([9]) + b[18:], "unknown dtype code"),
    (lambda b: b[:18] + struct.pack("<Q", 99) + b[26:], "need"),
    (lambda b: b[:-3], "need"),
    (lambda b: b[:34 + 4 * 6] + struct.pack("<q", 1 << 40) + b[34 + 4 * 6 + 8:], "outside"),
    (lambda b: b[:34] + struct.pack("<i", -1) + b[38:], "negative sequence length"),
    (lambda b: b[:34] + struct.pack("<i", 1 << 30) + b[38:], "past the end"),
    (lambda b: b[:-8] + struct.pack("<q", 99), "document index ends"),
])
def test_idx_errors(good_megatron, tmp_path, patch, message):
    prefix = _idx_copy(good_megatron, tmp_path)
    idx = prefix.with_suffix(".idx")
    idx.write_bytes(patch(idx.read_bytes()))
    with pytest.raises(FormatError, match=message) as err:
        open_dataset(prefix)
    assert "m.idx" in str(err.value)
