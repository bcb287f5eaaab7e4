"""Packers and the ``foresight pack`` CLI: JSONL, Parquet, media folders, with real files."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from foresight.cli import main as foresight_main
from foresight.errors import FormatError
from foresight.format import Modality, open_dataset, pack_jsonl, pack_media, pack_parquet
from format_helpers import make_media_folder, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(n=120, vocab=1000):
    rng = np.random.default_rng(0)
    return [
        {"text": "ünï " * (i % 7) + str(i), "input_ids": rng.integers(0, vocab, size=i % 13).tolist(), "n": i}
        for i in range(n)
    ]


def test_jsonl_text_falls_back_to_utf8_bytes(tmp_path):
    rows = _rows()
    rows[10]["text"] = None
    path = write_jsonl(str(tmp_path / "in.jsonl"), rows)
    ds = open_dataset(pack_jsonl(path, tmp_path / "out", column="text", progress=False, batch_rows=16))
    kept = [r["text"] for r in rows if r["text"] is not None]
    assert ds.num_samples == len(kept) and ds.modalities == ["text"] and ds.token_dtype is None
    assert [ds.read(i).decode() for i in range(ds.num_samples)] == kept
    assert (ds.modality_codes() == Modality.TEXT).all() and (ds.token_counts() == 0).all()
    assert ds.manifest.extra["skipped_null_rows"] == 1 and ds.align == 0


@pytest.mark.parametrize("vocab,dtype", [(1000, np.uint16), (70000, np.uint32)])
def test_jsonl_and_parquet_token_ids(tmp_path, vocab, dtype):
    rows = _rows(vocab=vocab)
    rows[-1]["input_ids"] = [vocab - 1]  # the largest id decides the dtype
    jsonl = write_jsonl(str(tmp_path / "in.jsonl"), rows)
    parquet = str(tmp_path / "in.parquet")
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=17)
    for name, fn, src in (("j", pack_jsonl, jsonl), ("p", pack_parquet, parquet)):
        ds = open_dataset(fn(src, tmp_path / name, progress=False, align=4096, batch_rows=10))
        assert ds.token_dtype == np.dtype(dtype) and ds.modalities == ["tokens"]
        assert ds.manifest.extra["column"] == "input_ids"  # found automatically
        for i, r in enumerate(rows):
            assert np.frombuffer(ds.read(i), dtype).tolist() == r["input_ids"]
        assert ds.token_counts().tolist() == [len(r["input_ids"]) for r in rows]


def test_text_with_a_tokenizer(tmp_path):
    rows = _rows(20)
    path = write_jsonl(str(tmp_path / "in.jsonl"), rows)

    def tokenizer(texts):
        return [list(t.encode()) for t in texts]

    tokenizer.vocab_size = 256
    ds = open_dataset(pack_jsonl(path, tmp_path / "o", column="text", tokenizer=tokenizer, progress=False))
    assert ds.token_dtype == np.uint16
    assert bytes(np.frombuffer(ds.read(3), np.uint16).astype(np.uint8)) == rows[3]["text"].encode()


def test_bad_inputs_name_the_file(tmp_path):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"a": 1.5}])
    with pytest.raises(FormatError, match="in.jsonl"):
        pack_jsonl(path, tmp_path / "o", progress=False)
    with pytest.raises(FormatError, match="expected a string or a list of integers"):
        pack_jsonl(path, tmp_path / "o", column="a", progress=False)
    path = write_jsonl(str(tmp_path / "neg.jsonl"), [{"ids": [1, -2]}])
    with pytest.raises(FormatError, match="negative token id"):
        pack_jsonl(path, tmp_path / "o", progress=False)
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    with pytest.raises(FormatError, match="junk.jsonl"):
        pack_jsonl(tmp_path / "junk.jsonl", tmp_path / "o", progress=False)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(FormatError, match="junk.parquet"):
        pack_parquet(tmp_path / "junk.parquet", tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("captions_kind", ["jsonl", "csv", None])
def test_media_folder(tmp_path, captions_kind):
    src = tmp_path / "media"
    files = make_media_folder(str(src))
    captions = None
    if captions_kind == "jsonl":
        captions = write_jsonl(str(tmp_path / "cap.jsonl"), [{"file": "a.png", "caption": "first"},
                                                              {"file_name": "sub/c.png", "text": "third"}])
    elif captions_kind == "csv":
        captions = str(tmp_path / "cap.csv")
        with open(captions, "w", newline="") as f:
            csv.writer(f).writerows([["file", "caption"], ["clip.mp4", "a clip"], ["c.png", "by base name"]])
    ds = open_dataset(pack_media(src, tmp_path / "out", captions=captions, progress=False))
    names = sorted(files)
    assert ds.num_samples == len(names) and ds.align == 4096
    assert ds.modalities == ["image", "video", "audio"]
    expected_mod = {".png": Modality.IMAGE, ".jpg": Modality.IMAGE, ".wav": Modality.AUDIO, ".mp4": Modality.VIDEO}
    for i, rel in enumerate(names):
        meta = ds.meta(i)
        assert meta["file"] == rel and meta["bytes"] == len(files[rel])
        assert ds.read(i) == files[rel]
        assert ds.modality_codes()[i] == expected_mod[os.path.splitext(rel)[1]]
    caps = {ds.meta(i)["file"]: ds.meta(i).get("caption") for i in range(ds.num_samples)}
    if captions_kind == "jsonl":
        assert caps["a.png"] == "first" and caps["sub/c.png"] == "third" and caps["clip.mp4"] is None
    elif captions_kind == "csv":
        assert caps["clip.mp4"] == "a clip" and caps["sub/c.png"] == "by base name"
    assert (ds.lookup(np.arange(ds.num_samples)).offset % 4096 == 0).all()
    if ds.manifest.extra["probe"]:  # the media layer's probe ran: its fields are in the meta
        video = ds.meta(names.index("clip.mp4"))
        assert video["file"] == "clip.mp4" and len(video) > 3


def test_media_probe_errors(tmp_path):
    pytest.importorskip("foresight.media.probe")
    src = tmp_path / "media"
    make_media_folder(str(src))
    (src / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    with pytest.raises(ValueError, match="broken.mp4"):  # DecodeError or FormatError, both ValueErrors
        pack_media(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    ds = open_dataset(pack_media(src, tmp_path / "out", on_error="skip", progress=False))
    assert ds.num_samples == 5 and ds.manifest.extra["skipped"] == ["broken.mp4"]


def test_media_folder_with_nothing_to_pack_is_refused(tmp_path):
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    (tmp_path / "empty" / ".hidden" / "a.png").write_bytes(b"skipped: hidden")
    with pytest.raises(FormatError, match="no media files here") as err:
        pack_media(tmp_path / "empty", tmp_path / "out", progress=False)
    assert str(tmp_path / "empty") in str(err.value) and not (tmp_path / "out").exists()
    pytest.importorskip("foresight.media.probe")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    with pytest.raises(FormatError, match=r"the probe rejected all 1 media files \(first: x.mp4\)"):
        pack_media(tmp_path / "broken", tmp_path / "out", on_error="skip", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["broken", "empty"]


def test_media_without_probe_and_bad_captions(tmp_path):
    src = tmp_path / "media"
    make_media_folder(str(src))
    ds = open_dataset(pack_media(src, tmp_path / "out", probe=False, progress=False))
    assert ds.meta(0).keys() == {"file", "bytes"} and ds.manifest.extra["probe"] is False
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"file": "a.png"}])
    with pytest.raises(FormatError, match="bad.jsonl"):
        pack_media(src, tmp_path / "o2", captions=bad, progress=False)


def test_cli_dispatch(tmp_path, capsys):
    path = write_jsonl(str(tmp_path / "in.jsonl"), _rows(30))
    assert foresight_main(["pack", "jsonl", path, str(tmp_path / "a"), "--column", "input_ids",
                           "--shard-bytes", "1K", "--align", "512", "--no-progress"]) == 0
    assert "packed 30 samples" in capsys.readouterr().out
    ds = open_dataset(tmp_path / "a")
    assert ds.align == 512 and len(ds.shard_paths) > 1
    # An existing output is an error unless --overwrite.
    assert foresight_main(["pack", "jsonl", path, str(tmp_path / "a"), "--no-progress"]) == 1
    assert "exists" in capsys.readouterr().err
    assert foresight_main(["pack", "jsonl", path, str(tmp_path / "a"), "--no-progress", "--overwrite"]) == 0


def test_cli_subprocess_media(tmp_path):
    src = tmp_path / "media"
    make_media_folder(str(src))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "foresight", "pack", "media", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "packed 5 samples" in proc.stdout
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["align"] == 4096


def test_no_exported_function_shadows_a_module():
    # `import foresight.format.pack_media` used to give the function that foresight.format re-exported under the
    # module's name: every submodule must stay reachable as a module, every packer as a function.
    import importlib
    import pkgutil
    import types

    import foresight.format as fmt

    for pkg_name in ("foresight.format", "foresight.format.packers"):
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.iter_modules(pkg.__path__):
            full = f"{pkg.__name__}.{info.name}"
            module = importlib.import_module(full)
            assert getattr(pkg, info.name) is module, f"{full} is shadowed by {getattr(pkg, info.name)!r}"
    for name in ("pack_jsonl", "pack_media", "pack_megatron", "pack_parquet", "pack_records"):
        assert isinstance(getattr(fmt, name), types.FunctionType), name
    assert isinstance(importlib.import_module("foresight.format.packers.media").media_files, types.FunctionType)
