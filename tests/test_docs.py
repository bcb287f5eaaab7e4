"""docs/config.md and docs/formats.md stay honest.

config.md: every ``FORESIGHT_*`` environment variable the code reads, every keyword argument of the public
constructors and functions users configure (in that object's section), every flag of ``foresight pack``,
``foresight plan`` and ``foresight node serve``, and every bench preset is documented.

formats.md: a real dataset, media index, plan, checkpoint, DCP checkpoint and replica unit are written here; every
JSON key, map column and file name they contain must be named in the page's prose or tables (not only in a pasted
example), and the checksum, digest and layout recipes the page gives are recomputed from the files with plain
``hashlib``/``xxhash``/``pyarrow``/``struct``, the way another implementation would, and must match what foresight
wrote.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import pickle
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from bench_presets import load_run_all

ROOT = Path(__file__).resolve().parents[1]
CONFIG = (ROOT / "docs" / "config.md").read_text()
FORMATS = (ROOT / "docs" / "formats.md").read_text()

_ENV_RE = re.compile(r"(?<![A-Za-z0-9])_?FORESIGHT_[A-Z0-9_]*[A-Z0-9]")
_SOURCE_SUFFIXES = {".py", ".pyx", ".pxd", ".sh", ".c", ".h", ".cc", ".cpp", ".toml", ".cfg"}


def _prose(text: str) -> str:
    """The page without its fenced code blocks: what is documented, not merely pasted."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _code_words(text: str) -> set[str]:
    """Identifiers and literals inside inline code spans (`shards[].bin_xxh3` gives shards, bin_xxh3)."""
    words: set[str] = set()
    for span in re.findall(r"`([^`]+)`", text):  # a span may wrap onto the next line
        words.add(span.strip())
        words.update(re.findall(r"[A-Za-z_.][A-Za-z0-9_.\-]*", span))
        words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return words


def _sections(text: str) -> dict[str, str]:
    """Heading -> its text (up to the next heading of any level)."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return {parts[i].lstrip("#").strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


CONFIG_SECTIONS = _sections(CONFIG)


def _section(title: str) -> str:
    hits = [body for heading, body in CONFIG_SECTIONS.items() if title in heading]
    assert hits, f"docs/config.md has no section whose heading contains {title!r}"
    return "\n".join(hits)


# ---- config.md ---------------------------------------------------------------------------------------------------
def _env_vars() -> set[str]:
    found: set[str] = set()
    roots = [ROOT / "python", ROOT / "bench", ROOT / "scripts", ROOT / "csrc", ROOT / "engine", ROOT / "setup.py"]
    for base in roots:
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix in _SOURCE_SUFFIXES:
                found.update(_ENV_RE.findall(path.read_text(errors="replace")))
    return found


def test_every_environment_variable_is_documented():
    names = _env_vars()
    assert "FORESIGHT_IO_BACKEND" in names  # the scan itself works
    documented = _code_words(_section("Environment variables"))
    assert sorted(names - documented) == [], "document these in docs/config.md, Environment variables"


def _obj(path: str):
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# (object, section of config.md that documents its arguments)
DOCUMENTED_SIGNATURES = [
    ("foresight.loader:Loader", "Loader"),
    ("foresight.loader.torch_dataset:ForesightIterableDataset", "ForesightIterableDataset"),
    ("foresight.io:IOEngine", "IOEngine"),
    ("foresight.io:Arena", "IOEngine, Arena"),
    ("foresight.io:open_file", "IOEngine, Arena, open_file"),
    ("foresight.format:DatasetWriter", "DatasetWriter"),
    ("foresight.format:pack_jsonl", "Packers"),
    ("foresight.format:pack_parquet", "Packers"),
    ("foresight.format:pack_media", "Packers"),
    ("foresight.format:pack_webdataset", "Packers"),
    ("foresight.format:pack_megatron", "Packers"),
    ("foresight.bucket.opener:open_dataset", "Opening"),
    ("foresight.format:MegatronDataset", "Opening"),
    ("foresight.bucket:open_bucket_dataset", "Buckets"),
    ("foresight.bucket.prefetch:PlanPrefetcher", "Buckets"),
    ("foresight.bucket:RetryPolicy", "Buckets"),
    ("foresight.bucket.objects:BucketPrefix", "Buckets"),
    ("foresight.plan:build_plan", "build_plan"),
    ("foresight.plan:load_plan", "build_plan"),
    ("foresight.plan.files:save_plan", "build_plan"),
    ("foresight.plan.locations:open_plan_datasets", "build_plan"),
    ("foresight.checkpoint:Checkpointer", "Checkpointer"),
    ("foresight.checkpoint.checkpointer:save", "Checkpointer"),
    ("foresight.checkpoint.loading:load", "Checkpointer"),
    ("foresight.checkpoint.export:export_safetensors", "Checkpointer"),
    ("foresight.checkpoint:ForesightStorageWriter", "ForesightStorageWriter"),
    ("foresight.checkpoint:ForesightStorageReader", "ForesightStorageWriter"),
    ("foresight.replication.policy:ReplicatingStorageWriter", "ForesightStorageWriter"),
    ("foresight.replication.policy:Replication", "Replication"),
    ("foresight.replication.hint_client:ReplicaReader", "Replication"),
    ("foresight.media:DecodePool", "DecodePool"),
    ("foresight.loader:MediaDecodeStage", "DecodePool"),
    ("foresight.media:TransformSpec", "TransformSpec"),
    ("foresight.media.sampling:FrameSampling", "TransformSpec"),
    ("foresight.media.sampling:AudioSampling", "TransformSpec"),
    ("foresight.node.client:NodeSource", "NodeSource"),
    ("foresight.node.server:NodeServer", "foresight node serve"),
]
_OPTIONAL_SIGNATURES = {"foresight.format.packers.text:pack_records": "Packers"}


def _parameters(obj) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) and "__init__" in vars(obj) else obj
    params = inspect.signature(target).parameters.values()
    # **options are not names a user types; private (_x) ones are for tests
    return [p.name for p in params if p.name != "self" and not p.name.startswith("_")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("path, section", DOCUMENTED_SIGNATURES + list(_OPTIONAL_SIGNATURES.items()),
                         ids=lambda v: v.rpartition(":")[2] if ":" in v else v)
def test_every_keyword_argument_is_documented(path, section):
    try:
        obj = _obj(path)
    except (ImportError, AttributeError):
        if path in _OPTIONAL_SIGNATURES:
            pytest.skip(f"{path} is not in this checkout")
        raise
    documented = _code_words(_section(section))
    missing = [name for name in _parameters(obj) if name not in documented]
    assert missing == [], f"document {missing} of {path} in docs/config.md, section {section!r}"


def _cli_parser(module: str, sub: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    if sub is None:
        return parser
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[sub]


@pytest.mark.parametrize("module, sub", [("foresight.format.cli", None), ("foresight.plan.cli", None),
                                         ("foresight.node.cli", "serve")])
def test_every_cli_flag_is_documented(module, sub):
    parser = _cli_parser(module, sub)
    flags = {opt for a in parser._actions if a.help != argparse.SUPPRESS
             for opt in a.option_strings if opt.startswith("--") and opt != "--help"}
    assert flags
    documented = _code_words(CONFIG)
    assert sorted(flags - documented) == [], f"document these flags of {module} {sub or ''} in docs/config.md"


def test_every_bench_preset_is_documented():
    run_all = load_run_all()
    section = _section("Bench presets")
    documented = _code_words(section)
    names = set(run_all.PRESETS) | {p for presets in run_all.PRESETS.values() for p in presets}
    assert sorted(names - documented - set(section.split())) == []
    # the table's quick column is the preset's arguments, exactly (a stale row misleads whoever re-runs it)
    for bench, presets in run_all.PRESETS.items():
        row = next((ln for ln in section.splitlines() if ln.startswith(f"| `{bench}` |")), None)
        assert row is not None, f"no table row for {bench}"
        quick = " ".join(a if a else "''" for a in presets["quick"]) or "bench defaults"
        assert row.split(" | ")[1].startswith(f"`{quick}`" if presets["quick"] else "bench defaults"), (bench, row)


# ---- formats.md: artefacts written by the code -------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A token dataset, a media dataset, a plan, a checkpoint, a DCP checkpoint and replica units, really written."""
    import torch

    from foresight.checkpoint import Checkpointer, ForesightStorageWriter
    from foresight.replication.units import data_files, plan_units
    from foresight.format import DatasetWriter, pack_media, write_megatron_dataset
    from foresight.media.probe import probe_media
    from foresight.testing.media_synth import make_audio, make_image, make_video
    from foresight.plan import build_plan

    tmp = tmp_path_factory.mktemp("docs")
    out = {"root": tmp}
    with DatasetWriter(tmp / "data", align=4096, token_dtype="uint16", extra={"source": "docs"}) as w:
        w.add_many(np.arange(1, 11, dtype=np.uint16), np.array([3, 7]), modality="tokens")
        w.add(np.array([5, 6, 7, 8], np.uint16), modality="tokens", meta={"doc": "c"})
    clips = tmp / "clips"
    clips.mkdir()
    make_video(str(clips / "a.mp4"), seconds=1, width=64, height=48, gop=6)
    (clips / "b.jpg").write_bytes(make_image(width=32, height=24))
    (tmp / "caps.jsonl").write_text(json.dumps({"file": "a.mp4", "caption": "a clip"}) + "\n")
    pack_media(clips, tmp / "media", captions=tmp / "caps.jsonl", progress=False)
    out["audio_meta"] = probe_media(make_audio(seconds=0.25), "audio")

    from foresight.format import open_dataset

    ds = open_dataset(tmp / "data")
    plan = build_plan([(ds, 1.0)], seed=1, global_batch_size=2, seq_len=4, num_steps=2)
    plan.save(str(tmp / "plan"))
    out["fingerprint"] = ds.fingerprint
    ds.close()

    state = {"w": torch.arange(4, dtype=torch.float32), "opt": {"step": 3, "m": torch.zeros(70000)}}
    with Checkpointer(str(tmp / "ckpt"), keep=2) as c:
        c.save(state, 100, extra_state={"next_step": 101, 3: (1, 2)}).wait()

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2, 3), "step": 7}, storage_writer=ForesightStorageWriter(str(tmp / "dcp")),
                 no_dist=True)
    step_dir = tmp / "ckpt" / "step-00000100"
    out["units"] = [u.header(0) for u in plan_units(data_files(str(step_dir)), 4096)]
    out["megatron"] = write_megatron_dataset(str(tmp / "mega"), [np.arange(5), [np.arange(3), np.arange(2)]],
                                             np.uint16)
    return out


def _keys(obj, skip: frozenset = frozenset()) -> set[str]:
    """Every key of every object in a JSON tree, not descending into the keys in ``skip``."""
    found: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            found.add(str(k))
            if k not in skip:
                found |= _keys(v, skip)
    elif isinstance(obj, list):
        for v in obj:
            found |= _keys(v, skip)
    return found


FORMAT_WORDS = _code_words(_prose(FORMATS))


def _undocumented(keys: set[str]) -> list[str]:
    return sorted(k for k in keys if k not in FORMAT_WORDS)


def test_dataset_keys_and_columns_are_documented(written):
    manifest = json.loads((written["root"] / "data" / "manifest.json").read_text())
    media_manifest = json.loads((written["root"] / "media" / "manifest.json").read_text())
    keys = _keys(manifest) | _keys(media_manifest)
    table = pa.ipc.open_file(pa.memory_map(str(written["root"] / "data" / "shard-00000.map"))).read_all()
    keys |= set(table.schema.names) | {k.decode() for k in table.schema.metadata}
    assert _undocumented(keys) == []


def test_media_meta_keys_are_documented(written):
    from foresight.format import open_dataset

    ds = open_dataset(written["root"] / "media")
    try:
        metas = [ds.meta(i) for i in range(ds.num_samples)]
    finally:
        ds.close()
    assert {m["modality"] for m in metas} == {"video", "image"} and any("caption" in m for m in metas)
    keys = set().union(*(m.keys() for m in metas)) | set(written["audio_meta"])
    assert _undocumented(keys) == []


def test_plan_keys_and_files_are_documented(written):
    plan_dir = written["root"] / "plan"
    keys = _keys(json.loads((plan_dir / "plan.json").read_text()))
    keys |= _keys(json.loads((plan_dir / "sources.json").read_text()))
    assert _undocumented(keys) == []
    assert _undocumented({p.name for p in plan_dir.iterdir()}) == []


def test_checkpoint_keys_and_files_are_documented(written):
    root = written["root"] / "ckpt"
    step = root / "step-00000100"
    index = json.loads((step / "index.json").read_text())
    keys = _keys(index, skip=frozenset({"skeleton", "extra_state", "extra_state_exact"}))
    keys |= _keys(json.loads((step / "COMMIT").read_text()))
    keys |= _keys(json.loads((root / ".foresight.lock").read_text()))
    keys |= {k for unit in written["units"] for k in unit}
    assert _undocumented(keys) == []
    assert _undocumented({p.name for p in step.iterdir()} | {p.name for p in root.iterdir()}) == []
    for tag in ("t", "d", "l", "u", "v", "f"):  # skeleton node kinds
        assert f'{{"{tag}":' in FORMATS, f"skeleton tag {tag!r} undocumented"


def test_loader_state_keys_are_documented(written):
    from foresight.format import open_dataset
    from foresight.loader import Loader
    from foresight.loader.torch_dataset import ForesightIterableDataset
    from foresight.plan import load_plan

    ds = open_dataset(written["root"] / "data")
    plan = load_plan(str(written["root"] / "plan"))
    with Loader(ds, plan, prefetch=1) as loader:
        next(iter(loader))
        keys = set(loader.state_dict())
    ds.close()
    adapter = ForesightIterableDataset([], plan)
    if hasattr(adapter, "state_dict"):
        keys |= set(adapter.state_dict())
    assert _undocumented(keys) == []


def test_dcp_fields_and_files_are_documented(written):
    from foresight.checkpoint.dcp import ForesightStorageInfo

    fields = {f.name for f in ForesightStorageInfo.__dataclass_fields__.values()}
    names = {p.name for p in (written["root"] / "dcp").iterdir()}
    assert names == {".metadata", "__0_data.bin"}
    assert _undocumented(fields | names) == []


# ---- formats.md: the recipes, recomputed as another implementation would -----------------------------------------
def test_dataset_checksums_layout_and_fingerprint_follow_the_spec(written):
    from foresight.format import open_dataset

    data = written["root"] / "data"
    raw = (data / "manifest.json").read_bytes()
    assert xxhash.xxh3_128_hexdigest(raw) == written["fingerprint"]  # fingerprint = xxh3-128 of manifest.json
    manifest = json.loads(raw)
    assert raw == (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    for shard in manifest["shards"]:
        bin_bytes = (data / shard["bin"]).read_bytes()
        map_bytes = (data / shard["map"]).read_bytes()
        assert (len(bin_bytes), len(map_bytes)) == (shard["bin_bytes"], shard["map_bytes"])
        assert xxhash.xxh3_64(bin_bytes).hexdigest() == shard["bin_xxh3"]
        assert f"{xxhash.xxh3_64_intdigest(map_bytes):016x}" == shard["map_xxh3"]
        assert len(bin_bytes) % manifest["align"] == 0
        cols = pa.ipc.open_file(pa.py_buffer(map_bytes)).read_all().to_pydict()
        covered = np.zeros(len(bin_bytes), bool)
        for off, n, mod, checksum, meta in zip(cols["offset"], cols["length"], cols["modality"], cols["checksum"],
                                               cols["meta"]):
            assert off % manifest["align"] == 0 and mod == 0  # tokens
            assert xxhash.xxh3_64_intdigest(bin_bytes[off:off + n]) == checksum
            assert meta == "" or meta == json.dumps(json.loads(meta), sort_keys=True, separators=(",", ":"))
            covered[off:off + n] = True
        assert not np.frombuffer(bin_bytes, np.uint8)[~covered].any()  # padding is zero bytes
    ds = open_dataset(data)
    try:
        assert ds.fingerprint == written["fingerprint"]
    finally:
        ds.close()


def test_plan_digest_and_arrays_follow_the_spec(written):
    plan_dir = written["root"] / "plan"
    doc = json.loads((plan_dir / "plan.json").read_text())
    header = {k: v for k, v in doc.items() if k != "digest"}
    h = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())
    arrays = {}
    for name in ("item_ptr", "piece_dataset", "piece_sample", "piece_offset", "piece_length"):  # the documented order
        arr = np.load(plan_dir / f"{name}.npy", allow_pickle=False)
        assert arr.dtype.str == doc["arrays"][name]["dtype"] and list(arr.shape) == doc["arrays"][name]["shape"]
        h.update(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
        arrays[name] = arr
    assert "sha256:" + h.hexdigest() == doc["digest"]
    ptr, seq_len = arrays["item_ptr"], doc["inputs"]["seq_len"]
    assert ptr[0] == 0 and ptr[-1] == doc["summary"]["num_pieces"]
    assert (np.add.reduceat(arrays["piece_length"], ptr[:-1]) == seq_len + 1).all()  # token items: seq_len + 1
    sources = json.loads((plan_dir / "sources.json").read_text())["sources"]
    assert os.path.normpath(plan_dir / sources[0]["relative"]) == sources[0]["path"]


def test_checkpoint_commit_index_and_layout_follow_the_spec(written):
    step = written["root"] / "ckpt" / "step-00000100"
    body = (step / "index.json").read_bytes()
    marker = json.loads((step / "COMMIT").read_text())
    assert marker["index_bytes"] == len(body)
    assert marker["index_xxh3"] == f"{xxhash.xxh3_64_intdigest(body):016x}"
    fields = {k: v for k, v in marker.items() if k != "marker_xxh3"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert marker["marker_xxh3"] == f"{xxhash.xxh3_64_intdigest(canonical):016x}"
    index = json.loads(body)
    assert (index["format"], index["version"], marker["format"], marker["version"]) == \
        ("foresight-checkpoint", 1, "foresight-checkpoint", 1)
    data = (step / index["files"][0]["name"]).read_bytes()
    assert len(data) == index["files"][0]["bytes"] and len(data) % 4096 == 0
    t = index["tensors"]
    for off, n, digest in zip(t["offset"], t["nbytes"], t["xxh3"]):
        assert f"{xxhash.xxh3_64_intdigest(data[off:off + n]):016x}" == digest
        if n >= 256 * 1024:
            assert off % 4096 == 0  # big tensors at 4096-byte boundaries
    big = [o for o, n in zip(t["offset"], t["nbytes"]) if n >= 256 * 1024]
    small_end = max((o + n for o, n in zip(t["offset"], t["nbytes"]) if n < 256 * 1024), default=0)
    assert big and min(big) == -(-small_end // 4096) * 4096
    assert {"d"} == set(index["skeleton"]) and index["extra_state_exact"]  # int key and tuple: exact copy kept


def test_dcp_items_follow_the_spec(written):
    root = written["root"] / "dcp"
    with open(root / ".metadata", "rb") as f:
        md = pickle.load(f)
    data = (root / "__0_data.bin").read_bytes()
    assert len(data) % 4096 == 0
    kinds = set()
    for info in md.storage_data.values():
        assert info.relative_path == "__0_data.bin"
        assert xxhash.xxh3_64_intdigest(data[info.offset:info.offset + info.length]) == info.xxh3
        kinds.add("bytes" if info.dtype == "bytes" else info.dtype.split(".")[0])
    assert kinds == {"bytes", "torch"}


def test_replica_units_follow_the_spec(written):
    units = written["units"]
    assert [u["id"] for u in units] == list(range(len(units)))
    assert all(u["length"] <= 4096 and u["offset"] % 4096 == 0 for u in units)
    assert sum(u["length"] for u in units) == units[0]["file_size"]


def test_megatron_index_follows_the_spec(written):
    from foresight.format import MegatronDataset

    idx_path, bin_path = written["megatron"]
    idx = Path(idx_path).read_bytes()
    magic, version, code, n, d = struct.unpack_from("<9sQBQQ", idx)
    assert (magic, version, code, n, d) == (b"MMIDIDX\x00\x00", 1, 8, 3, 3)
    assert len(idx) == 34 + 12 * n + 8 * d
    lengths = np.frombuffer(idx, "<i4", n, 34)
    pointers = np.frombuffer(idx, "<i8", n, 34 + 4 * n)
    docs = np.frombuffer(idx, "<i8", d, 34 + 12 * n)
    assert lengths.tolist() == [5, 3, 2] and pointers.tolist() == [0, 10, 16] and docs.tolist() == [0, 1, 3]
    bin_size = os.path.getsize(bin_path)
    expected = xxhash.xxh3_128_hexdigest(idx + struct.pack("<Q", bin_size))
    ds = MegatronDataset(idx_path[:-4])
    try:
        assert ds.fingerprint == expected
    finally:
        ds.close()
