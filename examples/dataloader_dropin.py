"""Drop foresight into an existing ``torch.utils.data.DataLoader`` loop, then resume it exactly.

The training loop below is left as it was; only the dataset handed to the ``DataLoader`` changes:

    was: DataLoader(MyTokenDataset(...), batch_size=8, shuffle=True, num_workers=2, collate_fn=pad_and_stack)
    now: DataLoader(ForesightIterableDataset("plan/"), batch_size=None, num_workers=2)

``ForesightIterableDataset`` yields whole, already collated batches of the plan's steps (hence
``batch_size=None``; the plan fixes order, batch size and packing), deals the steps to the workers and gets them
back in plan order, and opens the datasets the plan recorded. It is ``Stateful``: with torchdata's
``StatefulDataLoader`` (workers too) ``dl.state_dict()`` resumes exactly; without torchdata use
``num_workers=0`` and the dataset's own ``state_dict()``.

Run it::

    python examples/dataloader_dropin.py --out /tmp/dropin
    # your data: foresight pack corpus.jsonl data/ --column tokens
    #            foresight plan data/ --global-batch-size 8 --seq-len 128 --steps 1000 --seed 1 --out plan/
    python examples/dataloader_dropin.py --out /tmp/dropin --plan plan/

``--smoke`` is the small setting tests/test_examples.py runs.
"""
import argparse, json, os, sys

import numpy as np
import torch
from torch.utils.data import DataLoader

from foresight import ForesightIterableDataset, build_plan, open_dataset
from foresight.format import pack_jsonl

VOCAB = 256


def train(dataloader, model, opt, max_steps: int) -> list[torch.Tensor]:
    """The user's existing loop: unchanged whichever dataset feeds the DataLoader."""
    seen = []
    for i, batch in enumerate(dataloader):
        loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad(), loss.backward(), opt.step()
        seen.append(batch["input_ids"])
        if i + 1 == max_steps:
            break
    return seen


def make_plan(out: str, steps: int) -> str:
    rng = np.random.default_rng(0)
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/corpus.jsonl", "w") as f:  # documents that count upward
        for _ in range(300):
            f.write(json.dumps({"tokens": ((rng.integers(0, VOCAB) + np.arange(rng.integers(8, 100))) % VOCAB)
                                .tolist()}) + "\n")
    data = open_dataset(pack_jsonl(f"{out}/corpus.jsonl", f"{out}/data", column="tokens", overwrite=True,
                                   progress=False))
    plan = build_plan([(data, 1.0)], seed=1, global_batch_size=8, seq_len=32, num_steps=steps)
    plan.save(f"{out}/plan", overwrite=True)
    return f"{out}/plan"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plan", help="a plan directory (its datasets are found from it); default: make a small one")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    steps = 8 if args.smoke else args.steps
    plan = args.plan or make_plan(args.out, steps)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ds = ForesightIterableDataset(plan)  # rank and world size from torch.distributed when initialised
    half = steps // 2
    print(f"{len(ds)} steps in the plan: training {min(steps, len(ds))}, then again stopped after {half} and resumed")
    if len(ds) <= half:  # a resume check that compares nothing proves nothing
        print(f"error: the plan has {len(ds)} steps, so a resume after {half} of them leaves no step to compare; "
              f"pass --steps {len(ds)} or fewer (or a longer plan)", file=sys.stderr)
        return 2
    full = train(DataLoader(ds, batch_size=None, num_workers=args.workers), model, opt, steps)

    try:  # resume mid-epoch: stop after `half` batches, keep the state, continue in a fresh loader
        from torchdata.stateful_dataloader import StatefulDataLoader as Resumable
        workers = args.workers
    except ImportError:  # a plain DataLoader cannot report its workers' progress: resume without workers
        Resumable, workers = None, 0
    if Resumable is not None:
        first = Resumable(ForesightIterableDataset(plan), batch_size=None, num_workers=workers)
        head = train(first, model, opt, half)
        state = first.state_dict()  # saved beside the model in a real job
        second = Resumable(ForesightIterableDataset(plan), batch_size=None, num_workers=workers)
        second.load_state_dict(state)
    else:
        first_ds = ForesightIterableDataset(plan)
        head = train(DataLoader(first_ds, batch_size=None), model, opt, half)
        second_ds = ForesightIterableDataset(plan)
        second_ds.load_state_dict(first_ds.state_dict())
        second = DataLoader(second_ds, batch_size=None)
    tail = train(second, model, opt, len(full) - half)
    exact = len(head) == half and len(head + tail) == len(full) and \
        all(torch.equal(a, b) for a, b in zip(head + tail, full))
    print(f"resumed with {'StatefulDataLoader' if Resumable else 'DataLoader'} ({workers} workers) after "
          f"{half} batches; compared the {len(tail)} batches after the resume point (and the {len(head)} before) "
          f"with the uninterrupted run's: equal: {exact}")
    return 0 if exact and tail else 1


if __name__ == "__main__":
    raise SystemExit(main())
