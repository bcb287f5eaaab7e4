"""The plan-following loader: scheduler, arena slots, collate, stats, and the torch adapter.

Example::

    from foresight.loader import Loader
    with Loader(dataset, plan, prefetch=2) as loader:
        for batch in loader:
            ...
"""
from foresight.loader.batch import Batch
from foresight.loader.loader import DEFAULT_MAX_GAP, DEFAULT_MAX_TRANSFER, Loader
from foresight.loader.media_stage import MediaDecodeStage
from foresight.loader.stats import LoaderStats

__all__ = ["Batch", "Loader", "LoaderStats", "MediaDecodeStage", "DEFAULT_MAX_GAP", "DEFAULT_MAX_TRANSFER"]
