"""Decoded samples into tensors: a part of a step through a decode stage, and the stacking of its outputs.

A decode stage is any callable ``(fields, *, stats, first_item) -> fields`` (:class:`StepDecoder`; the usual one is
:class:`~foresight.source.MediaDecodeStage`). :func:`decode_part` runs one on a subset of a step (the samples a
node serves, the ones a host must decode itself) and gives its output back at the samples' step positions;
:func:`stack_samples` is the one rule for a modality's tensors: one (pinned, when CUDA is present) tensor when every
sample has the same shape, else a list.

Example::

    blocks = decode_part(stage, part, step=3, dataset=d, samples=s, positions=p, first_item=start)
    for modality, step_positions, tensors in blocks:
        ...
    batch = stack_samples([t0, t1])            # (2, *t0.shape), pinned when CUDA is present
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol

import numpy as np

from foresight.source.reads import PartBytes


class StepDecoder(Protocol):
    """What the loader, the node's job and the node client call to decode: fields of a step (``data``,
    ``offsets``, ``lengths``, ``dataset``, ``sample_ids``, optionally ``items``) in, the same fields plus
    ``<modality>`` tensors and ``<modality>_index`` positions out. ``specs`` names the modalities it decodes."""

    specs: dict

    def __call__(self, fields: dict, *, stats: Any = None, first_item: int = 0) -> dict: ...


def pin_by_default() -> bool:
    """Pin stacked batches when CUDA is present (their copy to the GPU can then run asynchronously)."""
    import torch  # lazy: torch is an optional extra (foresight[torch]); only decode outputs need it

    return bool(torch.cuda.is_available())


def stack_samples(tensors: list, *, pin: bool | None = None):
    """One tensor when every sample has the same shape (written straight into pinned memory), else a list.

    ``pin=None`` pins when CUDA is present. Numpy arrays are taken as tensors without a copy first.

    >>> stack_samples([np.zeros((2, 3), np.uint8), np.ones((2, 3), np.uint8)]).shape
    torch.Size([2, 2, 3])
    """
    import torch  # lazy: torch is an optional extra (foresight[torch]); only decode outputs need it

    tensors = [t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t)) for t in tensors]
    if len({tuple(t.shape) for t in tensors}) != 1:
        return tensors
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=tensors[0].dtype,
                      pin_memory=pin_by_default() if pin is None else pin)
    torch.stack(tensors, out=out)
    return out


def decode_part(stage: StepDecoder, part: PartBytes, *, step: int, dataset: np.ndarray, samples: np.ndarray,
                positions: np.ndarray, first_item: int, stats: Any = None,
                modalities: Iterable[str] | None = None) -> list[tuple[str, np.ndarray, Any]]:
    """Decode the samples at step ``positions`` (sample ``i``'s bytes are ``part.sample(i)``) with ``stage``.

    Returns ``(modality, step positions, tensor or list)`` blocks, one per modality of ``modalities`` (default:
    ``stage.specs``; pass them for a stage that does not say) the stage produced, in that order; each
    sample's plan item is ``first_item + position`` (its epoch key), so the tensors are those a decode of the whole
    step gives for these samples.
    """
    positions = np.asarray(positions, dtype=np.int64)
    fields = {"step": step, "data": part.region, "offsets": part.offsets, "lengths": part.lengths,
              "dataset": dataset, "sample_ids": samples, "items": first_item + positions}
    out = stage(fields, stats=stats, first_item=first_item)
    return [(name, positions[np.asarray(out[f"{name}_index"], dtype=np.int64)], out[name])
            for name in (stage.specs if modalities is None else modalities) if name in out]


__all__ = ["StepDecoder", "decode_part", "pin_by_default", "stack_samples"]
