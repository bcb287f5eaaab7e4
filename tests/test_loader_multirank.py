"""Several ranks as real processes (gloo on CPU) over one plan read every sample of every step exactly once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from foresight.format import DatasetWriter, open_dataset
from foresight.plan import build_plan, load_plan
from process_diagnostics import kill_and_reap

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from foresight.format import open_dataset
    from foresight.distributed import end_process_groups
    from foresight.loader import Loader
    from foresight.plan import load_plan

    data, plan_dir, init, out = sys.argv[1:5]
    rank, world = int(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    seen = []
    with Loader(open_dataset(data), load_plan(plan_dir)) as loader:   # rank/world from torch.distributed
        assert (loader.rank, loader.world_size) == (rank, world)
        for batch in loader:
            ids = batch["sample_ids"].tolist()
            data_ = batch["data"].numpy()
            first = [int(data_[o]) for o in batch["offsets"].tolist()]
            seen.append({"step": batch.step, "ids": ids, "first": first})
    gathered = [None] * world
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        json.dump(gathered, open(out, "w"))
    end_process_groups()
    """
)


def test_ranks_cover_every_sample_of_every_step_once(tmp_path):
    n = 96
    with DatasetWriter(str(tmp_path / "data"), align=4096) as w:
        for i in range(n):
            w.add(bytes([i % 256]) * (100 + i), modality="bytes")
    ds = open_dataset(str(tmp_path / "data"))
    plan = build_plan([(ds, 1.0)], seed=11, global_batch_size=12, num_steps=16)
    plan.save(str(tmp_path / "plan"))
    plan = load_plan(str(tmp_path / "plan"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    world = 3
    init = f"file://{tmp_path / 'rendezvous'}"
    out = tmp_path / "seen.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "data"), str(tmp_path / "plan"), init,
                          str(out), str(r), str(world)], env=env)
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:  # a rank that hung (its peers then wait in the rendezvous) is killed, not left behind
        for rank, p in enumerate(procs):
            if p.poll() is None:
                kill_and_reap(p, f"rank {rank}")
    assert codes == [0] * world
    gathered = json.loads(out.read_text())
    for step in range(plan.num_steps):
        start, stop = plan.step_items(step)
        want = list(np.asarray(plan.pieces(start, stop).sample))
        got = []
        for rank in range(world):
            (entry,) = [e for e in gathered[rank] if e["step"] == step]
            got.extend(entry["ids"])
            assert entry["first"] == [i % 256 for i in entry["ids"]]  # the bytes are the sample's own
        assert got == want  # every sample of the step exactly once, in plan order across ranks
