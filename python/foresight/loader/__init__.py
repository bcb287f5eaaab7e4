"""The plan-following loader: scheduler, arena slots, collate, stats, and the torch adapter
(:class:`ForesightIterableDataset`, for an existing ``DataLoader`` loop).

Example::

    from foresight.loader import Loader
    with Loader(plan, datasets=dataset, prefetch=2) as loader:
        for batch in loader:
            ...
"""
from foresight.loader.batch import Batch
from foresight.loader.loader import DEFAULT_MAX_GAP, DEFAULT_MAX_TRANSFER, Loader
from foresight.loader.stats import LoaderStats
from foresight.source import MediaDecodeStage  # the Loader's decode= stage; it lives in the read path (source/)

__all__ = ["Batch", "ForesightIterableDataset", "Loader", "LoaderStats", "MediaDecodeStage", "DEFAULT_MAX_GAP",
           "DEFAULT_MAX_TRANSFER"]


def __getattr__(name: str):
    # The DataLoader adapter imports torch.utils.data: only when asked for.
    if name == "ForesightIterableDataset":
        from foresight.loader.torch_dataset import ForesightIterableDataset  # lazy: imports torch (optional extra)

        return ForesightIterableDataset
    raise AttributeError(f"module 'foresight.loader' has no attribute {name!r}")
