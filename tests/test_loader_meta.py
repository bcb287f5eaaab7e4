"""Loader(meta_fields=...): per-sample meta (captions, labels, ids) in sample batches, aligned with the samples and
with the decoded tensors; looked up in batches (one Arrow take + one JSON parse per shard), never per sample."""
from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from foresight.errors import FormatError
from foresight.format import DatasetWriter, open_dataset
from foresight.checksum import file_xxh3
from foresight.format.shard_map import write_map
from foresight.loader import Loader, MediaDecodeStage
from foresight.source.meta import sample_metas
from foresight.media import TransformSpec, probe_media
from foresight.plan import build_plan


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _caption(i: int) -> str:
    return f"photo {i}: a \"quoted\", comma'd caption \u00e9"


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    """24 images over several shards, meta as `foresight pack media` writes it (the probe's fields and the
    caption); every 5th has no caption nor id, every 3rd no label."""
    path = tmp_path_factory.mktemp("meta") / "ds"
    with DatasetWriter(str(path), shard_bytes=16 << 10) as w:
        for i in range(24):
            data = _jpeg(i)
            meta = probe_media(data, "image")
            if i % 5 != 4:
                meta.update(caption=_caption(i), id=f"img-{i:03d}")
                if i % 3:
                    meta["label"] = i % 7
            w.add(data, modality="image", meta=meta)
    ds = open_dataset(str(path))
    assert len(ds.manifest.shards) > 2
    return ds


def _want(field: str, sid: int):
    if sid % 5 == 4:
        return None
    return {"caption": _caption(sid), "id": f"img-{sid:03d}", "label": sid % 7 if sid % 3 else None}[field]


def test_meta_fields_align_with_samples(captioned):
    ds = captioned
    plan = build_plan([(ds, 1.0)], seed=3, global_batch_size=8, num_steps=6)  # shuffled, crosses epochs
    seen = 0
    with Loader(ds, plan, meta_fields=("caption", "label", "id")) as loader:
        for batch in loader:
            ids = batch["sample_ids"].tolist()
            for field in ("caption", "label", "id"):
                assert batch[field] == [_want(field, s) for s in ids]
            seen += len(ids)
        assert loader.stats.meta_s > 0
    assert seen == 48
    with Loader(ds, plan, meta_fields="caption", end_step=1) as loader:  # one name alone, not its letters
        assert set(next(iter(loader))) >= {"caption"}


def test_meta_fields_align_with_decoded_rows(captioned):
    ds = captioned
    plan = build_plan([(ds, 1.0)], seed=4, global_batch_size=6, num_steps=3)
    stage = MediaDecodeStage([ds], {"image": TransformSpec(modality="image", size=(16, 16))}, seed=1, threads=2)
    try:
        with Loader(ds, plan, decode=stage, meta_fields=("caption",)) as loader:
            for batch in loader:
                ids = batch["sample_ids"].tolist()
                rows = batch["image_index"].tolist()
                assert len(batch["image_caption"]) == batch["image"].shape[0] == len(rows)
                assert batch["image_caption"] == [_want("caption", ids[p]) for p in rows]
                kept = batch.clone()
            assert kept["caption"] == [_want("caption", s) for s in kept["sample_ids"].tolist()]
    finally:
        stage.close()


def test_meta_is_looked_up_in_batches_not_per_sample(captioned, monkeypatch):
    # The per-sample accessor is what the batch lookup replaces, in the loader and in the decode stage.
    ds = captioned

    def per_sample(i):
        raise AssertionError("Dataset.meta called per sample")

    monkeypatch.setattr(ds, "meta", per_sample)
    plan = build_plan([(ds, 1.0)], seed=5, global_batch_size=8, num_steps=2)
    stage = MediaDecodeStage([ds], {"image": TransformSpec(modality="image", size=(16, 16))}, seed=1, threads=2)
    try:
        with Loader(ds, plan, decode=stage, meta_fields=("id",)) as loader:
            for batch in loader:
                assert batch["id"] == [_want("id", s) for s in batch["sample_ids"].tolist()]
    finally:
        stage.close()


def test_meta_fields_in_a_mixture_of_datasets(captioned, tmp_path):
    other_path = tmp_path / "other"
    with DatasetWriter(str(other_path)) as w:
        for i in range(5):
            w.add(b"x" * (i + 1), modality="bytes", meta={"caption": f"other {i}"})
    other = open_dataset(str(other_path))
    plan = build_plan([(captioned, 0.5), (other, 0.5)], seed=2, global_batch_size=10, num_steps=3)
    with Loader([captioned, other], plan, meta_fields=("caption",)) as loader:
        for batch in loader:
            dsets, ids = batch["dataset"].tolist(), batch["sample_ids"].tolist()
            want = [_want("caption", s) if d == 0 else f"other {s}" for d, s in zip(dsets, ids)]
            assert batch["caption"] == want


def test_meta_fields_refused_for_token_plans(tmp_path):
    with DatasetWriter(str(tmp_path / "tok"), token_dtype="uint16") as w:
        w.add_many(np.arange(400, dtype=np.uint16), np.full(10, 40, np.int64), modality="tokens")
    ds = open_dataset(str(tmp_path / "tok"))
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=2, seq_len=16, num_steps=2)
    with pytest.raises(ValueError, match="meta_fields needs a sample plan"):
        Loader(ds, plan, meta_fields=("caption",))


@pytest.mark.parametrize("name", ["data", "sample_ids", "image", "video_index", ""])
def test_meta_fields_that_would_replace_batch_keys_are_refused(captioned, name):
    plan = build_plan([(captioned, 1.0)], seed=1, global_batch_size=4, num_steps=1)
    with pytest.raises(ValueError, match="meta field|non-empty"):
        Loader(captioned, plan, meta_fields=(name,))


def _with_meta_texts(path, texts: list[str]):
    """A dataset whose map holds ``texts`` as meta verbatim (a writer other than foresight's could write them):
    the map rewritten with the same columns, the manifest updated to its new size and checksum."""
    with DatasetWriter(str(path)) as w:
        for i in range(len(texts)):
            w.add(bytes([i]) * 10, modality="bytes")
    m = open_dataset(str(path))._maps[0]
    columns = {name: np.array(getattr(m, name)) for name in ("offset", "length", "modality", "checksum")}
    del m  # the old map stays mapped; the new one is written beside it and renamed over it
    raw = "".join(texts).encode()
    offsets = np.concatenate(([0], np.cumsum([len(t.encode()) for t in texts]))).astype(np.int64)
    map_path = os.path.join(str(path), "shard-00000.map")
    size = write_map(map_path + ".new", meta_offsets=offsets, meta_data=raw, **columns)
    os.replace(map_path + ".new", map_path)
    manifest_path = os.path.join(str(path), "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["shards"][0].update(map_bytes=size, map_xxh3=file_xxh3(map_path))
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return open_dataset(str(path))


def test_malformed_meta_names_the_sample(tmp_path):
    ds = _with_meta_texts(tmp_path / "bad", ['{"caption":"a"}', "not json", "", "[1]"])
    assert sample_metas([ds], None, np.array([2, 0])).tolist() == [{}, {"caption": "a"}]
    with pytest.raises(FormatError, match="not valid JSON") as e:
        sample_metas([ds], None, np.array([0, 1]))
    assert "sample=1" in str(e.value) and "shard-00000.map" in str(e.value)
    with pytest.raises(FormatError, match="not a JSON object") as e:
        sample_metas([ds], None, np.array([3]))
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=4, num_steps=1)
    with Loader(ds, plan, meta_fields=("caption",)) as loader:
        with pytest.raises(FormatError, match="sample=1"):
            next(iter(loader))
