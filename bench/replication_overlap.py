"""Send while saving: how much of a replicated Checkpointer save is still to cross the WAN when the save commits.

Two sites as real processes (replication nodes, foresight's WAN bed between them: 100 ms, 1 Gbit/s shared by all
connections). The training site saves a checkpoint with ``Checkpointer(..., replicate=Replication(...))``; the
data file is written at a simulated disk speed (each completed write waits ``bytes / speed``: a page-cache write
on this machine is far faster than any real checkpoint disk, so the transfer would have nothing to overlap).
Reported per write speed: the save's duration (call -> commit), the bytes the evaluation site had not acknowledged
at the commit, and commit -> replica ready. The issue's target: bytes left at the commit <= what the link carries
in 10% of the save's duration, whenever the save lasts at least as long as the transfer.

    python bench/replication_overlap.py            # 256 MiB, 8 MiB units, write speeds 100 and 400 MB/s
    python bench/replication_overlap.py --smoke    # 16 MiB over a 100 Mbit/s link; what the smoke test runs
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine, print_table, write_results  # noqa: E402


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
        rep.close()
    save_s = info["committed_at"] - t0
    link_bytes_per_s = mbit * 1e6 / 8
    return {"write_MB_s": write_mb_s, "save_s": save_s, "MiB": mib,
            "transfer_s_at_link_rate": mib * (1 << 20) / link_bytes_per_s,
            "MiB_left_at_commit": info["bytes_left_at_commit"] / (1 << 20),
            "target_MiB_left": 0.1 * save_s * link_bytes_per_s / (1 << 20),
            "commit_to_ready_s": info["ready_at"] - info["committed_at"],
            "save_start_to_ready_s": info["ready_at"] - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--unit-mib", type=float, default=8)
    ap.add_argument("--write-mb-s", default="100,400", help="simulated disk write speeds (MB/s)")
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--mbit", type=float, default=1000.0)
    ap.add_argument("--dir", default="/var/tmp/foresight-bench-replication-overlap")
    a = ap.parse_args()
    if a.smoke:
        a.mib, a.unit_mib, a.write_mb_s, a.mbit = 16, 1, "10", 100.0
    rows = []
    try:
        for speed in (float(x) for x in a.write_mb_s.split(",")):
            rows.append(run(a.dir, mib=a.mib, unit_mib=a.unit_mib, write_mb_s=speed, rtt_ms=a.rtt_ms, mbit=a.mbit))
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    print_table(rows, ["write_MB_s", "save_s", "transfer_s_at_link_rate", "MiB_left_at_commit", "target_MiB_left",
                       "commit_to_ready_s", "save_start_to_ready_s"],
                f"send while saving: {a.mib} MiB, {a.unit_mib:g} MiB units, link {a.rtt_ms:g} ms / {a.mbit:g} Mbit/s "
                f"(WAN bed, one shared pipe)")
    write_results("replication_overlap_smoke" if a.smoke else "replication_overlap",
                  {"machine": machine(), "smoke": a.smoke, "unit_mib": a.unit_mib, "rtt_ms": a.rtt_ms,
                   "mbit": a.mbit, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
