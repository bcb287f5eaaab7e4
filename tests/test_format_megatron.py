"""Megatron-LM indexed datasets: read in place, our writer, megatron-core compatibility, conversion to shards."""
from __future__ import annotations

import os
import struct
import warnings

import numpy as np
import pytest
from foresight.errors import FormatError
from foresight.format import MegatronDataset, open_dataset, pack_megatron, write_megatron_dataset
from foresight.format.megatron import MEGATRON_DTYPES
from format_helpers import random_tokens, split


def _megatron_core():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
        return indexed_dataset
    except Exception as e:  # not installed, or not importable beside this torch
        pytest.skip(f"megatron-core not importable: {type(e).__name__}: {e}")


@pytest.mark.parametrize("code", sorted(MEGATRON_DTYPES))
def test_round_trip_every_dtype(tmp_path, code):
    dt = MEGATRON_DTYPES[code]
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dt) for n in (5, 0, 17, 1)]
    docs.append([np.arange(3, dtype=dt), np.arange(4, dtype=dt)])  # one document, two sequences
    write_megatron_dataset(tmp_path / "m", docs, dt)
    ds = open_dataset(tmp_path / "m.idx")
    assert isinstance(ds, MegatronDataset) and ds.kind == "megatron"
    seqs = docs[:4] + docs[4]
    assert ds.num_samples == len(seqs) and ds.num_documents == 5 and ds.token_dtype == dt
    assert ds.shard_paths == [str(tmp_path / "m.bin")] and ds.align == 0 and ds.modalities == ["tokens"]
    for i, s in enumerate(seqs):
        assert np.array_equal(ds.tokens(i), s)
    assert list(ds.token_counts()) == [len(s) for s in seqs]
    assert list(ds.sample_bytes()) == [len(s) * dt.itemsize for s in seqs]
    ext = ds.lookup(np.array([5, 0]))
    assert ext.shard.dtype == np.int32 and list(ext.shard) == [0, 0]
    assert list(ext.offset) == [sum(len(s) for s in seqs[:5]) * dt.itemsize, 0]
    assert ds.checksums() is None and (ds.modality_codes() == 0).all()
    assert ds.meta(5) == {"document": 4} and ds.meta(4) == {"document": 4}
    ds.verify([0], [b"anything"])  # nothing recorded to compare against


def test_fingerprint_tracks_index_content(tmp_path):
    write_megatron_dataset(tmp_path / "a", [np.arange(5)], np.uint16)
    write_megatron_dataset(tmp_path / "b", [np.arange(5)], np.uint16)
    write_megatron_dataset(tmp_path / "c", [np.arange(6)], np.uint16)
    fa, fb, fc = (open_dataset(tmp_path / n).fingerprint for n in "abc")
    assert fa == fb != fc


def test_multimodal_modes(tmp_path):
    docs = [[np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)], np.arange(4, dtype=np.int32)]
    write_megatron_dataset(tmp_path / "mm", docs, np.int32, modes=[0, 1, 2])
    ds = open_dataset(tmp_path / "mm")
    assert list(ds.sequence_modes) == [0, 1, 2]
    assert ds.meta(1) == {"document": 0, "mode": 1} and ds.meta(2) == {"document": 1, "mode": 2}


def test_megatron_core_builder_reads_here(tmp_path):
    idx = _megatron_core()
    import torch

    rng = np.random.default_rng(3)
    tokens, lengths = random_tokens(rng, 50)
    seqs = split(tokens, lengths)
    builder = idx.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for s in seqs[:40]:
        builder.add_item(torch.from_numpy(s.astype(np.int64)))
        builder.end_document()
    builder.add_document(np.concatenate(seqs[40:]).astype(np.int64), [len(s) for s in seqs[40:]])
    builder.finalize(str(tmp_path / "mc.idx"))
    ds = open_dataset(tmp_path / "mc")
    assert ds.num_samples == 50 and ds.num_documents == 41
    for i, s in enumerate(seqs):
        assert np.array_equal(ds.tokens(i), s)
    # ...and multimodal builders (int8 modes appended) too.
    builder = idx.IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.int32, multimodal=True)
    for k, s in enumerate(seqs[:6]):
        builder.add_item(torch.from_numpy(s.astype(np.int64)), mode=k % 3)
        builder.end_document()
    builder.finalize(str(tmp_path / "mm.idx"))
    ds = open_dataset(tmp_path / "mm")
    assert list(ds.sequence_modes) == [k % 3 for k in range(6)]
    assert np.array_equal(ds.tokens(5), seqs[5].astype(np.int32))


def test_megatron_core_reads_our_writer(tmp_path):
    idx = _megatron_core()
    rng = np.random.default_rng(4)
    tokens, lengths = random_tokens(rng, 30, dtype=np.int32)
    seqs = split(tokens, lengths)
    write_megatron_dataset(tmp_path / "ours", seqs[:20] + [seqs[20:]], np.int32)
    ref = idx.IndexedDataset(str(tmp_path / "ours"))
    assert len(ref) == 30
    for i, s in enumerate(seqs):
        assert np.array_equal(ref[i], s)
    assert list(ref.document_indices) == list(range(21)) + [30]
    write_megatron_dataset(tmp_path / "mm", seqs[:4], np.int32, modes=[1, 0, 1, 0])
    ref = idx.IndexedDataset(str(tmp_path / "mm"), multimodal=True)
    assert list(ref.index.sequence_modes) == [1, 0, 1, 0]  # (its .sequence_modes property is buggy)


def test_pack_megatron_to_shards(tmp_path):
    rng = np.random.default_rng(5)
    tokens, lengths = random_tokens(rng, 200, vocab=60000)
    seqs = split(tokens, lengths)
    write_megatron_dataset(tmp_path / "m", seqs, np.uint16)
    out = pack_megatron(tmp_path / "m", tmp_path / "shards", align=4096, shard_bytes=32 << 10, progress=False,
                        batch_tokens=1000)
    ds = open_dataset(out)
    src = open_dataset(tmp_path / "m")
    assert ds.num_samples == 200 and ds.token_dtype == np.uint16 and len(ds.shard_paths) > 3
    assert np.array_equal(ds.token_counts(), src.token_counts())
    for i in range(0, 200, 7):
        assert ds.read(i) == src.read(i)
    assert ds.meta(3) == {}  # one sequence per document: nothing extra to keep
    assert ds.manifest.extra["megatron_fingerprint"] == src.fingerprint
    # Multi-sequence documents and modes survive in meta.
    write_megatron_dataset(tmp_path / "mm", [[seqs[0], seqs[1]], seqs[2]], np.uint16, modes=[2, 1, 0])
    ds = open_dataset(pack_megatron(tmp_path / "mm", tmp_path / "s2", progress=False))
    assert [ds.meta(i) for i in range(3)] == [{"document": 0, "mode": 2}, {"document": 0, "mode": 1},
                                              {"document": 1, "mode": 0}]


def test_missing_files(tmp_path):
    write_megatron_dataset(tmp_path / "m", [np.arange(4)], np.uint16)
    os.unlink(tmp_path / "m.bin")
    with pytest.raises(FormatError, match="m.bin"):
        open_dataset(tmp_path / "m")
    write_megatron_dataset(tmp_path / "n", [np.arange(4)], np.uint16)
    os.unlink(tmp_path / "n.idx")
    with pytest.raises(FormatError, match="n.idx"):
        open_dataset(tmp_path / "n")
    with pytest.raises(FormatError, match="no dataset"):
        open_dataset(tmp_path / "nothing")


# --- an .idx/.bin pair must agree the way Megatron writes it, or be refused --------------------------------------
def _patch_idx(prefix, offset: int, fmt: str, value: int) -> None:
    idx = f"{prefix}.idx"
    data = bytearray(open(idx, "rb").read())
    struct.pack_into(fmt, data, offset, value)
    open(idx, "wb").write(bytes(data))


def _pointer_offset(n: int, i: int) -> int:
    return 34 + 4 * n + 8 * i  # header, n int32 lengths, then int64 pointers


def test_idx_beside_another_datasets_larger_bin_is_refused(tmp_path):
    rng = np.random.default_rng(6)
    write_megatron_dataset(tmp_path / "small", [rng.integers(0, 9, 40).astype(np.uint16) for _ in range(5)],
                           np.uint16)
    write_megatron_dataset(tmp_path / "big", [rng.integers(0, 9, 90).astype(np.uint16) for _ in range(5)], np.uint16)
    os.replace(tmp_path / "big.bin", tmp_path / "small.bin")
    with pytest.raises(FormatError, match=r"\.bin is 900 bytes but the sequences of small\.idx end at byte 400") as e:
        open_dataset(tmp_path / "small")
    assert f"path={tmp_path / 'small.bin'}" in str(e.value)  # the error is about the .bin: it names the .bin
    with pytest.raises(FormatError, match="does not belong"):
        pack_megatron(tmp_path / "small", tmp_path / "out", progress=False)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("code", [1, 4, 5, 6, 7])  # uint8, int32, int64, float64, float32: other widths than uint16
def test_changed_dtype_code_is_refused(tmp_path, code):
    rng = np.random.default_rng(code)
    write_megatron_dataset(tmp_path / "m", [rng.integers(1, 9, int(k)).astype(np.uint16) for k in (7, 3, 12, 5)],
                           np.uint16)
    _patch_idx(tmp_path / "m", 17, "<B", code)
    with pytest.raises(FormatError, match=r"fit 2-byte items \(int16, uint16\): is the dtype code") as e:
        open_dataset(tmp_path / "m")
    assert "m.idx" in str(e.value) or "m.bin" in str(e.value)


def test_pointer_not_a_multiple_of_the_item_size_is_refused(tmp_path):
    write_megatron_dataset(tmp_path / "m", [np.arange(6), np.arange(6), np.arange(6)], np.int32)
    _patch_idx(tmp_path / "m", _pointer_offset(3, 1), "<q", 26)  # inside the .bin, but mid-token
    with pytest.raises(FormatError, match="not a multiple of the 4-byte int32 item size") as e:
        open_dataset(tmp_path / "m")
    assert "m.idx" in str(e.value) and "sample=1" in str(e.value) and "offset=26" in str(e.value)


@pytest.mark.parametrize("pointers", [(24, 0, 48), (0, 28, 48), (4, 24, 48)])  # swapped, a gap, not from 0
def test_pointers_not_the_running_sum_of_lengths_are_refused(tmp_path, pointers):
    write_megatron_dataset(tmp_path / "m", [np.arange(6), np.arange(6), np.arange(6)], np.int32)
    for i, p in enumerate(pointers):
        _patch_idx(tmp_path / "m", _pointer_offset(3, i), "<q", p)
    bad = next(i for i, p in enumerate(pointers) if p != 24 * i)
    with pytest.raises(FormatError, match=f"pointer is not byte {24 * bad}, where the previous sequence ends") as e:
        open_dataset(tmp_path / "m")
    assert "m.idx" in str(e.value) and f"sample={bad}" in str(e.value)


def test_content_fingerprint_covers_the_bin(tmp_path):
    write_megatron_dataset(tmp_path / "m", [np.arange(5), np.arange(3)], np.uint16)
    index_before = open_dataset(tmp_path / "m").fingerprint
    content_before = open_dataset(tmp_path / "m", fingerprint="content").fingerprint
    assert content_before.startswith("content:") and content_before != index_before
    with open(tmp_path / "m.bin", "r+b") as f:  # same size, other tokens
        f.write(b"\xff\xff")
    assert open_dataset(tmp_path / "m").fingerprint == index_before  # documented: the index hash cannot see it
    assert MegatronDataset(tmp_path / "m", fingerprint="content").fingerprint != content_before
    with pytest.raises(ValueError, match="fingerprint must be"):
        open_dataset(tmp_path / "m", fingerprint="bin")
