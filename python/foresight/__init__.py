"""foresight: a plan-driven data engine for large training jobs.

The public surface is small; each name is imported on first use so that ``import foresight`` stays cheap
(torch, PyAV and pyarrow load only when the layer that needs them does).

Example::

    import foresight

    ds = foresight.open_dataset("data/")
    plan = foresight.build_plan([(ds, 1.0)], seed=1, global_batch_size=64, seq_len=2048, num_steps=1000)
    with foresight.Loader(plan, datasets=ds, device="cuda") as loader:
        for batch in loader:
            ...

    # or keep a torch DataLoader loop (exact resume with torchdata's StatefulDataLoader):
    dl = torch.utils.data.DataLoader(foresight.ForesightIterableDataset("plan/"), batch_size=None, num_workers=2)
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "open_dataset": "foresight.bucket.opener",
    "DatasetWriter": "foresight.format",
    "Modality": "foresight.format",
    "build_plan": "foresight.plan",
    "load_plan": "foresight.plan",
    "Plan": "foresight.plan",
    "Loader": "foresight.loader",
    "MediaDecodeStage": "foresight.loader",
    "ForesightIterableDataset": "foresight.loader.torch_dataset",
    "IOEngine": "foresight.io",
    "Checkpointer": "foresight.checkpoint",
    "ForesightError": "foresight.errors",
}
_SUBMODULES = {"checkpoint", "media", "format", "plan", "io", "loader", "errors"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"foresight.{name}")
    else:
        raise AttributeError(f"module 'foresight' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS) + ["__version__"]
