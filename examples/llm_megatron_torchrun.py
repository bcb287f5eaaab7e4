"""An LLM trained on a Megatron-LM dataset read in place, 2 ranks under torchrun, killed and resumed exactly.

Each rank reads its share of every step from the ``.bin``/``.idx`` pair with foresight's ``Loader`` (no
conversion), trains a small DDP model, and saves model + optimizer + the loader's plan position every
``--save-every`` steps with ``dcp.async_save`` through ``ForesightStorageWriter`` (on a gloo group of its own,
so the background save never shares a process group with DDP's all-reduces). ``--kill-at-step N`` SIGKILLs rank 1
mid-run, once every rank has finished step N-1 (a save may be in flight), and torchrun ends the job; run the same
command again (as a scheduler requeues a job) and both ranks resume from the newest *complete* checkpoint
(``.metadata`` is written last), repeating the interrupted steps: each rank compares every repeated step's batch and
loss with the killed run's (``log.jsonl``), prints how many it compared, and exits non-zero if one differs or none
was left to compare.

Run it (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 examples/llm_megatron_torchrun.py --out /tmp/llm --kill-at-step 21
    torchrun --standalone --nproc-per-node 2 examples/llm_megatron_torchrun.py --out /tmp/llm    # resumes

On GPUs: ``--device cuda`` (NCCL for DDP). With your own data: ``--data /path/to/prefix`` (a Megatron
``prefix.bin``/``prefix.idx``, e.g. from Megatron-LM's ``preprocess_data.py``) and ``--vocab`` its size.
``--smoke`` is the small setting tests/test_examples.py runs; ``log.jsonl`` records every step's loss and batch.
"""
import argparse, hashlib, json, os, signal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from foresight.checkpoint import ForesightStorageReader, ForesightStorageWriter
from foresight.distributed import end_process_groups
from foresight.format import open_dataset, write_megatron_dataset
from foresight.loader import Loader
from foresight.plan import build_plan, load_plan


class TinyLM(torch.nn.Module):  # a causal transformer; bring your own (Megatron-Core's GPTModel, ...)
    def __init__(self, vocab: int, width: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(seq_len, width)
        block = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.blocks(self.embed(ids) + self.pos.weight[: ids.shape[1]], mask=mask, is_causal=True))


p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--data", help="Megatron prefix; default: write a small synthetic one under --out")
p.add_argument("--vocab", type=int, default=512)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--global-batch-size", type=int, default=8)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--kill-at-step", type=int, default=-1)
p.add_argument("--device", default="cpu")
p.add_argument("--smoke", action="store_true", help="tiny model and run (CI)")
args = p.parse_args()
if args.smoke:
    args.steps = 12
torch.manual_seed(0), torch.set_num_threads(1)
cuda = args.device == "cuda"
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu"
if cuda:
    torch.cuda.set_device(device)  # NCCL: one GPU per rank
ckpt_group = dist.new_group(backend="gloo")  # async saves talk here, never on DDP's group

prefix, plan_dir, ckpt_root = args.data or f"{args.out}/megatron/corpus", f"{args.out}/plan", f"{args.out}/ckpt"
if rank == 0 and not os.path.exists(plan_dir):
    if args.data is None:  # documents that count upward: a pattern the model can learn
        rng = np.random.default_rng(0)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        write_megatron_dataset(prefix, [(rng.integers(0, args.vocab) + np.arange(rng.integers(8, 200))) % args.vocab
                                        for _ in range(600)], np.uint16)
    build_plan([(open_dataset(prefix), 1.0)], seed=1, global_batch_size=args.global_batch_size,
               seq_len=args.seq_len, num_steps=args.steps).save(plan_dir)
dist.barrier()
data, plan = open_dataset(prefix), load_plan(plan_dir)

model = TinyLM(args.vocab, 32 if args.smoke else 256, 1 if args.smoke else 4, args.seq_len).to(device)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = Loader(plan, datasets=data, device=device)  # rank and world size from torch.distributed

committed = sorted(d for d in os.listdir(ckpt_root) if os.path.exists(f"{ckpt_root}/{d}/.metadata")) \
    if os.path.isdir(ckpt_root) else []
if committed:  # resume: a save cut by the kill has no .metadata and is skipped
    model_state, optim_state = get_state_dict(ddp, opt)  # optimizer state made up front, so DCP can fill it
    state = {"model": model_state, "optim": optim_state, "loader": loader.state_dict()}
    dcp.load(state, storage_reader=ForesightStorageReader(f"{ckpt_root}/{committed[-1]}"), process_group=ckpt_group)
    set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loader.load_state_dict(state["loader"])
    print(f"rank {rank}: resumed from {committed[-1]} at step {state['loader']['next_step']}", flush=True)
# The killed run's steps of this rank (the last entry of each): the resumed run must repeat them exactly.
earlier = {}
if committed and os.path.exists(f"{args.out}/log.jsonl"):
    with open(f"{args.out}/log.jsonl") as f:
        earlier = {e["step"]: e for e in map(json.loads, f) if e["rank"] == rank}
compared, differ = 0, []

writer, pending = ForesightStorageWriter(ckpt_root), None  # one writer: its staging copy is reused
with loader, open(f"{args.out}/log.jsonl", "a") as log:
    for batch in loader:
        if batch.step == args.kill_at_step:
            # Every rank has finished and logged the steps before this one: torchrun ends the other ranks as soon
            # as rank 1 dies, and a rank that lagged (a loaded host) would lose the steps it had trained but not
            # logged yet, leaving it nothing to compare after a resume from a checkpoint taken after them.
            dist.barrier()
        if batch.step == args.kill_at_step and rank == 1:
            print(f"rank 1: SIGKILL at step {batch.step} as asked by --kill-at-step: an intended crash (a save may "
                  f"be in flight); torchrun now reports the job failed. Run the same command without --kill-at-step "
                  f"to resume", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, mid-run, perhaps during a save
        logits = ddp(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        digest = hashlib.sha256(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        entry = {"rank": rank, "step": batch.step, "loss": loss.item(), "batch": digest}
        if batch.step in earlier:  # run before the kill, after the checkpoint: same batch, bit-identical loss
            compared += 1
            if earlier[batch.step] != entry:
                differ.append(batch.step)
        log.write(json.dumps(entry) + "\n")
        log.flush()
        if (batch.step + 1) % args.save_every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time
            model_state, optim_state = get_state_dict(ddp, opt)
            state = {"model": model_state, "optim": optim_state, "loader": loader.state_dict()}
            pending = dcp.async_save(state, storage_writer=writer, process_group=ckpt_group,
                                     checkpoint_id=f"{ckpt_root}/step-{batch.step + 1:06d}")
    if pending is not None:
        pending.result()
print(f"rank {rank}: done, {loader.stats.steps} steps read, backend {loader.stats.backend}", flush=True)
ok = True
if committed:
    ok = compared > 0 and not differ
    verdict = (f"steps {differ} differ" if differ else "equal" if compared else
               "nothing was repeated, so nothing was checked (the kill came right after a complete checkpoint, or "
               "the run had finished)")
    print(f"rank {rank}: compared the {compared} steps repeated after the resume with the killed run's batches and "
          f"losses: {verdict}", flush=True)
# Teardown with nothing in flight on either group, and with the modules, optimizer and checkpoint state that hold the
# gloo groups freed first, so the groups end in a live interpreter (foresight.distributed says why a group left to
# interpreter exit can abort the process after all its work succeeded).
dist.barrier(group=ckpt_group)
del ddp, model, opt, writer, pending, loader, ckpt_group
state = model_state = optim_state = None
end_process_groups()
raise SystemExit(0 if ok else 1)
