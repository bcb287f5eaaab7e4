"""Replicate a sharded training checkpoint to an evaluation site while it is saved, then merge it to safetensors there.

Two sites on one machine, as real processes: etcd, a storage node per site (``foresight node serve --site``), and a
delaying link with a WAN round trip between them. Two gloo ranks train a small vision+text model sharded with
FSDP2 and save DCP checkpoints through ``ReplicatingStorageWriter``: a step the ``Replication`` schedule names
starts crossing to ``eval-b`` in large checksummed units once every rank's data file is written, and the replica
is published there only after ``.metadata`` commits. At the evaluation site, ``foresight ckpt merge`` resolves the
checkpoint's name through etcd to the local replica and writes one safetensors file per module group
(``vision.safetensors``, ``text.safetensors``), the sharded tensors concatenated; they equal the full state dict.

Run it::

    python examples/replicate_and_merge.py --out /tmp/replicate            # needs etcd (Debian: etcd-server)
    # real sites: `foresight node serve --root /ckpt --site train-a --etcd URL --route eval-b=grpc://...` on the
    # training side, `--site eval-b` on the evaluation side; then foresight ckpt merge NAME OUT --etcd URL --site eval-b

``--smoke`` is the small setting tests/test_examples.py runs.
"""
import argparse, json, os, shutil, subprocess, sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from foresight.replication.policy import Replication, ReplicatingStorageWriter
from foresight.testing.etcd import EtcdProcess
from foresight.testing.sites import SiteProcess
from foresight.testing.wan import WanLink
from foresight.distributed import run_then_end


class VisionText(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.vision = torch.nn.Sequential(torch.nn.Linear(3 * 16 * 16, width), torch.nn.GELU(),
                                          torch.nn.Linear(width, width))
        self.text = torch.nn.Embedding(1000, width)

    def forward(self, pixels, tokens):
        return (self.vision(pixels) * self.text(tokens)).sum(-1)


def train(rank: int, args, train_node: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{args.out}/rendezvous", rank=rank, world_size=2)
    run_then_end(train_and_save, rank, args, train_node)  # the FSDP model is freed before gloo is torn down


def train_and_save(rank: int, args, train_node: str) -> None:
    torch.manual_seed(0)
    model = VisionText(args.width)
    fully_shard(model.vision), fully_shard(model.text), fully_shard(model)  # each rank holds half of every tensor
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rep = Replication(every=args.eval_every, site="eval-b", node=train_node, job="vlm")
    g = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(8, 3 * 16 * 16, generator=g), torch.randint(0, 1000, (8,), generator=g)).pow(2).mean()
        opt.zero_grad(), loss.backward(), opt.step()
        if step % args.eval_every == 0:  # the checkpoint directory lies under the training node's root
            path = f"{args.out}/train-site/vlm/step-{step:08d}"
            writer = ReplicatingStorageWriter(path, replicate=rep, step=step)
            dcp.save(get_model_state_dict(model), storage_writer=writer)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the coordinator started the replications: wait for the last one to be ready at eval-b
        info = rep.wait(args.steps, timeout=300)
        print(f"replica of step {args.steps} ready at eval-b: {info['path']} ({info['bytes_sent']} bytes sent)")
        torch.save(full, f"{args.out}/reference.pt")  # what a non-distributed save would hold
    rep.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.eval_every, args.width, args.rtt_ms = 4, 2, 64, 20.0
    args.out = os.path.abspath(args.out)
    for old in ("etcd", "eval-site", "train-site", "merged"):  # an earlier run's
        shutil.rmtree(f"{args.out}/{old}", ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    if os.path.exists(f"{args.out}/rendezvous"):
        os.unlink(f"{args.out}/rendezvous")  # a stale rendezvous file would hang the ranks
    with EtcdProcess(f"{args.out}/etcd") as etcd, \
            SiteProcess("eval-b", f"{args.out}/eval-site", etcd=etcd.endpoint) as ev, \
            WanLink(("127.0.0.1", ev.port), rtt_ms=args.rtt_ms) as link, \
            SiteProcess("train-a", f"{args.out}/train-site", etcd=etcd.endpoint, routes={"eval-b": link.url}) as tr:
        mp.spawn(train, args=(args, tr.url), nprocs=2)
        name = f"vlm/step-{args.steps:08d}"  # at the evaluation site: by name, through etcd
        merged = subprocess.run([sys.executable, "-m", "foresight", "ckpt", "merge", name, f"{args.out}/merged",
                                 "--etcd", etcd.endpoint, "--site", "eval-b"], capture_output=True, text=True)
        if merged.returncode:
            raise SystemExit(merged.stderr)
    report = json.loads(merged.stdout.strip().splitlines()[-1])
    print(f"merged {name} from {report['source']}: {sorted(os.listdir(f'{args.out}/merged'))}")
    want = torch.load(f"{args.out}/reference.pt")
    got = {k: v for f in os.listdir(f"{args.out}/merged") if f.endswith(".safetensors")
           for k, v in load_file(f"{args.out}/merged/{f}").items()}
    same = bool(want) and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    print(f"the merged safetensors equal the full state dict: {same} ({len(want)} tensors compared)")
    return 0 if same and report["source"].startswith("eval-b") else 1


if __name__ == "__main__":
    raise SystemExit(main())
