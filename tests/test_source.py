"""The read path is one piece (foresight.source): the loader, the node's job and the node client's local fallback
call the same functions, so "the same tensors on host and node" holds by construction, and a real node process,
the host's loader and the client's fallback give the same tensors for every step."""
from __future__ import annotations

import ast
import os

import numpy as np
import pytest

import foresight.loader.pipeline as pipeline_mod
import foresight.loader.slots as slots_mod
import foresight.node.client as client_mod
import foresight.node.jobs as jobs_mod
import foresight.source as source
import foresight.source.media_stage as stage_mod
from foresight.io import IOEngine
from foresight.loader import Loader, MediaDecodeStage
from foresight.node.client import NodeSource
from foresight.errors import PlanError
from foresight.plan import build_plan
from foresight.source import (FileTable, LocalPartReader, coalesce_extents, decode_part, lookup_samples,
                              modality_codes, read_extents, sample_epochs, sample_extents, spec_codes, stack_samples,
                              step_extents)
from node_helpers import SPECS, TOKEN, NodeProc, host_reference, make_root, summary

PKG = os.path.dirname(source.__file__).rsplit(os.sep, 1)[0]  # python/foresight
CONSUMERS = {  # module -> what it must take from foresight.source (the one implementation of each step)
    pipeline_mod: {"Reads", "coalesce_extents", "anonymous_region", "step_extents"},  # the loader's thread
    slots_mod: {"ALIGN", "FileTable", "round_up"},  # the loader's slots and files
    jobs_mod: {"FileTable", "MediaDecodeStage", "decode_part", "modality_codes", "read_extents", "spec_codes",
               "step_extents"},
    client_mod: {"LocalPartReader", "PartBytes", "decode_part", "lookup_samples", "modality_codes", "spec_codes",
                 "stack_samples"},
    stage_mod: {"modality_codes", "sample_epochs", "spec_codes", "stack_samples"},
}
# Calls that only the read path's own modules make: the coalesce -> region -> engine sequence, the per-dataset
# modality/extent lookups, the mapping of regions and the stacking of decoded samples.
OWNED_CALLS = {"coalesce": "reads", "read_batch": "reads", "submit_reads": "reads", "mmap": "reads",
               "modality_codes": "modality", "lookup": "extents", "torch.stack": "decode"}


# Own modules that import an optional extra at their top: a loader without that extra must not import them at its
# top (they are imported where used, marked "# lazy:").
OPTIONAL_EXTRAS = {"foresight.media": "PyAV, Pillow (foresight[media])",
                   "foresight.loader.torch_dataset": "torch.utils.data (foresight[torch])"}


def _tree(module) -> ast.Module:
    with open(module.__file__) as f:
        return ast.parse(f.read())


def _called_names(tree: ast.AST, *, methods_only: bool = False) -> set[str]:
    """Names called in ``tree``: methods (``ds.lookup(...)``, ``engine.read_batch(...)``) and, unless
    ``methods_only``, plain functions (``coalesce(...)``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute):
                out.add(f.attr)
                if isinstance(f.value, ast.Name):
                    out.add(f"{f.value.id}.{f.attr}")  # torch.stack, not np.stack
            elif not methods_only:
                out.add(getattr(f, "id", ""))
    return out


@pytest.mark.parametrize("module", list(CONSUMERS), ids=lambda m: m.__name__)
def test_each_consumer_calls_the_one_read_path_and_keeps_no_copy_of_it(module):
    tree = _tree(module)
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("foresight.source") for a in n.names}
    assert CONSUMERS[module] <= imported, CONSUMERS[module] - imported
    for name in CONSUMERS[module]:  # the very objects of foresight.source, not look-alikes
        assert getattr(module, name) is getattr(source, name), name
    copies = (_called_names(tree, methods_only=True) | ({"coalesce"} & _called_names(tree))) & set(OWNED_CALLS)
    assert not copies, f"{module.__name__} calls {copies} itself: these steps live in foresight.source"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
            assert "ALIGN" not in targets, f"{module.__name__} defines its own ALIGN"
        if isinstance(node, ast.Constant) and node.value == 4096:
            pytest.fail(f"{module.__name__}:{node.lineno} has the alignment as a literal")
        if isinstance(node, ast.FunctionDef):
            assert node.name not in {"_stack", "_modality_codes", "_code", "_blocks_of", "_arena_like"}, node.name


def test_the_owned_calls_are_made_in_the_read_path_modules():
    for call, module in OWNED_CALLS.items():
        with open(os.path.join(PKG, "source", f"{module}.py")) as f:
            assert call in _called_names(ast.parse(f.read())), (call, module)
    # the local fallback and the node's job read through the same function
    assert "read_extents" in _called_names(ast.parse(open(os.path.join(PKG, "source", "reader.py")).read()))


def _modules(*packages: str):
    for pkg in packages:
        for name in sorted(os.listdir(os.path.join(PKG, pkg))):
            if name.endswith(".py"):
                yield os.path.join(PKG, pkg, name)


def test_no_private_name_crosses_a_package_and_imports_are_at_the_top():
    touched = [*_modules("source", "loader"), jobs_mod.__file__, client_mod.__file__]
    for path in [*_modules("source", "loader", "node")]:
        own = os.path.relpath(os.path.dirname(path), PKG).replace(os.sep, ".")
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("foresight."):
                pkg = node.module.split(".")[1]
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert pkg == own or not private, f"{path}: imports {private} from {node.module}"
    for path in touched:
        text = open(path).read()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                    assert all(n in OPTIONAL_EXTRAS or not n.startswith("foresight") for n in names), (
                        f"{path}:{node.lineno}: an import of foresight inside a function")
                    assert "# lazy:" in lines[node.lineno - 1], f"{path}:{node.lineno}: a lazy import says why"


def test_batched_lookups_match_the_datasets(tmp_path):
    r = make_root(str(tmp_path / "root"))
    ds = r["dataset"]
    ids = np.array([5, 0, 11, 3], dtype=np.int64)
    dataset = np.zeros(len(ids), dtype=np.int32)
    ext = ds.lookup(ids)
    shard, offset, length = lookup_samples([ds], dataset, ids)
    assert shard.tolist() == ext.shard.tolist() and offset.tolist() == ext.offset.tolist()
    assert (modality_codes([ds], dataset, ids) == np.asarray(ds.modality_codes())[ids]).all()
    assert sample_epochs([ds, ds], np.array([0, 1]), np.array([ds.num_samples + 1, 3])).tolist() == [1, 0]
    assert set(spec_codes(SPECS)) == set(SPECS)
    files = FileTable([ds], lambda p, direct=False: os.open(p, os.O_RDONLY))
    try:
        file, offset, length = sample_extents([ds], files, dataset, ids)
        with IOEngine(backend="pread") as engine:
            part = read_extents(engine, files, file, offset, length)
            off = coalesce_extents(file, offset, length, max_gap=-1)
            assert off.io_count == len(ids)  # max_gap < 0: coalescing off, as the loader's max_gap=-1
        for i, sample in enumerate(ids):
            with open(files.paths[file[i]], "rb") as f:
                f.seek(int(offset[i]))
                assert part.sample(i).tobytes() == f.read(int(length[i])), sample
    finally:
        files.close()


def test_step_extents_of_one_dataset_match_the_mixture_path(tmp_path):
    """One dataset takes a shortcut (its lookup's arrays are the extents): the same extents as the per-dataset
    path of a mixture, and a piece naming a dataset the loader was not given is still refused by name."""
    ds = make_root(str(tmp_path / "root"))["dataset"]
    one = build_plan([(ds, 1.0)], seed=3, global_batch_size=8, num_steps=2)
    two = build_plan([(ds, 1.0), (ds, 1.0)], seed=3, global_batch_size=8, num_steps=2)
    opener = lambda p, direct=False: os.open(p, os.O_RDONLY)  # noqa: E731
    files_one, files_two = FileTable([ds], opener), FileTable([ds, ds], opener)
    try:
        ext = step_extents(one, [ds], files_one, 0, 8)
        want = ds.lookup(ext.sample)
        assert ext.file.dtype == np.int32 and ext.offset.dtype == ext.length.dtype == np.int64
        assert (ext.offset == want.offset).all() and (ext.length == want.length).all()
        assert (ext.file == want.shard).all()
        mixed = step_extents(two, [ds, ds], files_two, 0, 8)
        assert set(mixed.dataset.tolist()) == {0, 1}  # the per-dataset path, over the same shard files twice
        again = ds.lookup(mixed.sample)
        assert (mixed.offset == again.offset).all() and (mixed.length == again.length).all()
        assert (mixed.file == files_two.base[mixed.dataset] + again.shard).all()
        with pytest.raises(PlanError, match="not given"):
            step_extents(two, [ds], files_one, 0, 8)
    finally:
        files_one.close()
        files_two.close()


def test_stack_samples_stacks_equal_shapes_and_lists_others():
    torch = pytest.importorskip("torch")
    same = stack_samples([np.zeros((2, 3), np.uint8), np.ones((2, 3), np.uint8)], pin=False)
    assert isinstance(same, torch.Tensor) and same.shape == (2, 2, 3) and int(same[1].sum()) == 6
    mixed = stack_samples([np.zeros((2, 3), np.uint8), np.zeros((3, 3), np.uint8)], pin=False)
    assert isinstance(mixed, list) and [tuple(t.shape) for t in mixed] == [(2, 3), (3, 3)]


def test_host_node_and_client_fallback_give_the_same_tensors(tmp_path):
    """One step's part through a real node process (node job), through the client's local fallback (node gone),
    through the source functions directly, and the host loader's reference: the same tensors, every step."""
    r = make_root(str(tmp_path / "root"))
    ds, plan = r["dataset"], r["plan"]
    reference = host_reference(ds, plan)

    stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
    reader = LocalPartReader([ds])
    try:  # the read path alone: a rank's whole step read and decoded with the source's functions
        direct = []
        for step in range(plan.num_steps):
            start, stop = plan.rank_items(step, 0, 1)
            pieces = plan.pieces(start, stop)
            dataset, samples = np.asarray(pieces.dataset), np.asarray(pieces.sample, dtype=np.int64)
            part = reader.read_samples(dataset, samples)
            blocks = decode_part(stage, part, step=step, dataset=dataset, samples=samples,
                                 positions=np.arange(len(samples)), first_item=start)
            fields = {"sample_ids": samples, **{f"{name}_index": pos for name, pos, _ in blocks},
                      **{name: t for name, _, t in blocks}}
            direct.append(summary(_Step(step, fields)))
    finally:
        reader.close()
        stage.close()
    assert direct == reference

    node = NodeProc(r["root"], str(tmp_path / "node"), "--cpu-threshold", "101", name="source")
    try:
        stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
        with NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job="same") as src:
            on_node = [summary(b) for b in src.iterate()]
            assert src._local_io is None and src.stats["samples_local"] == 0  # every tensor decoded by the node
            assert src.stats["samples_remote"] > 0
        stage.close()
    finally:
        assert node.terminate() == 0
    assert on_node == reference

    stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
    with NodeSource(stage, plan, nodes=[node.location], token=TOKEN, job="gone", timeout=5, retry_s=60) as src:
        fallback = [summary(b) for b in src.iterate()]  # the node is gone: all read and decoded here
        assert src.stats["samples_remote"] == 0 and src.stats["samples_local"] > 0
        assert src.stats["bytes_read_here"] > 0
    stage.close()
    assert fallback == reference
    with Loader(ds, plan, decode=MediaDecodeStage([ds], SPECS, seed=9, threads=1)) as loader:
        assert [summary(b) for b in loader] == reference  # the loader's own read (arena slot) agrees too


class _Step(dict):
    def __init__(self, step: int, fields: dict) -> None:
        super().__init__(fields)
        self.step = step
