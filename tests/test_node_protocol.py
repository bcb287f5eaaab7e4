"""Request decoding (fuzzed), tickets, tensors as record batches (zero copy), the CPU guard's rule, and the decode
stage's per-sample items that let a node decode part of a step with the host's keys."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foresight.errors import ProtocolError
from foresight.node.guard import CpuGuard
from foresight.node.protocol import (ACTION_DECODERS, decode_action, decode_tensors, decode_ticket, encode_tensors,
                                     encode_ticket)
from node_helpers import SPECS

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)
FIELDS = ["job", "datasets", "plan", "plan_digest", "rank", "world_size", "specs", "seed", "step", "lead",
          "queue_bytes", "spec_digest", "version"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(ACTION_DECODERS) + ["nope"]), body=st.binary(max_size=300))
def test_fuzz_random_bytes_only_raise_protocol_error(name, body):
    try:
        decode_action(name, body)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=st.dictionaries(st.sampled_from(FIELDS + ["x"]), json_values, max_size=14),
       name=st.sampled_from(sorted(ACTION_DECODERS)))
def test_fuzz_json_objects_only_raise_protocol_error(obj, name):
    try:
        out = decode_action(name, json.dumps(obj).encode())
    except ProtocolError:
        return
    assert isinstance(out, dict)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200) | st.dictionaries(st.sampled_from(["job", "rank", "step", "x"]), json_values)
       .map(lambda d: json.dumps(d).encode()))
def test_fuzz_tickets(body):
    try:
        t = decode_ticket(body)
    except ProtocolError:
        return
    assert set(t) == {"job", "rank", "step"}


def test_ticket_round_trip_and_deep_json_refused():
    assert decode_ticket(encode_ticket("j-1", rank=2, step=7)) == {"job": "j-1", "rank": 2, "step": 7}
    with pytest.raises(ProtocolError):
        decode_ticket(b"[" * 5000 + b"]" * 5000)
    with pytest.raises(ProtocolError, match="constant"):
        decode_action("progress", b'{"job": "j", "step": NaN}')


def test_tensors_round_trip_zero_copy_on_both_sides():
    video = torch.arange(4 * 2 * 3 * 4 * 5, dtype=torch.uint8).reshape(4, 2, 3, 4, 5)
    odd = [torch.randn(3, 5, 7), torch.randn(3, 6, 7)]
    bf = torch.randn(2, 3).to(torch.bfloat16)
    rows = [(9, "image", odd[0]), (11, "image", odd[1]), (12, "audio", bf)]
    schema, batches, copied = encode_tensors("decoded", rows, step=3, node="n",
                                             stacked={"video": (np.array([0, 2, 5, 7]), video)})
    assert copied == sum(t.numel() * t.element_size() for t in odd + [bf])  # stacked video: no copy
    values = batches[0].column(4).buffers()[2]
    assert values.address == video.data_ptr()
    rows = decode_tensors(batches)
    assert [(p, m) for p, m, _ in rows] == [(0, "video"), (2, "video"), (5, "video"), (7, "video"), (9, "image"),
                                           (11, "image"), (12, "audio")]
    for (_, _, t), want in zip(rows, list(video) + odd + [bf]):
        assert t.dtype == want.dtype and torch.equal(t, want)
    assert rows[1][2].data_ptr() == values.address + video[0].numel()  # received rows view the Arrow buffer
    assert schema.metadata[b"kind"] == b"decoded"


def test_bad_record_batches_are_refused():
    import pyarrow as pa

    schema, batches, _ = encode_tensors("raw", [(0, "image", np.zeros(10, np.uint8))], step=0, node="n")
    b = batches[0]
    bad = pa.record_batch([b.column(0), b.column(1), b.column(2), pa.array([[11]], type=pa.list_(pa.int64())),
                           b.column(4)], schema=schema)
    with pytest.raises(ProtocolError, match="do not match its shape"):
        decode_tensors([bad])
    bad = pa.record_batch([b.column(0), b.column(1), pa.array(["object"]), b.column(3), b.column(4)], schema=schema)
    with pytest.raises(ProtocolError, match="bad dtype"):
        decode_tensors([bad])


def test_cpu_guard_needs_a_sustained_high_reading_and_releases_with_hysteresis():
    g = CpuGuard(80, window=3, hysteresis=10)
    assert not g.observe(100) and not g.observe(100)  # window not full yet
    assert g.observe(95)
    assert g.observe(75)  # mean 90: still on
    assert g.observe(60) and not g.observe(40)  # means 76.7 (>= 70), then 58.3 (< 70)
    assert CpuGuard(0).engaged and not CpuGuard(101).observe(100)


def test_stage_decodes_a_subset_with_each_samples_plan_item(tmp_path):
    """The items hook: decoding positions [1, 3] of a step alone gives the rows the whole step gives."""
    from foresight.loader import Loader, MediaDecodeStage
    from node_helpers import make_root

    r = make_root(str(tmp_path / "root"), samples=6, steps=4)
    ds, plan = r["dataset"], r["plan"]
    stage = MediaDecodeStage([ds], SPECS, seed=9, threads=2)
    try:
        with Loader(ds, plan, start_step=3, end_step=4) as loader:  # step 3 straddles an epoch boundary
            it = iter(loader)
            batch = next(it)
            fields = {k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            start, _ = plan.rank_items(3, 0, 1)
            whole = stage(dict(fields), first_item=start)
            keep = np.array([1, 3])
            sub = dict(fields, offsets=fields["offsets"][keep], lengths=fields["lengths"][keep],
                       dataset=fields["dataset"][keep], sample_ids=fields["sample_ids"][keep], items=start + keep)
            part = stage(sub, first_item=start)
    finally:
        stage.close()
    for name in SPECS:
        if name not in part:
            continue
        for row, i in enumerate(part[f"{name}_index"].tolist()):
            whole_row = whole[f"{name}_index"].tolist().index(int(keep[i]))
            assert torch.equal(part[name][row], whole[name][whole_row])


def test_raw_samples_gathered_out_of_a_read_region_and_back(monkeypatch):
    import foresight.node.protocol as protocol

    rng = np.random.default_rng(0)
    region = rng.integers(0, 255, 20000, dtype=np.uint8)
    x_dest = np.array([4096, 0, 12288, 9000], dtype=np.int64)
    lengths = np.array([700, 300, 5000, 0], dtype=np.int64)
    positions = np.array([3, 0, 2, 7])
    for limit in (protocol.MAX_BATCH_BYTES, 1000):  # one batch, then one per ~1000 bytes (concatenated back)
        monkeypatch.setattr(protocol, "MAX_BATCH_BYTES", limit)
        schema, batches, copied = protocol.encode_raw(region, x_dest, lengths, positions,
                                                      ["image", "video", "image", "audio"], step=1, node="n")
        assert copied == lengths.sum() and (len(batches) == 1) == (limit > 10000)
        assert schema.metadata[b"kind"] == b"raw"
        pos, data, offs, lens = protocol.raw_samples(batches)
        assert pos.tolist() == positions.tolist() and lens.tolist() == lengths.tolist()
        for p, o, n, x in zip(pos, offs, lens, x_dest):
            assert np.array_equal(data[o: o + n], region[x: x + n])


def test_blocks_view_stacked_batches_and_group_odd_ones():
    from foresight.node.protocol import decode_blocks

    video = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    odd = [torch.ones(2, 2, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8)]
    _, batches, _ = encode_tensors("decoded", [(4, "image", odd[0]), (6, "image", odd[1])], step=0, node="n",
                                   stacked={"video": (np.array([0, 1, 5]), video)})
    blocks = decode_blocks(batches)
    (m0, p0, t0), (m1, p1, t1) = blocks
    assert m0 == "video" and p0.tolist() == [0, 1, 5] and torch.equal(t0, video)
    assert t0.data_ptr() == batches[0].column(4).buffers()[2].address  # a view, not a copy
    assert m1 == "image" and p1.tolist() == [4, 6] and all(torch.equal(a, b) for a, b in zip(t1, odd))
