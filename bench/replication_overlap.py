"""Send while saving: how much of a replicated Checkpointer save is still to cross the WAN when the save commits.

Two sites as real processes (replication nodes, foresight's WAN bed between them: 100 ms, 1 Gbit/s shared by all
connections). The training site saves a checkpoint with ``Checkpointer(..., replicate=Replication(...))``; the
data file is written at a simulated disk speed (each completed write waits ``bytes / speed``: a page-cache write
on this machine is far faster than any real checkpoint disk, so the transfer would have nothing to overlap).
Reported per write speed (the save with the median bytes left of ``--repeats`` saves, and their range): the
save's duration (call -> commit), the bytes left at the commit, and commit -> replica ready.

"Left at the commit" is what the sender had not yet put on the link when the source committed: the bed delivers
each byte exactly ``rtt/2`` after the link's serializer sends it (see docs/wan_bed.md), so a byte is on the link by
the commit when the evaluation site received it by the commit + ``rtt/2`` (its arrival times, same clock; a unit's
body arrives in 1 MiB pieces, each counted as it comes). Bytes still in the sender, its socket buffers or queued in
front of the link's serializer count as left; the site's own intake lag only adds to it. That is the issue's "left
to send", and the quantity the floor below bounds (the link cannot send more than its rate x the save). Beside it,
two stricter figures that also charge the link's propagation delay and the site's work to the sender: the bytes
of the units the site had not received whole by the commit (a unit received in part counts wholly as left; the
figure this bench judged by before), and the bytes the site had not yet acknowledged (verified, synced and
journaled: that trails arrival by the return half of the round trip and the site's sync).

The issue's target: bytes left at the commit <= what the link carries in 10% of the save's duration. It is
reachable only when the save lasts at least as long as the transfer: during a shorter save the link cannot carry
more than its rate x the save, so at least ``floor = total - link rate x save`` (>= 0) is left whatever the sender
does. Each row prints that physical floor and the bytes left over it, and is judged by
``left <= floor + 10% of the save at the link rate`` (the floor is 0 for saves at least as long as the transfer,
so that is the issue's target as written there).

Then, in the same run and on the same bed (a second proxy with the same delay and cap, or ``--background`` flows
sharing each), how fast replication moves a committed checkpoint against what a practitioner does without it:
one plain TCP stream of the data file (``sendfile``; the receiver writes a new file and syncs it), and N parallel
plain streams (N = the sender's streams, each a slice of the file). Replication is timed start -> replica ready
(a status round trip, the windows, the publish round trip and its verification included); each plain copy
connect -> the receiver's acknowledgement after its sync. Target: replication >= 0.9x one plain stream, and
>= 0.9x N plain streams when the link is shared.

    python bench/replication_overlap.py            # 256 MiB, 8 MiB units, write speeds 50, 100 and 400 MB/s
    python bench/replication_overlap.py --smoke    # 16 MiB over a 100 Mbit/s link; what the smoke test runs
    python bench/replication_overlap.py --write-mb-s "" --repeats 3 --background 0,1   # the link comparison alone
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine, print_table, write_results  # noqa: E402

from foresight.testing.wan import TcpReceiver  # noqa: E402  (stdlib only: the bench's --help stays fast)


def simulate_disk(ck: Any, bytes_per_s: float) -> None:
    """Each completed write of ``ck``'s file I/O takes at least ``bytes / bytes_per_s`` more (a slower disk)."""
    real_wait = ck._fio.wait

    def wait(token: Any) -> None:
        real_wait(token)
        _, _, lengths, write, _ = token
        if write and lengths is not None:
            time.sleep(float(sum(lengths)) / bytes_per_s)

    ck._fio.wait = wait


def run(work: str, *, mib: int, unit_mib: float, write_mb_s: float, rtt_ms: float, mbit: float) -> dict[str, Any]:
    import torch

    from foresight.checkpoint import Checkpointer
    from foresight.replication.policy import Replication
    from foresight.testing.sites import SiteProcess
    from foresight.testing.wan import WanLink

    shutil.rmtree(work, ignore_errors=True)
    with SiteProcess("eval-b", os.path.join(work, "eval")) as ev, \
            WanLink(("127.0.0.1", ev.port), rtt_ms=rtt_ms, mbit=mbit) as link, \
            SiteProcess("train-a", os.path.join(work, "train"), routes={"eval-b": link.url}) as tr:
        state = {f"w{i}": torch.randn(1 << 18) for i in range(mib)}  # 1 MiB tensors
        rep = Replication(every=1, site="eval-b", node=tr.url, job="job", unit_bytes=int(unit_mib * (1 << 20)))
        with Checkpointer(os.path.join(work, "train", "job"), replicate=rep) as ck:
            ck.save(state, 1).wait()  # warm-up: connections, page cache, the site's torch import
            rep.wait(1, timeout=3600)
            simulate_disk(ck, write_mb_s * 1e6)
            t0 = time.time()
            ck.save(state, 2).wait()
            info = rep.wait(2, timeout=3600)
            log = ev.call("replicate.log", {"name": rep.name(2)})
        rep.close()
    return save_row(write_mb_s, mib, mbit, rtt_ms, t0, info, log["arrived"], log["arrived_pieces"])


def save_row(write_mb_s: float, mib: float, mbit: float, rtt_ms: float, t0: float, info: dict[str, Any],
             arrived: list[list[Any]], pieces: list[list[Any]]) -> dict[str, Any]:
    """One write speed's row: the save, what was left at its commit (not yet on the link: not received at the
    site by the commit + the one-way delay; beside it not yet received whole, not yet acknowledged), the physical
    floor of what is left (the link cannot send more than rate x save during the save) and the target it is judged
    by (floor + 10% of the save at the link rate)."""
    save_s, at_commit = info["committed_at"] - t0, info["committed_at"]
    link_MiB_s = mbit * 1e6 / 8 / (1 << 20)
    on_link = sum(n for at, n in pieces if at <= at_commit + rtt_ms / 2000)
    whole = sum(n for _, n, at in arrived if at <= at_commit)
    left = mib - on_link / (1 << 20)
    floor = max(0.0, mib - link_MiB_s * save_s)
    target = floor + 0.1 * save_s * link_MiB_s
    return {"write_MB_s": write_mb_s, "save_s": save_s, "MiB": mib, "transfer_s_at_link_rate": mib / link_MiB_s,
            "MiB_left_at_commit": left, "MiB_not_received_whole_at_commit": mib - whole / (1 << 20),
            "MiB_unacked_at_commit": info["bytes_left_at_commit"] / (1 << 20),
            "floor_MiB": floor, "MiB_over_floor": left - floor, "target_MiB_left": target, "met": left <= target,
            "commit_to_ready_s": info["ready_at"] - info["committed_at"],
            "save_start_to_ready_s": info["ready_at"] - t0}


class SyncingSink:
    """A TCP receiver: each connection's bytes go to a new file, synced, then one byte of acknowledgement."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self._rx = TcpReceiver(self._receive)
        self.port = self._rx.port

    def _receive(self, conn: socket.socket, n: int) -> None:
        buf = bytearray(1 << 20)
        fd = os.open(os.path.join(self.dir, f"copy-{n}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with conn:
                while k := conn.recv_into(buf):
                    os.write(fd, memoryview(buf)[:k])
                os.fdatasync(fd)
                conn.sendall(b"k")
        finally:
            os.close(fd)

    def close(self) -> None:
        self._rx.close()


def plain_copy(path: str, port: int, streams: int) -> float:
    """Seconds to copy ``path`` through ``port`` in ``streams`` parallel TCP streams (slices of the file), each
    until the receiver acknowledged its synced copy."""
    size = os.path.getsize(path)
    cuts = [size * i // streams for i in range(streams + 1)]

    def one(lo: int, hi: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
            s.sendfile(f, lo, hi - lo)
            s.shutdown(socket.SHUT_WR)
            if s.recv(1) != b"k":
                raise RuntimeError("plain copy: the receiver did not acknowledge")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(cuts[i], cuts[i + 1])) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def link_compare(work: str, *, mib: int, unit_mib: float, rtt_ms: float, mbit: float, background: int,
                 streams: int, repeats: int) -> dict[str, Any]:
    """Replication of a committed checkpoint vs 1 and ``streams`` plain TCP streams, on the same bed, alternating,
    ``repeats`` times each; medians."""
    import torch

    from foresight.checkpoint import Checkpointer
    from foresight.testing.sites import SiteProcess
    from foresight.testing.wan import WanLink

    shutil.rmtree(work, ignore_errors=True)
    unit = int(unit_mib * (1 << 20))
    sink = SyncingSink(os.path.join(work, "plain"))
    times: dict[str, list[float]] = {"plain_1": [], f"plain_{streams}": [], "foresight": []}
    try:
        with SiteProcess("eval-b", os.path.join(work, "eval"), unit_bytes=unit) as ev, \
                WanLink(("127.0.0.1", ev.port), rtt_ms=rtt_ms, mbit=mbit, background=background) as link, \
                WanLink(("127.0.0.1", sink.port), rtt_ms=rtt_ms, mbit=mbit, background=background) as plink, \
                SiteProcess("train-a", os.path.join(work, "train"), routes={"eval-b": link.url}, unit_bytes=unit,
                            streams=streams) as tr:
            with Checkpointer(os.path.join(work, "train", "job")) as ck:
                src = ck.save({f"w{i}": torch.randn(1 << 18) for i in range(mib)}, 1).wait().path
            data = os.path.join(src, "data-00000.bin")
            nbytes = os.path.getsize(data)
            tr.call("replicate.start", {"name": "job/warm", "src": src, "site": "eval-b", "unit_bytes": unit})
            tr.call("replicate.commit", {"name": "job/warm", "path": src})  # connections, the site's imports
            tr.call("replicate.wait", {"name": "job/warm", "timeout": 3600})
            plain_copy(data, plink.port, 1)
            for r in range(repeats):
                times["plain_1"].append(plain_copy(data, plink.port, 1))
                times[f"plain_{streams}"].append(plain_copy(data, plink.port, streams))
                name = f"job/copy-{r}"
                t0 = time.time()
                tr.call("replicate.start", {"name": name, "src": src, "site": "eval-b", "unit_bytes": unit})
                tr.call("replicate.commit", {"name": name, "path": src})
                info = tr.call("replicate.wait", {"name": name, "timeout": 3600})
                times["foresight"].append(info["ready_at"] - t0)
    finally:
        sink.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"background": background, "MiB": nbytes / (1 << 20), "streams": streams, "runs": times,
            **{f"{k}_s": v for k, v in med.items()}, **{f"{k}_MB_s": nbytes / v / 1e6 for k, v in med.items()},
            "vs_plain_1": med["plain_1"] / med["foresight"],
            f"vs_plain_{streams}": med[f"plain_{streams}"] / med["foresight"]}


def median_save(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The save with the median bytes left at the commit (a whole row: its save time and target go with it), with
    the range over all the saves of that write speed."""
    by_left = sorted(runs, key=lambda r: r["MiB_left_at_commit"])
    row = dict(by_left[(len(by_left) - 1) // 2])
    row["runs"] = len(runs)
    row["MiB_left_range"] = f"{by_left[0]['MiB_left_at_commit']:.3g}-{by_left[-1]['MiB_left_at_commit']:.3g}"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--unit-mib", type=float, default=8)
    ap.add_argument("--write-mb-s", default="50,100,400", help="simulated disk write speeds (MB/s); empty: skip")
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--mbit", type=float, default=1000.0)
    ap.add_argument("--background", default="0,1", help="background flows on the link for the link comparison "
                                                        "(one comparison each); empty: skip it")
    ap.add_argument("--streams", type=int, default=2, help="the sender's streams = the parallel plain streams")
    ap.add_argument("--repeats", type=int, default=3, help="saves per write speed and runs of each link method "
                                                          "(medians)")
    ap.add_argument("--dir", default="/var/tmp/foresight-bench-replication-overlap")
    a = ap.parse_args()
    if a.smoke:
        a.mib, a.unit_mib, a.write_mb_s, a.mbit, a.background, a.repeats = 16, 1, "10", 100.0, "0", 1
    rows, links = [], []
    try:
        for speed in (float(x) for x in a.write_mb_s.split(",") if x):
            runs = [run(a.dir, mib=a.mib, unit_mib=a.unit_mib, write_mb_s=speed, rtt_ms=a.rtt_ms, mbit=a.mbit)
                    for _ in range(a.repeats)]
            rows.append(median_save(runs))
        for bg in (int(x) for x in a.background.split(",") if x):
            links.append(link_compare(a.dir, mib=a.mib, unit_mib=a.unit_mib, rtt_ms=a.rtt_ms, mbit=a.mbit,
                                      background=bg, streams=a.streams, repeats=a.repeats))
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    title = f"{a.mib} MiB, {a.unit_mib:g} MiB units, link {a.rtt_ms:g} ms / {a.mbit:g} Mbit/s (WAN bed, one shared pipe)"
    if rows:
        print_table(rows, ["write_MB_s", "save_s", "transfer_s_at_link_rate", "MiB_left_at_commit",
                           "MiB_not_received_whole_at_commit", "MiB_unacked_at_commit", "floor_MiB", "MiB_over_floor", "target_MiB_left", "met",
                           "MiB_left_range", "commit_to_ready_s", "save_start_to_ready_s"],
                    f"send while saving (the median of {a.repeats} saves by MiB left): {title}")
    n = a.streams
    if links:
        print_table(links, ["background", "plain_1_s", f"plain_{n}_s", "foresight_s", "plain_1_MB_s",
                            f"plain_{n}_MB_s", "foresight_MB_s", "vs_plain_1", f"vs_plain_{n}"],
                    f"fill the link (committed checkpoint, medians of {a.repeats}): {title}")
    write_results("replication_overlap_smoke" if a.smoke else "replication_overlap",
                  {"machine": machine(), "smoke": a.smoke, "unit_mib": a.unit_mib, "rtt_ms": a.rtt_ms,
                   "mbit": a.mbit, "rows": rows, "link": links})
    return 0


if __name__ == "__main__":
    sys.exit(main())
