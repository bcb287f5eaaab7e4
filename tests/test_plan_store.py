"""Plan directories: round trip, byte-identical across processes, atomic saves, and bad files."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from foresight.errors import FormatError, PlanError
from foresight.plan import ARRAY_DTYPES, ArraySource, Plan, build_plan, load_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from process_diagnostics import kill_and_reap, wait_for_lines

BUILD_SCRIPT = """
import sys, numpy as np
from foresight.plan import ArraySource, build_plan
rng = np.random.default_rng(42)
a = ArraySource(rng.integers(0, 300, 70_000), tokens=True, fingerprint="a")
b = ArraySource(rng.integers(1, 50, 999), tokens=True, fingerprint="b")
plan = build_plan([(a, 0.8), (b, 0.2)], seed=2024, global_batch_size=32, seq_len=128, num_steps=200,
                  shuffle=sys.argv[2], block_size=None if sys.argv[2] == "global" else 64)
plan.save(sys.argv[1])
print(plan.digest)
"""


def small_plan(kind: str = "tokens") -> Plan:
    rng = np.random.default_rng(1)
    srcs = [ArraySource(rng.integers(0, 40, n), tokens=kind == "tokens", fingerprint=f"f{n}") for n in (300, 30)]
    return build_plan(list(zip(srcs, [2, 1])), seed=3, global_batch_size=4,
                      seq_len=16 if kind == "tokens" else None, num_steps=12)


def files_of(path: str) -> dict[str, bytes]:
    return {name: Path(path, name).read_bytes() for name in sorted(os.listdir(path))}


@pytest.mark.parametrize("kind", ["tokens", "samples"])
def test_round_trip_is_mmapped_and_equal(tmp_path, kind):
    plan = small_plan(kind)
    out = plan.save(str(tmp_path / "plan"))
    assert sorted(os.listdir(out)) == sorted(["plan.json"] + [n + ".npy" for n in ARRAY_DTYPES])
    loaded = load_plan(out)
    assert loaded.digest == plan.digest and loaded.path == out
    for name in ARRAY_DTYPES:
        assert isinstance(loaded.arrays[name], np.memmap) and not loaded.arrays[name].flags.writeable
        np.testing.assert_array_equal(loaded.arrays[name], plan.arrays[name])
    assert loaded.inputs == plan.inputs and loaded.summary == plan.summary and loaded.kind == kind
    assert loaded.step_json(5) == plan.step_json(5)
    assert json.loads(loaded.step_json(0))["items"][0]["item"] == 0
    doc = json.loads(Path(out, "plan.json").read_text())
    assert doc["digest"] == plan.digest and doc["format_version"] == 1
    assert not any(n.startswith(".") for n in os.listdir(tmp_path)), "no temp dirs left behind"


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_byte_identical_across_processes(tmp_path, shuffle):
    digests = []
    for name in ("one", "two"):
        out = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, str(tmp_path / name), shuffle],
                             check=True, capture_output=True, text=True)
        digests.append(out.stdout.strip())
    assert digests[0] == digests[1]
    assert files_of(str(tmp_path / "one")) == files_of(str(tmp_path / "two"))
    assert load_plan(str(tmp_path / "one")).digest == digests[0]


def test_save_refuses_to_clobber_unless_asked(tmp_path):
    plan = small_plan()
    out = str(tmp_path / "plan")
    plan.save(out)
    with pytest.raises(PlanError, match="exists"):
        plan.save(out)
    other = small_plan("samples")
    other.save(out, overwrite=True)
    assert load_plan(out).kind == "samples"
    assert sorted(os.listdir(tmp_path)) == ["plan"]


def test_unfinished_directory_is_not_a_plan(tmp_path):
    out = str(tmp_path / "plan")
    small_plan().save(out)
    os.remove(os.path.join(out, "plan.json"))  # what a crash before the last write would leave
    with pytest.raises(FormatError, match="plan.json is missing"):
        load_plan(out)
    with pytest.raises(FormatError, match="not a plan directory"):
        load_plan(str(tmp_path / "nowhere"))


def _resave(plan: Plan, path: str, **arrays: np.ndarray) -> None:
    """Save a plan with some arrays replaced and a *correct* digest: only structure checks can catch it."""
    new = dict(plan.arrays, **arrays)
    summary = dict(plan.summary, num_pieces=int(new["piece_sample"].shape[0]))
    Plan(inputs=plan.inputs, summary=summary, arrays=new).save(path, overwrite=True)


@pytest.mark.parametrize("edit,file,message", [
    (lambda a: {"item_ptr": np.r_[a["item_ptr"][:3], a["item_ptr"][2], a["item_ptr"][4:]]}, "item_ptr", "increase"),
    (lambda a: {"piece_sample": np.where(np.arange(len(a["piece_sample"])) == 7, 10**6, a["piece_sample"])},
     "piece_sample", "out of range"),
    (lambda a: {"piece_dataset": np.full_like(a["piece_dataset"], 5)}, "piece_dataset", "out of range"),
    (lambda a: {"piece_length": a["piece_length"] + 1}, "piece_length", "seq_len"),
    (lambda a: {"piece_offset": a["piece_offset"] - 100}, "piece_offset", ">= 0"),
])
def test_structure_is_checked_even_with_a_valid_digest(tmp_path, edit, file, message):
    plan = small_plan()
    out = str(tmp_path / "plan")
    _resave(plan, out, **edit(plan.arrays))
    with pytest.raises(FormatError, match=message) as info:
        load_plan(out, verify=False)
    assert file + ".npy" in str(info.value)


def test_wrong_dtype_and_digest_mismatch(tmp_path):
    plan = small_plan()
    out = str(tmp_path / "plan")
    plan.save(out)
    np.save(os.path.join(out, "piece_length.npy"), np.asarray(plan.piece_length, dtype=np.int32))
    with pytest.raises(FormatError, match="piece_length") as info:
        load_plan(out)
    assert "piece_length.npy" in str(info.value)
    plan.save(out, overwrite=True)
    length = np.array(plan.piece_length)
    length[[0, 1]] = length[[1, 0]] if length[0] != length[1] else length[[0, 1]]
    sample = np.array(plan.piece_sample)
    sample[-1] = (sample[-1] + 1) % 30  # still in range for either dataset
    np.save(os.path.join(out, "piece_sample.npy"), sample)
    load_plan(out, verify=False)  # structurally fine
    with pytest.raises(PlanError, match="digest") as info:
        load_plan(out)
    assert out in str(info.value)


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fuzz") / "plan")
    small_plan().save(out)
    return out, load_plan(out)


FILES = ["plan.json"] + [n + ".npy" for n in ARRAY_DTYPES]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file=st.sampled_from(FILES), op=st.sampled_from(["truncate", "flip", "append", "json"]),
       where=st.floats(0, 1, exclude_max=True), byte=st.integers(1, 255), junk=st.binary(min_size=1, max_size=64))
def test_fuzzed_plan_files_fail_cleanly(saved_plan, tmp_path_factory, file, op, where, byte, junk):
    src, good = saved_plan
    out = str(tmp_path_factory.mktemp("case") / "plan")
    shutil.copytree(src, out)
    target = os.path.join(out, file)
    data = bytearray(Path(target).read_bytes())
    pos = int(where * len(data))
    if op == "truncate":
        data = data[:pos]
    elif op == "flip":
        data[pos] ^= byte
    elif op == "append":
        data += junk
    else:  # splice junk into the middle, as a botched edit would
        data[pos : pos + len(junk)] = junk
    Path(target).write_bytes(bytes(data))
    try:
        plan = load_plan(out)
    except (FormatError, PlanError) as e:
        assert out in str(e), str(e)
        return
    # Anything that still loads must be the very same plan.
    assert plan.digest == good.digest and plan.inputs == good.inputs and plan.summary == good.summary
    for name in ARRAY_DTYPES:
        np.testing.assert_array_equal(plan.arrays[name], good.arrays[name])


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["inputs"].update(shuffle="zigzag"), "shuffle"),
    (lambda d: d["inputs"].update(seed="1"), "seed"),
    (lambda d: d["summary"].update(num_items=3), "num_items"),
    (lambda d: d["arrays"]["item_ptr"].update(shape=[2]), "shape"),
    (lambda d: d["inputs"]["sources"].pop(), "one entry per source"),
    (lambda d: d.pop("digest"), "digest"),
    (lambda d: d.update(extra=1), "unexpected"),
    (lambda d: d["inputs"]["sources"][0].update(weight=float("inf")), "Infinity"),
    (lambda d: d["summary"]["datasets"][0].update(share=float("nan")), "NaN"),
])
def test_malformed_plan_json(tmp_path, mutate, message):
    out = str(tmp_path / "plan")
    small_plan().save(out)
    path = os.path.join(out, "plan.json")
    doc = json.loads(Path(path).read_text())
    mutate(doc)
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=message) as info:
        load_plan(out)
    assert "plan.json" in str(info.value)


CRASH_SCRIPT = """
import sys, numpy as np
from foresight.plan import ArraySource, build_plan
plan = build_plan([(ArraySource(np.full(3_000_000, 100), tokens=False), 1)], seed=1, global_batch_size=8, epochs=1)
print("saving", flush=True)
plan.save(sys.argv[1])
print("saved", flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_killed_save_leaves_no_plan_that_reads_as_complete(tmp_path, delay):
    import time

    out = str(tmp_path / "plan")
    output = tmp_path / "saver.out"
    with open(output, "w") as child_out:
        proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, out], stdout=child_out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_lines(proc, output, {"saving"}, what="the plan saver")
        time.sleep(delay)  # where in the save the kill lands (not a timing assertion)
    finally:
        kill_and_reap(proc, "the plan saver")
    if os.path.exists(out):  # the rename happened before the kill: then it is whole
        assert load_plan(out).num_items == 3_000_000
    else:
        with pytest.raises(FormatError):
            load_plan(out)
