"""Limits on work, not only on messages: a job whose transform specs can make a sample, a step part or its decoding
larger than the node's caps is refused at registration with one line naming the field; a fuzz over the spec fields
(sizes, frame counts, crops, dtypes) against a real node finds every spec served within the caps or refused, and
the node alive and within its memory."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foresight.cluster.auth import call_options, connect
from foresight.node.protocol import decode_tensors
from node_helpers import SPECS, TOKEN, NodeProc, make_root

MAX_SAMPLE, MAX_STEP, MAX_DECODE = 2 << 20, 4 << 20, 24 << 20


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_root(str(tmp_path_factory.mktemp("limits")))


@pytest.fixture(scope="module")
def node(root, tmp_path_factory):
    n = NodeProc(root["root"], str(tmp_path_factory.mktemp("limits-node")), "--cpu-threshold", "101",
                 "--max-output-bytes-per-sample", str(MAX_SAMPLE), "--max-step-bytes", str(MAX_STEP),
                 "--max-decode-bytes-per-job", str(MAX_DECODE), "--max-jobs", "2", name="limits")
    yield n
    n.terminate()


def _register(root, node, job: str, specs: dict) -> dict:
    req = {"job": job, "datasets": ["media"], "plan": "plans/p1", "plan_digest": root["plan"].digest, "rank": 0,
           "world_size": 1, "specs": specs, "seed": 9}
    client = connect(node.location)
    try:
        out = list(client.do_action(flight.Action("register_job", json.dumps(req).encode()),
                                    call_options(job, TOKEN, timeout=60)))
        return json.loads(out[0].body.to_pybytes())
    finally:
        client.close()


def _step_and_unregister(node, job: str, step: int = 0) -> list:
    from foresight.node.protocol import encode_ticket

    client = connect(node.location)
    try:
        table = client.do_get(flight.Ticket(encode_ticket(job, rank=0, step=step)),
                              call_options(job, TOKEN, timeout=120)).read_all()
        list(client.do_action(flight.Action("unregister_job", json.dumps({"job": job}).encode()),
                              call_options(job, TOKEN, timeout=30)))
        return table.to_batches()
    finally:
        client.close()


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_a_spec_over_a_cap_is_refused_at_registration_naming_the_field(root, node):
    huge = {"image": {"modality": "image", "size": [1048576, 1048576]}}
    with pytest.raises(flight.FlightServerError) as e:
        _register(root, node, "huge", huge)
    line = str(e.value).splitlines()[0]
    assert "job refused: specs.image.size [1048576, 1048576]" in line
    assert "--max-output-bytes-per-sample 2.0 MiB" in line
    frames = {"video": {"modality": "video", "size": [64, 64], "frames": {"num_frames": 96}}}  # 1.1 MiB a sample
    with pytest.raises(flight.FlightServerError, match=r"frames.num_frames 96.* --max-step-bytes"):
        _register(root, node, "frames", frames)
    crop = {"video": {"modality": "video", "size": [128, 128], "crop": "random_resized", "scale": [0.001, 1.0],
                      "frames": {"num_frames": 8}}}  # 384 KiB out, but frames resized 1000x larger to crop
    with pytest.raises(flight.FlightServerError, match=r"crop random_resized.*--max-decode-bytes-per-job"):
        _register(root, node, "crop", crop)
    ok = _register(root, node, "fits", {k: v.to_dict() for k, v in SPECS.items()})
    assert ok["bounds"]["output_bytes_per_sample"] <= MAX_SAMPLE and ok["bounds"]["step_bytes"] <= MAX_STEP
    _step_and_unregister(node, "fits")


def test_source_extents_read_from_the_meta_column_match_the_metas(root):
    from foresight.format import Modality
    from foresight.node.limits import source_extents

    ds = root["dataset"]
    for name in ("image", "video"):
        code = int(Modality.parse(name))
        metas = [ds.meta(i) for i in np.flatnonzero(np.asarray(ds.modality_codes()) == code)]
        ext = source_extents(ds, code)
        assert ext.samples == len(metas) > 0
        assert ext.max_width == max(m["width"] for m in metas) and ext.max_height == max(m["height"] for m in metas)
        assert ext.max_pixels == max(m["width"] * m["height"] for m in metas)
        assert ext.max_aspect == pytest.approx(max(max(m["width"] / m["height"] for m in metas), 1.0))


def test_a_caption_cannot_hide_a_frame_size_from_the_extents():
    import pyarrow as pa

    from foresight.node.limits import _numbers

    texts = pa.array([json.dumps({"caption": 'a "width": 1, b', "height": 480, "width": 640}), "{}",
                      json.dumps({"width": 2e3, "height": 10})], type=pa.large_string())
    assert _numbers(texts, "width").tolist() == [640.0, 0.0, 2000.0]
    assert _numbers(texts, "height").tolist() == [480.0, 0.0, 10.0]


sizes = st.one_of(st.none(), st.tuples(st.integers(1, 1 << 14), st.integers(1, 1 << 14)))
common = {"dtype": st.sampled_from(["uint8", "float32", "float16", "bfloat16"]),
          "flip": st.sampled_from([0.0, 0.5]),
          "scale": st.tuples(st.floats(1e-4, 1.0), st.floats(1e-4, 1.0)).map(sorted),
          "ratio": st.tuples(st.floats(1e-3, 1e3), st.floats(1e-3, 1e3)).map(sorted),
          "crop": st.sampled_from(["none", "center", "random", "random_resized"])}


@st.composite
def spec_sets(draw) -> dict:
    specs = {}
    for modality in draw(st.sets(st.sampled_from(["image", "video"]), min_size=1)):
        spec = {"modality": modality, "size": draw(sizes)}
        spec.update({k: draw(v) for k, v in common.items()})
        if spec["size"] is None:
            spec["crop"] = "none"
        spec["size"] = None if spec["size"] is None else list(spec["size"])
        spec["scale"], spec["ratio"] = list(spec["scale"]), list(spec["ratio"])
        if modality == "video":
            spec["frames"] = {"num_frames": draw(st.integers(1, 4096)), "window_s": draw(st.sampled_from([None, 0.5]))}
        specs[modality] = spec
    return specs


_seen = {"served": 0, "refused": 0, "n": 0}


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(specs=spec_sets())
def test_fuzzed_specs_are_served_within_the_caps_or_refused_clearly(root, node, specs):
    _seen["n"] += 1
    job = f"fuzz-{_seen['n']}"
    try:
        answer = _register(root, node, job, specs)
    except flight.FlightServerError as e:
        message = str(e).splitlines()[0]
        assert message.startswith("foresight: ") and ("job refused: specs." in message
                                                      or "bad transform spec" in message), message
        _seen["refused"] += 1
    else:
        bounds = answer["bounds"]
        assert bounds["output_bytes_per_sample"] <= MAX_SAMPLE and bounds["step_bytes"] <= MAX_STEP
        assert bounds["decode_bytes"] <= MAX_DECODE
        batches = _step_and_unregister(node, job, step=_seen["n"] % root["plan"].num_steps)
        rows = decode_tensors(batches, as_torch=False)
        assert sum(np.asarray(t).nbytes for _, _, t in rows) <= bounds["step_bytes"]
        assert all(np.asarray(t).nbytes <= bounds["output_bytes_per_sample"] for _, _, t in rows)
        _seen["served"] += 1
    assert node.proc.poll() is None, node.log()[-2000:]


def test_the_fuzz_saw_both_answers_and_the_node_kept_within_its_memory(node):
    assert _seen["served"] > 0 and _seen["refused"] > 0, _seen
    assert node.proc.poll() is None
    # the node's peak resident memory: its interpreter and libraries, plus at most one job's caps at a time
    assert _peak_rss(node.proc.pid) < 1536 << 20
