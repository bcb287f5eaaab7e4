"""``foresight pack`` over the inputs users have: Hugging Face Parquet shard folders, ``.jsonl.gz`` parts, globs,
mixed files, tokenization from the CLI (a real tokenizer.json built here, or module:function), one progress bar."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from foresight.cli import main as foresight_main
from foresight.errors import FormatError, PlanError
from foresight.format import open_dataset, pack_jsonl, pack_parquet, pack_records
from foresight.format.packers.inputs import resolve_inputs
from foresight.plan.builder import build_plan
from format_helpers import write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the quick brown fox jumps over a lazy dog while seven small cats watch".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(n)]


def _hf_folder(root, splits=(("train", 3, 40), ("test", 1, 15))) -> dict[str, list[str]]:
    """A Hugging Face dataset folder: data/{split}-0000i-of-0000n.parquet, a README and a dataset_info.json."""
    os.makedirs(root / "data")
    (root / "README.md").write_text("---\nconfigs: [default]\n---\n")
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": "string"}}))
    texts = {}
    for s, (split, shards, rows) in enumerate(splits):
        texts[split] = []
        for i in range(shards):
            part = _texts(rows + i, seed=100 * s + i)
            pq.write_table(pa.table({"text": part, "id": list(range(len(part)))}),
                           root / "data" / f"{split}-{i:05d}-of-{shards:05d}.parquet", row_group_size=7)
            texts[split] += part
    return texts


def _read_texts(ds) -> list[str]:
    return [ds.read(i).decode() for i in range(ds.num_samples)]


def _tokenizer_json(path, vocab_words: int | None = None) -> str:
    """A real tokenizers WordLevel tokenizer: trained on a few lines, or given ``vocab_words`` entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_words is None:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(_texts(50, seed=9), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    else:  # a vocabulary past 65536 ids: our words at the top, so their ids need uint32
        vocab = {f"w{i}": i for i in range(vocab_words - len(WORDS) - 1)}
        vocab["[UNK]"] = len(vocab)
        vocab.update({w: len(vocab) + k for k, w in enumerate(WORDS)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def test_hf_parquet_folder_needs_a_split_and_packs_its_shards_in_order(tmp_path):
    texts = _hf_folder(tmp_path / "hf")
    with pytest.raises(FormatError, match=r"several splits \(test, train\); pack one with --split train") as err:
        pack_parquet(tmp_path / "hf", tmp_path / "out", progress=False)
    assert str(tmp_path / "hf") in str(err.value) and not (tmp_path / "out").exists()
    ds = open_dataset(pack_parquet(tmp_path / "hf", tmp_path / "out", split="train", progress=False, batch_rows=8))
    assert _read_texts(ds) == texts["train"] and ds.modalities == ["text"]
    extra = ds.manifest.extra
    assert [os.path.basename(p) for p in extra["sources"]] == [f"train-0000{i}-of-00003.parquet" for i in range(3)]
    assert extra["source"] == str(tmp_path / "hf" / "data") and extra["source_format"] == "parquet"
    with pytest.raises(FormatError, match="no files of split 'dev' here"):
        pack_parquet(tmp_path / "hf", tmp_path / "o2", split="dev", progress=False)


def test_glob_of_one_split_and_split_folders(tmp_path):
    texts = _hf_folder(tmp_path / "hf")
    pattern = str(tmp_path / "hf" / "**" / "test-*")
    ds = open_dataset(pack_records(pattern, tmp_path / "out", progress=False))
    assert _read_texts(ds) == texts["test"]
    # The parquet-converter layout: split folders.
    for split in ("train", "validation"):
        os.makedirs(tmp_path / "conv" / "default" / split)
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "conv" / "default" / "train" / "0000.parquet")
    pq.write_table(pa.table({"text": ["c"]}), tmp_path / "conv" / "default" / "validation" / "0000.parquet")
    with pytest.raises(FormatError, match=r"several splits \(train, validation\)"):
        resolve_inputs(tmp_path / "conv")
    ds = open_dataset(pack_records(tmp_path / "conv", tmp_path / "o2", split="validation", progress=False))
    assert _read_texts(ds) == ["c"]
    with pytest.raises(FormatError, match="matches no data files") as err:
        pack_records(str(tmp_path / "nothing-*.parquet"), tmp_path / "o3", progress=False)
    assert "nothing-*.parquet" in str(err.value)


def test_mixed_jsonl_gz_and_parquet_in_sorted_order(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    expected = []
    # Written out of order: the folder is read sorted (part-00 .. part-02), whatever the directory order.
    for i in (2, 0, 1):
        rows = [{"text": t, "n": i} for t in _texts(30 + i, seed=i)]
        if i == 1:
            pq.write_table(pa.Table.from_pylist(rows), parts / f"part-{i:02d}.parquet")
        else:
            with gzip.open(parts / f"part-{i:02d}.jsonl.gz", "wt", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    for i in range(3):
        expected += _texts(30 + i, seed=i)
    extra = write_jsonl(str(tmp_path / "extra.jsonl"), [{"text": "last one"}])
    ds = open_dataset(pack_records([parts, extra], tmp_path / "out", progress=False, batch_rows=16))
    assert _read_texts(ds) == expected + ["last one"]
    assert ds.manifest.extra["source_format"] == "jsonl+parquet" and len(ds.manifest.extra["sources"]) == 4
    # kind="jsonl" takes only the JSONL parts of the folder.
    ds = open_dataset(pack_jsonl(parts, tmp_path / "j", progress=False))
    assert _read_texts(ds) == _texts(30, seed=0) + _texts(32, seed=2)
    # The same file twice would duplicate its samples: refused, naming it.
    with pytest.raises(FormatError, match="given twice") as err:
        pack_records([parts, parts / "part-01.parquet"], tmp_path / "o2", progress=False)
    assert "part-01.parquet" in str(err.value) and not (tmp_path / "o2").exists()


def test_inputs_must_agree_on_the_column(tmp_path):
    a = write_jsonl(str(tmp_path / "a.jsonl"), [{"text": "x"}])
    b = write_jsonl(str(tmp_path / "b.jsonl"), [{"input_ids": [1, 2]}])
    with pytest.raises(FormatError, match=r"column is 'input_ids' \(tokens\) but .*a.jsonl has 'text'") as err:
        pack_records([a, b], tmp_path / "o", progress=False)
    assert "b.jsonl" in str(err.value) and not (tmp_path / "o").exists()
    (tmp_path / "notes.txt").write_text("{}")
    with pytest.raises(FormatError, match="unknown input type"):
        pack_records(tmp_path / "notes.txt", tmp_path / "o", progress=False)


def test_token_ids_over_several_parquet_files_pick_the_dtype_from_statistics(tmp_path):
    rng = np.random.default_rng(1)
    rows = [{"input_ids": rng.integers(0, 60000, size=int(rng.integers(0, 20))).tolist()} for _ in range(90)]
    rows[77]["input_ids"] = [70000]  # in the last file only: every file's maximum counts
    for i in range(3):
        pq.write_table(pa.Table.from_pylist(rows[30 * i : 30 * i + 30]), tmp_path / f"t-{i}.parquet",
                       row_group_size=8, write_statistics=i != 1)  # file 1 has no statistics: it is scanned
    ds = open_dataset(pack_records(str(tmp_path / "t-*.parquet"), tmp_path / "out", progress=False))
    assert ds.token_dtype == np.uint32 and ds.token_counts().tolist() == [len(r["input_ids"]) for r in rows]
    for i in (0, 77, 89):
        assert np.frombuffer(ds.read(i), np.uint32).tolist() == rows[i]["input_ids"]
    del rows[77]
    for i in range(3):
        pq.write_table(pa.Table.from_pylist(rows[30 * i : 30 * i + 30]), tmp_path / f"t-{i}.parquet")
    ds = open_dataset(pack_records(str(tmp_path / "t-*.parquet"), tmp_path / "o16", progress=False))
    assert ds.token_dtype == np.uint16


def test_cli_tokenizer_json_chooses_uint16_or_uint32(tmp_path, capsys):
    texts = _texts(40, seed=3)
    src = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": t} for t in texts])
    from tokenizers import Tokenizer

    for name, vocab_words, dtype in (("small", None, np.uint16), ("big", 70000, np.uint32)):
        path = _tokenizer_json(tmp_path / f"{name}.json", vocab_words)
        out = str(tmp_path / name)
        assert foresight_main(["pack", "jsonl", src, out, "--tokenizer", path, "--no-progress",
                               "--batch-rows", "16"]) == 0
        assert "packed 40 samples" in capsys.readouterr().out
        ds = open_dataset(out)
        assert ds.token_dtype == dtype and ds.modalities == ["tokens"]
        tok = Tokenizer.from_file(path)
        want = [e.ids for e in tok.encode_batch(texts)]
        assert [np.frombuffer(ds.read(i), dtype).tolist() for i in range(ds.num_samples)] == want
        assert ds.manifest.extra["tokenizer"] == path and ds.manifest.extra["content"] == "tokenized text"
        if vocab_words:
            assert max(max(w) for w in want) >= 1 << 16
    # A folder holding tokenizer.json works too; a missing tokenizer is one line naming it.
    os.makedirs(tmp_path / "model")
    _tokenizer_json(tmp_path / "model" / "tokenizer.json")
    assert foresight_main(["pack", "jsonl", src, str(tmp_path / "m"), "--tokenizer", str(tmp_path / "model"),
                           "--no-progress"]) == 0
    capsys.readouterr()
    assert foresight_main(["pack", "jsonl", src, str(tmp_path / "x"), "--tokenizer", "missing.json",
                           "--no-progress"]) == 1
    assert "missing.json" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_cli_tokenizer_module_function(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_tok.py").write_text(
        "def encode(texts):\n    return [[len(w) for w in t.split()] for t in texts]\nencode.vocab_size = 100\n")
    texts = _texts(25, seed=4)
    pq.write_table(pa.table({"content": texts}), tmp_path / "in.parquet")
    monkeypatch.chdir(tmp_path)
    # The user's module sits in the working directory, which a console script does not put on sys.path.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_tok", raising=False)
    assert foresight_main(["pack", "parquet", "in.parquet", "out", "--tokenizer", "my_tok:encode",
                           "--no-progress"]) == 0
    ds = open_dataset(tmp_path / "out")
    assert ds.token_dtype == np.uint16 and ds.manifest.extra["column"] == "content"
    assert [np.frombuffer(ds.read(i), np.uint16).tolist() for i in range(25)] == \
        [[len(w) for w in t.split()] for t in texts]
    capsys.readouterr()
    assert foresight_main(["pack", "parquet", "in.parquet", "o2", "--tokenizer", "my_tok:nope", "--no-progress"]) == 1
    assert "cannot load tokenizer 'my_tok:nope'" in capsys.readouterr().err


def _bar_lines(stderr: str) -> list[str]:
    return [s.strip() for s in stderr.replace("\r", "\n").split("\n") if s.strip()]


def test_cli_one_progress_bar_with_a_total_and_an_eta(tmp_path):
    texts = _hf_folder(tmp_path / "hf", splits=(("train", 3, 400),))
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in _texts(300, seed=7))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TQDM_MININTERVAL="0")  # draw on every update: what a slow pack shows over time
    proc = subprocess.run([sys.executable, "-m", "foresight", "pack", "auto", str(tmp_path / "hf"),
                           str(tmp_path / "more.jsonl.gz"), str(tmp_path / "out"), "--batch-rows", "50"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "packed 1503 samples from 4 files" in proc.stdout
    lines = _bar_lines(proc.stderr)
    assert lines[-1].startswith("foresight warning: column 'text' is stored as raw text"), lines[-1]
    lines = lines[:-1]  # the one line after the bar: the text was not tokenized
    total = sum(os.path.getsize(p) for p in open_dataset(tmp_path / "out").manifest.extra["sources"])
    assert len(lines) > 4 and all(s.startswith("pack 4 files:") for s in lines)  # one bar, redrawn
    from tqdm import tqdm

    assert all(f"/{tqdm.format_sizeof(total, divisor=1024)} [" in s for s in lines)  # its total: the input bytes
    # every redraw after the first has tqdm's "[elapsed<remaining" field: an ETA is shown (a format check; the
    # remaining time may be "?" and its value is never compared)
    assert all(re.search(r"\[\d+:\d{2}<(\d+:\d{2}|\?)", s) for s in lines[1:]), lines
    assert sum("100%" in s for s in lines) == 1  # the finished bar is written once
    assert _read_texts(open_dataset(tmp_path / "out"))[: len(texts["train"])] == texts["train"]


def test_parquet_progress_bar_finishes_once(tmp_path):
    pq.write_table(pa.table({"input_ids": [[i] * (i % 5) for i in range(2000)]}), tmp_path / "t.parquet",
                   row_group_size=100)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TQDM_MININTERVAL="0")
    proc = subprocess.run([sys.executable, "-m", "foresight", "pack", "parquet", str(tmp_path / "t.parquet"),
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = _bar_lines(proc.stderr)
    assert lines and all(s.startswith("pack t.parquet:") for s in lines)
    assert sum("100%" in s for s in lines) == 1, proc.stderr


def test_mixing_token_and_text_datasets_says_how_to_fix_it(tmp_path):
    src = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": t} for t in _texts(10, seed=5)])
    text = open_dataset(pack_jsonl(src, tmp_path / "text", progress=False))
    tokens = open_dataset(pack_jsonl(src, tmp_path / "tok", tokenizer=_tokenizer_json(tmp_path / "t.json"),
                                     progress=False))
    with pytest.raises(PlanError, match="cannot mix token datasets with sample datasets") as err:
        build_plan([(tokens, 1.0), (text, 1.0)], seed=0, global_batch_size=2, seq_len=8, num_steps=2)
    assert "--tokenizer" in str(err.value) and "one plan per kind" in str(err.value)


def test_many_shards_do_not_hold_a_file_descriptor_each(tmp_path):
    # A dataset of thousands of shards must not need thousands of open files: each is opened while it is read.
    import resource

    for i in range(120):
        pq.write_table(pa.table({"text": [f"row {i}"]}), tmp_path / f"s-{i:04d}.parquet")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.run([sys.executable, "-m", "foresight", "pack", "parquet", str(tmp_path), str(tmp_path / "out"),
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)))
    assert proc.returncode == 0, proc.stderr
    assert _read_texts(open_dataset(tmp_path / "out")) == [f"row {i}" for i in range(120)]
