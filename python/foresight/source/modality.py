"""Which modality each sample of a step has, and which plan epoch it is read in: per-dataset lookups, batched.

The host's decode stage, the node's job and the node client all ask "which of these ``(dataset, sample)`` pairs
are video / image / ...": :func:`modality_codes` answers it for a whole step with one vectorized gather per
dataset of the mixture (never a Python step per sample), :func:`spec_codes` turns a stage's spec names into the
codes to compare with, and :func:`sample_epochs` gives each sample the epoch its random choices are keyed by.

Example::

    codes = modality_codes(datasets, fields["dataset"], fields["sample_ids"])   # int16, one per sample
    wanted = np.isin(codes, list(spec_codes(stage.specs).values()))             # samples the stage decodes
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from foresight.format import Modality


def modality_codes(datasets: Sequence, dataset: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """The :class:`~foresight.format.Modality` code (int16) of each ``(datasets[dataset[i]], samples[i])``.

    >>> from foresight.plan import ArraySource
    >>> modality_codes([ArraySource(np.array([5, 6]), tokens=False, modality=2)], np.array([0, 0]), np.array([1, 0]))
    array([2, 2], dtype=int16)
    """
    dataset, samples = np.asarray(dataset), np.asarray(samples, dtype=np.int64)
    codes = np.full(len(samples), -1, dtype=np.int16)
    for d in np.unique(dataset):  # a loop over the (few) datasets of a mixture, not over samples
        mask = dataset == d
        codes[mask] = np.asarray(datasets[int(d)].modality_codes())[samples[mask]]
    return codes


def dataset_modality_codes(dataset) -> np.ndarray:
    """The :class:`~foresight.format.Modality` code of every sample of one dataset (int16)."""
    return np.asarray(dataset.modality_codes(), dtype=np.int16)


def spec_codes(names: Iterable[str]) -> dict[str, int]:
    """``{modality name: code}`` for a decode stage's spec names (``"video"``, ``"image"``, ...).

    >>> spec_codes(["image"]) == {"image": int(Modality.parse("image"))}
    True
    """
    return {name: int(Modality.parse(name)) for name in names}


def sample_epochs(datasets: Sequence, dataset: np.ndarray, items: np.ndarray) -> np.ndarray:
    """How many times the plan had cycled through each sample's dataset at plan item ``items[i]`` (int64): the
    epoch that keys a sample's random choices, so host and node draw the same ones.

    >>> from foresight.plan import ArraySource
    >>> sample_epochs([ArraySource(np.array([5, 6]), tokens=False)], np.array([0, 0]), np.array([1, 4]))
    array([0, 2])
    """
    sizes = np.asarray([max(1, int(ds.num_samples)) for ds in datasets], dtype=np.int64)
    return np.asarray(items, dtype=np.int64) // sizes[np.asarray(dataset, dtype=np.int64)]


__all__ = ["modality_codes", "sample_epochs", "spec_codes"]
