"""The plan layer: a deterministic, memory-mappable sequence of items for every step and rank.

A plan fixes, before training starts, which samples (or which token slices of which documents)
make up every global batch. It is built once from a mixture of datasets and a seed, saved as a
directory of ``.npy`` arrays plus ``plan.json``, and opened by every rank with mmap.

Example::

    from foresight.format import open_dataset
    from foresight.plan import build_plan, load_plan

    ds = open_dataset("data/")
    plan = build_plan([(ds, 1.0)], seed=1234, global_batch_size=64, seq_len=2048, num_steps=1000)
    plan.save("plan/")
    plan = load_plan("plan/")
    start, stop = plan.rank_items(step=0, rank=0, world_size=8)
    pieces = plan.pieces(start, stop)
"""
from foresight.plan.builder import PlanSource, build_plan
from foresight.plan.compact import COMPACT_FORMAT_VERSION, CompactPlan
from foresight.plan.locations import open_plan_datasets
from foresight.plan.plan import ARRAY_DTYPES, FORMAT_VERSION, Pieces, Plan
from foresight.plan.sources import ArraySource
from foresight.plan.store import load_plan

__all__ = ["ARRAY_DTYPES", "COMPACT_FORMAT_VERSION", "FORMAT_VERSION", "ArraySource", "CompactPlan", "Pieces", "Plan", "PlanSource", "build_plan", "load_plan",
           "open_plan_datasets"]
