"""Commits are durable by the syscalls they make, traced with strace in a child process.

Shards, plans and checkpoints are committed the same way (foresight/io/durable.py): every file of the new
directory is fsynced, then the directory itself, then one rename puts it in place, then the parent is
fsynced. A missing fsync passes every functional test and loses data only on power loss, so these tests
read the trace: each file's fsync ends before the rename starts, the directory's fsync ends before the
rename (and after the renames inside it), and the parent's fsync starts after the rename ends. DCP
checkpoints commit by renaming ``.metadata`` instead (data files fsynced first, the directory after). The
checkpoint data files must also be opened with O_DIRECT. strace: scripts/setup.sh (APT_PKGS).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from installed import require

STRACE = shutil.which("strace")
SYSCALLS = "openat,open,fsync,fdatasync,rename,renameat,renameat2"


def _strace_unusable() -> str | None:
    """Why strace cannot trace here (a kernel or container refusing ptrace: a skip), or None. strace itself missing
    is a set-up that went wrong: the fixture below fails every test instead."""
    if STRACE is None:
        return None
    run = subprocess.run([STRACE, "-qq", "-o", os.devnull, "true"], capture_output=True, text=True)
    return None if run.returncode == 0 else f"strace cannot trace here: {run.stderr.strip()}"


STRACE_SKIP = _strace_unusable()
pytestmark = pytest.mark.skipif(STRACE_SKIP is not None, reason=str(STRACE_SKIP))


@pytest.fixture(autouse=True)
def _strace_installed():
    require("strace")


@dataclass
class Call:
    """One traced syscall: ``start``/``end`` are positions in the trace (its entry and its return)."""

    name: str
    args: str
    ret: str
    start: int
    end: int


# "1234 fsync(3</a/b>) = 0", or split across "<unfinished ...>" and "<... fsync resumed>" lines (-f)
_LINE = re.compile(r"^(?P<pid>\d+) +(?P<rest>.*)$")
_WHOLE = re.compile(r"^(?P<name>\w+)\((?P<args>.*)\) += (?P<ret>.*)$")
_UNFINISHED = re.compile(r"^(?P<name>\w+)\((?P<args>.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^<\.\.\. (?P<name>\w+) resumed>(?P<args>.*)\) += (?P<ret>.*)$")
_FD_PATH = re.compile(r"^-?\d+<(?P<path>.*)>$")  # strace -y: "3</path>"


def parse_trace(text: str) -> list[Call]:
    calls: list[Call] = []
    pending: dict[str, tuple[str, str, int]] = {}
    for pos, line in enumerate(text.splitlines()):
        m = _LINE.match(line)
        if not m:
            continue
        pid, rest = m["pid"], m["rest"]
        if w := _WHOLE.match(rest):
            calls.append(Call(w["name"], w["args"], w["ret"], pos, pos))
        elif u := _UNFINISHED.match(rest):
            pending[pid] = (u["name"], u["args"], pos)
        elif r := _RESUMED.match(rest):
            name, args, start = pending.pop(pid, (r["name"], "", pos))
            calls.append(Call(name, args + r["args"], r["ret"], start, pos))
    return sorted(calls, key=lambda c: c.start)


def _split_args(args: str) -> list[str]:
    """Top-level comma split of a syscall's argument text (quoted strings and <paths> kept whole)."""
    out, depth, quoted, cur = [], 0, False, []
    for i, ch in enumerate(args):
        if quoted:
            cur.append(ch)
            if ch == '"' and args[i - 1] != "\\":
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "<[{":
            depth += 1
        elif ch in ">]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _string(arg: str) -> str:
    return arg.strip().strip('"')


def _at(dirfd: str, path: str) -> str:
    """An *at() path argument made absolute against its dirfd (``AT_FDCWD</cwd>`` or ``5</dir>``)."""
    path = _string(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    base = dirfd[dirfd.index("<") + 1 : -1]
    return os.path.normpath(os.path.join(base, path))


@dataclass
class Trace:
    calls: list[Call]

    def fsyncs(self) -> list[tuple[str, Call]]:
        """(path, call) of every successful fsync/fdatasync, the path from strace -y."""
        out = []
        for c in self.calls:
            if c.name in ("fsync", "fdatasync") and c.ret.startswith("0"):
                m = _FD_PATH.match(c.args.strip())
                assert m, f"strace -y gave no path for {c.name}({c.args})"
                out.append((os.path.normpath(m["path"]), c))
        return out

    def renames(self) -> list[tuple[str, str, Call]]:
        """(source, destination, call) of every successful rename, absolute."""
        out = []
        for c in self.calls:
            if not c.ret.startswith("0"):
                continue
            a = _split_args(c.args)
            if c.name == "rename":
                out.append((os.path.normpath(_string(a[0])), os.path.normpath(_string(a[1])), c))
            elif c.name in ("renameat", "renameat2"):
                out.append((_at(a[0], a[1]), _at(a[2], a[3]), c))
        return out

    def opens(self) -> list[tuple[str, str, Call]]:
        """(path, flags, call) of every successful open/openat."""
        out = []
        for c in self.calls:
            if c.name not in ("open", "openat") or c.ret.startswith("-1"):
                continue
            a = _split_args(c.args)
            path, flags = (_at(a[0], a[1]), a[2]) if c.name == "openat" else (_string(a[0]), a[1])
            out.append((path, flags, c))
        return out

    def commit_rename(self, final: str) -> tuple[str, Call]:
        """The rename that published ``final``: (the temp directory it came from, the call)."""
        hits = [(src, c) for src, dst, c in self.renames() if dst == os.path.normpath(final)]
        assert len(hits) == 1, f"expected one rename onto {final}, got {hits}"
        return hits[0]

    def synced_before(self, path: str, inner: list[tuple[str, str, Call]], before: Call) -> bool:
        """``path`` was fsynced before ``before`` started; a file written under a temp name and renamed
        (``inner``) is fsynced under that name."""
        aliases = {path} | {s for s, d, _ in inner if d == path}
        return any(p in aliases and c.end < before.start for p, c in self.fsyncs())

    def assert_durable_commit(self, final: str, names: list[str]) -> str:
        """``final`` was published by renaming a temp directory whose files ``names`` were each fsynced before
        the rename, whose own entries were fsynced after its last inner rename and before the publishing
        rename, and whose parent was fsynced after it. Returns the temp directory."""
        tmp, publish = self.commit_rename(final)
        fsyncs = self.fsyncs()
        inner = [(s, d, c) for s, d, c in self.renames() if os.path.dirname(d) == tmp and c.end < publish.start]
        unsynced = [name for name in names if not self.synced_before(os.path.join(tmp, name), inner, publish)]
        assert not unsynced, f"{unsynced} never fsynced before the rename of {tmp} to {final}"
        after_inner = max((c.end for *_, c in inner), default=-1)
        dir_synced = [c for p, c in fsyncs if p == tmp and after_inner < c.start and c.end < publish.start]
        assert dir_synced, f"the directory {tmp} was not fsynced (after its own renames) before it was renamed"
        parent = os.path.dirname(os.path.normpath(final))
        parent_synced = [c for p, c in fsyncs if p == parent and c.start > publish.end]
        assert parent_synced, f"the parent {parent} was not fsynced after {final} was renamed into it"
        return tmp


def run_traced(script: str, tmp_path) -> Trace:
    """Run ``script`` in a child Python under ``strace -f`` (all threads) and parse the trace."""
    log = tmp_path / "strace.log"
    cmd = [STRACE, "-f", "-qq", "-y", "-s", "4096", "-e", f"trace={SYSCALLS}", "-o", str(log),
           sys.executable, "-c", textwrap.dedent(script)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, f"traced script failed:\n{run.stdout}\n{run.stderr}"
    return Trace(parse_trace(log.read_text()))


def test_shards_and_plans_are_committed_durably(tmp_path):
    trace = run_traced(f"""
        import numpy as np
        from foresight.format import DatasetWriter, open_dataset
        from foresight.plan import build_plan
        from foresight.plan.files import save_plan

        rng = np.random.default_rng(0)
        with DatasetWriter({str(tmp_path / "ds")!r}, align=4096, shard_bytes=64 << 10) as w:
            w.add_many(rng.integers(0, 256, 200_000, dtype=np.uint8), np.full(20, 10_000), modality="bytes")
        ds = open_dataset({str(tmp_path / "ds")!r})
        save_plan(build_plan([(ds, 1.0)], seed=1, global_batch_size=4, num_steps=5), {str(tmp_path / "plan")!r})
    """, tmp_path)
    shard_files = sorted(os.listdir(tmp_path / "ds"))
    assert {"manifest.json", "shard-00000.bin", "shard-00000.map", "shard-00001.bin"} <= set(shard_files)
    trace.assert_durable_commit(str(tmp_path / "ds"), shard_files)
    plan_files = sorted(os.listdir(tmp_path / "plan"))
    assert "plan.json" in plan_files and "item_ptr.npy" in plan_files
    trace.assert_durable_commit(str(tmp_path / "plan"), plan_files)


def test_checkpoints_are_committed_durably_and_written_with_o_direct(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    trace = run_traced(f"""
        import torch
        from foresight.checkpoint import Checkpointer

        state = {{"w": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(7)}}
        with Checkpointer([{str(local)!r}, {str(durable)!r}]) as ckpt:
            ckpt.save(state, step=5).wait(durable=True)
    """, tmp_path)
    from foresight.checkpoint.background_writer import DATA_FILE
    from foresight.checkpoint.store import step_dir

    for root in (local, durable):
        final = step_dir(str(root), 5)
        names = sorted(os.listdir(final))
        assert {DATA_FILE, "index.json", "COMMIT"} <= set(names)
        tmp = trace.assert_durable_commit(final, names)
        if root == local:  # the checkpointer's own write of the data (the drain copies it)
            flags = [f for p, f, _ in trace.opens() if p == os.path.join(tmp, DATA_FILE)]
            assert flags and all("O_DIRECT" in f for f in flags), f"{DATA_FILE} opened with {flags}"


def test_dcp_checkpoints_are_committed_durably_and_written_with_o_direct(tmp_path):
    # DCP's layout has no directory rename: the data files are written in place, and the commit is the
    # rename of .metadata (written under a temp name and fsynced) followed by an fsync of the directory.
    path = tmp_path / "dcp"
    trace = run_traced(f"""
        import torch
        import torch.distributed.checkpoint as dcp
        from foresight.checkpoint.dcp import ForesightStorageWriter

        state = {{"w": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(7)}}
        dcp.save(state, storage_writer=ForesightStorageWriter({str(path)!r}), no_dist=True)
    """, tmp_path)
    from foresight.checkpoint.dcp import METADATA

    metadata = os.path.join(path, METADATA)
    tmp, commit = trace.commit_rename(metadata)
    data = sorted(n for n in os.listdir(path) if n != METADATA)
    assert data, "no data files written"
    unsynced = [p for p in [os.path.join(path, n) for n in data] + [tmp] if not trace.synced_before(p, [], commit)]
    assert not unsynced, f"{unsynced} never fsynced before {METADATA} was renamed into place"
    assert [c for p, c in trace.fsyncs() if p == os.path.normpath(path) and c.start > commit.end], (
        f"{path} was not fsynced after {METADATA} was renamed into it")
    for name in data:
        flags = [f for p, f, _ in trace.opens() if p == os.path.join(path, name) and "O_WRONLY" in f]
        assert flags and all("O_DIRECT" in f for f in flags), f"{name} opened for writing with {flags}"
