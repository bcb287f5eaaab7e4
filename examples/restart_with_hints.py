"""A synchronized restart that tells storage first: replication hints spread the hot checkpoint files.

etcd and four storage nodes (``foresight node serve --etcd``) run as processes. A job saves a DCP checkpoint, whose
files sit on two of the nodes (its base copies, published to the cluster). Before restarting ``--ranks`` ranks,
the job calls ``set_replication_hints``: the checkpoint layer derives from ``.metadata`` and the world size which
files every rank will read (the metadata, the replicated tensors), the nodes plan ``ceil(readers / safe readers)``
copies per file (capped by nodes and the job's quota) and copy them node to node under the hint's TTL. The
simulated ranks then read through ``ReplicaReader`` (least loaded copy, every read verified by xxh3): the reads
spread over all four nodes instead of two. Rank 0 restores the model from the bytes it read, equal to the save.

Run it::

    python examples/restart_with_hints.py --out /tmp/hints --ranks 512        # needs etcd (Debian: etcd-server)

``--smoke`` is the small setting tests/test_examples.py runs. bench/restart_storm.py measures the storm's time.
"""
import argparse, concurrent.futures as cf, json, os, shutil, subprocess, sys, time

import torch
import torch.distributed.checkpoint as dcp

from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter
from foresight.replication.hint_client import (ReplicaReader, publish_checkpoint, release_replication_hints,
                                              set_replication_hints, wait_for_replicas)
from foresight.testing.etcd import EtcdProcess

JOB, TOKEN, NAME = "lm", "example-hints-token", "lm/step-00000100"


def start_node(out: str, name: str, etcd: str) -> tuple[subprocess.Popen, str, str]:
    root, ready = f"{out}/{name}", f"{out}/{name}.ready.json"
    os.makedirs(root, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "foresight", "node", "serve", "--root", root, "--etcd", etcd,
                             "--node-id", name, "--ready-file", ready, "--safe-readers", "16",
                             "--replica-quota", "64M:16"], stderr=open(f"{out}/{name}.log", "w"))
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise SystemExit(f"node {name} exited with {proc.returncode}: see {out}/{name}.log")
        time.sleep(0.1)
    return proc, json.load(open(ready))["location"], root


def restart_storm(etcd: str, ranks: int, files: list[str]) -> tuple[dict, dict]:
    """Every rank reads the metadata and the replicated tensors' file at once; returns rank 0's bytes, reads/node."""
    with ReplicaReader(etcd, job=JOB, token=TOKEN) as reader, cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda rank: {f: reader.read(NAME, f) for f in files}, range(ranks)))
        return got[0], dict(sorted(reader.stats["by_node"].items()))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ranks", type=int, default=512)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    ranks = 64 if args.smoke else args.ranks
    out = os.path.abspath(args.out)
    for old in ("ckpt", "etcd", "rank0", "n0", "n1", "n2", "n3"):  # an earlier run's
        shutil.rmtree(f"{out}/{old}", ignore_errors=True)
        if os.path.exists(f"{out}/{old}.ready.json"):
            os.unlink(f"{out}/{old}.ready.json")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 64), torch.nn.Linear(64, 4096))
    dcp.save(model.state_dict(), storage_writer=ForesightStorageWriter(f"{out}/ckpt"), no_dist=True)  # all read them
    files = sorted(os.listdir(f"{out}/ckpt"))

    with EtcdProcess(f"{out}/etcd") as etcd:
        nodes = [start_node(out, f"n{i}", etcd.endpoint) for i in range(4)]
        try:
            for _, location, root in nodes[:2]:  # the base copies, as the checkpoint layer placed them
                shutil.copytree(f"{out}/ckpt", f"{root}/{NAME}")
                publish_checkpoint(location, NAME, job=JOB, token=TOKEN)
            _, before = restart_storm(etcd.endpoint, ranks, files)
            print(f"restart without hints, {ranks} ranks: reads per node {before}")

            plan = set_replication_hints(NAME, etcd=etcd.endpoint, job=JOB, token=TOKEN, ttl_s=600,
                                         checkpoint_dir=f"{out}/ckpt", world_size=ranks)
            for f in plan["files"]:
                print(f"  hint {f['path']}: {f['readers']} readers -> {f['replicas']} copies "
                      f"(wanted {f['wanted']}, capped by {f['capped_by']}), new on {f['new_nodes']}")
            placed = wait_for_replicas(NAME, etcd=etcd.endpoint, job=JOB, token=TOKEN, timeout=120)
            print(f"copies made: {placed['done']}, {placed['copied_bytes']} bytes, failed {placed['failed']}")

            rank0, after = restart_storm(etcd.endpoint, ranks, files)
            print(f"restart with hints,    {ranks} ranks: reads per node {after}")
            release_replication_hints(NAME, etcd=etcd.endpoint, job=JOB, token=TOKEN)  # the restart is over
        finally:
            for proc, _, _ in nodes:
                proc.terminate(), proc.wait(60)

    os.makedirs(f"{out}/rank0", exist_ok=True)  # rank 0 restores from the bytes it read (verified on the way)
    for f, data in rank0.items():
        open(f"{out}/rank0/{f}", "wb").write(data)
    restored = torch.nn.Sequential(torch.nn.Embedding(4096, 64), torch.nn.Linear(64, 4096))
    state = restored.state_dict()
    dcp.load(state, storage_reader=ForesightStorageReader(f"{out}/rank0"), no_dist=True)
    same = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    print(f"reads spread over {len(after)} nodes (without hints: {len(before)}); rank 0 restored the model: {same}")
    return 0 if same and len(after) > len(before) else 1


if __name__ == "__main__":
    raise SystemExit(main())
