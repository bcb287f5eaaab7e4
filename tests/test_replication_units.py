"""Transfer units, the priority lane and the WAN link: pieces of replication that need no second site."""
from __future__ import annotations

import os

import numpy as np
import pytest

from foresight.replication.scheduler import PriorityLane, priority_of
from foresight.replication.units import (
    HEAD_UNITS,
    ReplicaBuilder,
    Unit,
    check_name,
    meta_files,
    plan_units,
    read_unit,
    unit_ends,
    verify_checkpoint,
)
from foresight.testing.wan import measure_rtt
from foresight.errors import CheckpointError


def make_source(tmp_path, nbytes=300_000):
    """A checkpoint directory of foresight's format written by hand: one data file, index, COMMIT."""
    from foresight.checkpoint import store
    from foresight.checksum import xxh3_many

    src = tmp_path / "src" / "step-00000007"
    src.mkdir(parents=True)
    data = np.random.default_rng(3).integers(0, 255, nbytes, dtype=np.uint8)
    (src / "data-00000.bin").write_bytes(data.tobytes())
    offs = np.array([0, 100, 5000, 70000], np.int64)
    lens = np.array([100, 4900, 65000, nbytes - 70000], np.int64)
    sums = xxh3_many(data, offs, lens)
    index = {"format": store.FORMAT, "version": store.VERSION, "step": 7, "files": [{"name": "data-00000.bin",
             "bytes": nbytes}], "tensors": {"name": ["a", "b", "c", "d"], "file": [0] * 4, "offset": offs.tolist(),
             "nbytes": lens.tolist(), "dtype": ["torch.uint8"] * 4, "shape": [[int(n)] for n in lens],
             "xxh3": [f"{int(h):016x}" for h in sums]}, "skeleton": None, "extra_state": None}
    store.write_index_and_commit(str(src), index)
    return str(src)


def send(src, rb, units, only=None):
    fd = os.open(os.path.join(src, units[0].file), os.O_RDONLY)
    try:
        for u in units:
            if only is None or u.id in only:
                body, h = read_unit(fd, u)
                rb.write_unit(u.header(h), [memoryview(body)[:7], memoryview(body)[7:]])
    finally:
        os.close(fd)


def test_a_files_first_and_last_units_are_small_so_little_waits_at_either_end():
    """A file sent while it is written has its first unit complete after a sixteenth of a unit is written (the
    first units double up to a whole one) and its last unit just before the commit: units are whole until the last
    four units' worth, then a quarter of what is left (aligned), down to unit/16."""
    unit = 8 << 20
    for size in (100 << 20, (100 << 20) + 12345, 3 * unit, unit // 3):
        ends = unit_ends(size, unit)
        lengths = np.diff([0, *ends])
        assert ends[-1] == size and (lengths > 0).all()
        ramp = [unit >> (4 - i) for i in range(HEAD_UNITS)]  # 1/16, 1/8, 1/4, 1/2 of a unit
        if size >= 8 * unit:
            assert lengths[:HEAD_UNITS].tolist() == ramp
        assert all(n <= cap for n, cap in zip(lengths, ramp))
        head = min(HEAD_UNITS, len(lengths))
        body = lengths[head:]
        whole = int(np.argmax(body < unit)) if (body < unit).any() else len(body)
        assert (body[:whole] == unit).all() and size - int(lengths[:head].sum()) - whole * unit < 4 * unit
        tail = body[whole:]
        assert (np.diff(tail[:-1]) <= 0).all()  # shrinking toward the end
        assert tail[-1] <= unit // 16 and all(e % 4096 == 0 for e in ends[:-1])  # direct I/O cuts
    units = plan_units([("a.bin", 100 << 20), ("b.bin", 5000)], unit)
    assert [u.offset + u.length for u in units if u.file == "a.bin"] == unit_ends(100 << 20, unit)
    assert [(u.file, u.offset, u.length) for u in units[-1:]] == [("b.bin", 0, 5000)]


def test_a_replicated_checkpointer_save_reports_each_unit_as_it_lands(tmp_path):
    """The writer reports progress where the transfer units end, so the last unit (small) leaves as soon as its
    bytes land, and the commit comes after the last report. A recording policy: no node needed."""
    import torch

    from foresight.checkpoint import Checkpointer
    from foresight.replication.policy import Replication

    class Recording(Replication):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.events = []

        def data_started(self, step, directory, files, **kw):
            self.events.append(("started", files))

        def data_progress(self, step, written):
            self.events.append(("progress", written["data-00000.bin"]))

        def data_written(self, step, directory, **kw):
            self.events.append(("written", kw.get("nbytes")))

        def committed(self, step, path):
            self.events.append(("committed", step))

    unit = 1 << 20
    rep = Recording(every=1, site="eval-b", node="grpc://127.0.0.1:1", job="job", unit_bytes=unit)
    with Checkpointer(str(tmp_path / "ck"), replicate=rep) as ck:
        ck.save({f"w{i}": torch.randn(1 << 16) for i in range(40)}, 1).wait()  # 10 MiB
    (kind, files), *rest = rep.events
    total = files[0][1]
    reported = [n for k, n in rest if k == "progress"]
    assert kind == "started" and reported == rep.progress_ends(total) == unit_ends(total, unit)
    assert reported[-1] - reported[-2] <= unit // 16  # the last piece, written just before the commit, is small
    assert [k for k, _ in rest[len(reported):]] == ["written", "committed"]


def test_a_replicated_checkpointer_save_reports_its_first_unit_before_the_snapshot_is_copied(tmp_path, monkeypatch):
    """Units leave as soon as their bytes are staged: the writer starts with the snapshot and writes each piece once
    the snapshot has copied it, so the first unit is written and reported while later tensors are still being
    copied into the staging slot (it waited for the whole snapshot before). Asserted by the order of events: the
    copy holds on after its first tensors until the first report came (a bounded wait) and records both."""
    import threading

    import torch

    from foresight.checkpoint import Checkpointer
    from foresight.checkpoint.staging import StagedPrefix
    from foresight.replication.policy import Replication

    events, reported, held = [], threading.Event(), []

    class Recording(Replication):
        def data_started(self, step, directory, files, **kw):
            pass

        def data_progress(self, step, written):
            events.append(("reported", written["data-00000.bin"]))
            reported.set()

        def committed(self, step, path):
            events.append(("committed", step))

    advance = StagedPrefix.advance

    def advance_then_wait(self, upto):
        advance(self, upto)
        events.append(("staged", upto))
        if 4 << 20 <= upto < self.total and not held:  # 4 of 16 tensors copied: the first unit (64 KiB) is in
            held.append(upto)
            reported.wait(30)

    monkeypatch.setattr(StagedPrefix, "advance", advance_then_wait)
    rep = Recording(every=1, site="eval-b", node="grpc://127.0.0.1:1", job="job", unit_bytes=1 << 20)
    with Checkpointer(str(tmp_path / "ck"), replicate=rep) as ck:
        ck.save({f"w{i}": torch.randn(1 << 18) for i in range(16)}, 1).wait()  # 16 tensors of 1 MiB
    first = events.index(next(e for e in events if e[0] == "reported"))
    copied = [e for e in events if e[0] == "staged"]
    assert copied[-1] == ("staged", copied[-1][1]) and first < events.index(copied[-1])  # before the last copy
    assert events[-1] == ("committed", 1)


def test_a_sender_bounds_the_bytes_in_flight_not_the_windows():
    """Full windows: two unacknowledged per sending thread, as before. The small windows of a save in progress
    (units released one by one as they are written) go without waiting for the previous ones' acknowledgements,
    up to a count that still bounds the site's concurrent calls."""
    from foresight.replication.send_windows import MAX_WINDOWS_IN_FLIGHT, WINDOW_BYTES, InFlight

    full = InFlight()
    full.add(WINDOW_BYTES)
    assert full.room(timeout=0)
    full.add(WINDOW_BYTES)
    assert not full.room(timeout=0)  # two full windows fill the budget
    full.done(WINDOW_BYTES)
    assert full.room(timeout=0)
    small = InFlight()
    for i in range(MAX_WINDOWS_IN_FLIGHT):
        assert small.room(timeout=0), i  # was: the third one waited for the first one's acknowledgement
        small.add(1 << 20)
    assert not small.room(timeout=0) and small.bytes < small.max_bytes  # the count binds


def test_units_rebuild_a_bit_identical_replica(tmp_path):
    src = make_source(tmp_path)
    units = plan_units([("data-00000.bin", 300_000)], unit_bytes=64 << 10)
    assert max(u.length for u in units) <= 64 << 10 and len(units) == len(unit_ends(300_000, 64 << 10)) > 5
    assert sum(u.length for u in units) == 300_000
    rb = ReplicaBuilder(str(tmp_path / "dst"), "job/step-00000007")
    send(src, rb, units)
    final = rb.finalize(meta_files(src), len(units))
    assert final == str(tmp_path / "dst" / "job" / "step-00000007")
    for n in os.listdir(src):
        assert open(os.path.join(src, n), "rb").read() == open(os.path.join(final, n), "rb").read(), n
    assert verify_checkpoint(final) == 4
    assert not os.path.exists(rb.tmp)


def test_a_cut_transfer_is_never_a_replica_and_resumes_by_unit(tmp_path):
    src = make_source(tmp_path)
    units = plan_units([("data-00000.bin", 300_000)], unit_bytes=64 << 10)
    dst = str(tmp_path / "dst")
    rb = ReplicaBuilder(dst, "job/step-00000007")
    send(src, rb, units, only={0, 1})
    fd = os.open(os.path.join(src, "data-00000.bin"), os.O_RDONLY)
    body, h = read_unit(fd, units[2])
    os.close(fd)
    with pytest.raises(CheckpointError, match="cut short"):  # the stream broke half way through unit 2
        rb.write_unit(units[2].header(h), [memoryview(body)[:1000]])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        rb.write_unit(units[2].header(h ^ 1), [body])
    with pytest.raises(CheckpointError, match="units missing"):
        rb.finalize(meta_files(src), len(units))
    assert not os.path.exists(os.path.join(dst, "job", "step-00000007"))
    from foresight.checkpoint import store

    assert store.committed_steps(os.path.join(dst, "job")) == []
    rb2 = ReplicaBuilder(dst, "job/step-00000007")  # e.g. the receiver restarted
    assert rb2.done_units() == {0, 1}
    send(src, rb2, units, only=set(range(len(units))) - rb2.done_units())
    assert verify_checkpoint(rb2.finalize(meta_files(src), len(units))) == 4


def test_a_unit_journaled_already_is_drained_not_rewritten_and_a_replanned_one_is_written(tmp_path):
    """A sender may put a window before the site's status answer arrives: the units the site journaled (same id,
    same extent) are acknowledged without writing them again; an id journaled for another extent (a transfer
    planned in another order) is written and journaled anew."""
    src = make_source(tmp_path)
    units = plan_units([("data-00000.bin", 300_000)], unit_bytes=64 << 10)
    rb = ReplicaBuilder(str(tmp_path / "dst"), "job/step-00000007")
    send(src, rb, units, only={0, 1})
    replica = os.path.join(rb.tmp, "data-00000.bin")
    with open(replica, "r+b") as f:  # marks unit 0's place: a rewrite would overwrite it
        f.write(b"MARK")
    fd = os.open(os.path.join(src, "data-00000.bin"), os.O_RDONLY)
    (b0, h0), (b1, h1) = read_unit(fd, units[0]), read_unit(fd, units[1])
    os.close(fd)
    moved = Unit(0, units[1].file, units[1].offset, units[1].length, units[1].file_size)  # id 0, unit 1's bytes
    done, syncs = rb.write_units([(units[0].header(h0), memoryview(b0)), (moved.header(h1), memoryview(b1))])
    assert done == [0, 0] and syncs == 2
    assert open(replica, "rb").read(4) == b"MARK"  # unit 0 drained, not written again
    assert rb.done_extents()[0] == ("data-00000.bin", units[1].offset, units[1].length)
    assert rb.done_units() == {0, 1}


def test_a_corrupt_replica_fails_verification(tmp_path):
    src = make_source(tmp_path)
    units = plan_units([("data-00000.bin", 300_000)], unit_bytes=1 << 20)
    rb = ReplicaBuilder(str(tmp_path / "dst"), "job/step-00000007")
    send(src, rb, units)
    with open(os.path.join(rb.tmp, "data-00000.bin"), "r+b") as f:  # bit rot after the unit check
        f.seek(6000)
        f.write(b"\x00\x01")
    with pytest.raises(CheckpointError, match="replica tensor checksum mismatch.*tensor=c"):
        rb.finalize(meta_files(src), len(units))
    assert not os.path.exists(rb.final)


def test_names_cannot_escape_the_root():
    assert check_name("job-1/step-00000100") == "job-1/step-00000100"
    for bad in ("../x", "job/../../etc", "/abs", "job//step", ".hidden/x", ""):
        with pytest.raises(CheckpointError, match="bad checkpoint name"):
            check_name(bad)


def test_urgent_overtakes_bulk_in_progress_and_bulk_is_not_starved():
    lane = PriorityLane(aging=1.0)
    bulk, urgent = priority_of(model_bytes=7 << 30), priority_of(model_bytes=7 << 30, severity=0.5)
    lane.add("bulk", range(10), bulk)
    order = [lane.pop(timeout=0) for _ in range(3)]
    assert order == [("bulk", 0), ("bulk", 1), ("bulk", 2)]
    lane.add("urgent", range(4), urgent)  # an anomaly: evaluate this step now
    order = [lane.pop(timeout=0) for _ in range(5)]
    assert order == [("urgent", 0), ("urgent", 1), ("urgent", 2), ("urgent", 3), ("bulk", 3)]
    # a flood of urgent work: bulk still gets a unit once its credit has grown past the gap
    lane.add("flood", range(10_000), urgent)
    keys = [lane.pop(timeout=0)[0] for _ in range(2000)]
    first_bulk = keys.index("bulk")
    assert 0 < first_bulk <= int(urgent - bulk) + 2
    assert keys.count("bulk") == 6  # the rest of bulk finished inside the flood


def test_priority_grows_with_size_importance_and_severity():
    assert priority_of(model_bytes=1 << 30) < priority_of(model_bytes=1 << 40)
    assert priority_of(importance=1) < priority_of(importance=2)
    assert priority_of(model_bytes=1 << 40, importance=5) < priority_of(severity=0.1)
    with pytest.raises(ValueError):
        priority_of(severity=2.0)


def test_lane_is_fifo_among_equals_and_closes():
    lane = PriorityLane()
    lane.add("a", [0], 1.0)
    lane.add("b", [0], 1.0)
    assert lane.pop(timeout=0) == ("a", 0)
    lane.close()
    assert lane.pop() is None


def test_a_window_takes_units_up_to_its_bytes_whatever_the_first_units_size():
    """A file's first units are small (the head ramp): a window opened by one still stops at the window's bytes,
    it does not take as many whole units as would fit in small ones."""
    units = [Unit(i, "a.bin", 0, n, 0) for i, n in enumerate([1, 2, 4, 8, 8, 8, 8])]
    lane = PriorityLane()
    lane.add("a", units, 1.0)
    _, first = lane.pop(timeout=0)
    window = [first, *lane.take("a", 64, max_bytes=16 - first.length)]
    assert [u.length for u in window] == [1, 2, 4, 8] and lane.pending("a") == 3
    assert lane.take("a", 64, max_bytes=7) == [] and lane.take("a", 2) == units[4:6]  # no cap: by count


def test_wan_link_delays_every_round_trip():
    rtt = measure_rtt(rtt_ms=40, pings=3)
    # the proxy never delivers a byte before its due time, so this lower bound holds on any machine
    assert rtt["min_ms"] >= 40 - 2


def test_lane_budget_pauses_and_lets_exactly_n_units_go():
    lane = PriorityLane()
    lane.set_budget(0)
    lane.add("a", range(5), 1.0)
    assert lane.pop(timeout=0) is None  # paused
    lane.set_budget(2)
    assert [lane.pop(timeout=0) for _ in range(3)] == [("a", 0), ("a", 1), None]
    lane.set_budget(None)
    assert lane.pop(timeout=0) == ("a", 2)


def test_a_replica_file_writes_the_aligned_middle_of_each_piece_with_o_direct(tmp_path):
    """Units of a save in progress bypass the site's page cache (its intake kept pace with a 100 MB/s save only
    then): the 4 KiB-aligned middle of a large piece goes with O_DIRECT, an unaligned head or tail and a small
    piece buffered, and the file holds every byte where it belongs."""
    from foresight.io.direct_write import ALIGN, BOUNCE_BYTES, DIRECT_MIN
    from foresight.replication.replica_file import ReplicaFile

    size = BOUNCE_BYTES + 3 * ALIGN + 100  # a piece longer than the bounce buffer, and an unaligned file end
    data = np.random.default_rng(5).integers(0, 255, size, dtype=np.uint8).tobytes()
    path = str(tmp_path / "data-00000.bin")
    f = ReplicaFile(path, size, direct=True)
    try:
        view = memoryview(data)
        f.pwrite(view[:100], 0)  # small: buffered
        f.pwrite(view[100:ALIGN + 10], 100)  # small: buffered
        f.pwrite(view[ALIGN + 10:size], ALIGN + 10)  # head buffered, aligned middle direct (the bounce twice), tail
        f.sync()
        counts = dict(f.counts)
    finally:
        f.close()
    middle = (size - 2 * ALIGN) // ALIGN * ALIGN  # from the 2nd block to the last whole one
    assert middle >= DIRECT_MIN
    if counts["fallbacks"]:  # a file system without O_DIRECT (tmpfs before Linux 6.6): all buffered, logged
        assert counts == {"direct_bytes": 0, "buffered_bytes": size, "fallbacks": 1}
    else:
        assert counts == {"direct_bytes": middle, "buffered_bytes": size - middle, "fallbacks": 0}
    assert open(path, "rb").read() == data
    g = ReplicaFile(path, size, direct=False)  # a committed checkpoint's units: through the page cache
    try:
        g.pwrite(view[:size], 0)
        assert g.counts == {"direct_bytes": 0, "buffered_bytes": size, "fallbacks": 0}
    finally:
        g.close()


def test_a_window_written_direct_verifies_and_publishes_like_a_buffered_one(tmp_path):
    src = make_source(tmp_path, nbytes=8 << 20)
    units = plan_units([("data-00000.bin", 8 << 20)], unit_bytes=2 << 20)
    rb = ReplicaBuilder(str(tmp_path / "dst"), "job/step-00000007")
    fd = os.open(os.path.join(src, "data-00000.bin"), os.O_RDONLY)
    try:
        parts = []
        for u in units:
            body, h = read_unit(fd, u)
            parts += [(u.header(h), memoryview(body)[:4096]), (None, memoryview(body)[4096:])]
    finally:
        os.close(fd)
    done, syncs = rb.write_units(parts, direct=True)
    assert done == [u.id for u in units] and syncs == 2
    assert rb.written["direct_bytes"] + rb.written["buffered_bytes"] == 8 << 20
    assert rb.written["direct_bytes"] > 0 or rb.written["direct_refused"]  # the units' large pieces, direct
    assert verify_checkpoint(rb.finalize(meta_files(src), len(units))) == 4
