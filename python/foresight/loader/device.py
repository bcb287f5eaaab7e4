"""Device handoff: a collated step (numpy views of a pinned arena slot) into torch tensors on the loader's device.

CPU batches are tensors over the slot (no copy); CUDA batches are ``non_blocking`` copies out of the pinned slot,
whose slot goes back to the pipeline once a CUDA event recorded after the copies has completed. Token batches get
``input_ids``/``labels`` as int64 views of the rows, widened on the device.

Example::

    tensor = tensor_of(np.arange(4, dtype=np.uint16), "cuda:0")    # travels as int16, viewed back as uint16
    ids = widen_tokens(tensor)                                       # int64 token ids
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


_WIDE_UNSIGNED = (np.dtype(np.uint16), np.dtype(np.uint32))  # what tensor_of moves as the signed type


def tensor_of(array: np.ndarray, device: str | None):
    """A tensor over ``array`` (no copy), moved to ``device`` with a non-blocking copy when given.

    torch's uint16/uint32 have few kernels (on CUDA not all copies), so those travel as the signed type of the
    same width and are viewed back as unsigned where they land: the bytes are the same.
    """
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    signed = {np.dtype(np.uint16): (np.int16, torch.uint16), np.dtype(np.uint32): (np.int32, torch.uint32)}
    as_signed = signed.get(array.dtype)
    tensor = torch.from_numpy(array.view(as_signed[0]) if as_signed else array)
    if device is not None:
        tensor = tensor.to(device, non_blocking=True)
    return tensor.view(as_signed[1]) if as_signed else tensor


def widen_tokens(tokens):
    """int64 token ids from uint16/uint32/int64 tokens, on whatever device they are (signed view + mask)."""
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    masks = {torch.uint16: (torch.int16, 0xFFFF), torch.uint32: (torch.int32, 0xFFFFFFFF)}
    if tokens.dtype in masks:
        signed, mask = masks[tokens.dtype]
        return tokens.view(signed).to(torch.int64).bitwise_and_(mask)
    return tokens.to(torch.int64)


def slot_freed_by_event() -> None:
    """A CUDA batch's lease: its slot goes back once the copies' event completes (``_acquire_slot``)."""


class ConsumerLease:
    """A slot held by a batch the consumer has: counted, so that a consumer holding every slot gets an error
    instead of a pipeline waiting forever for one."""

    def __init__(self, loader: Any, release: Callable[[], None]) -> None:
        self.loader, self.release = loader, release
        loader._held += 1

    def __call__(self) -> None:
        self.loader._held -= 1
        if not self.loader._closed:  # a closed loader's arena is gone; its memory lives while views do
            self.release()


def to_device(fields: dict, device: str, *, tokens: bool) -> dict:
    """``fields`` with every array as a tensor on ``device`` (CPU: views, no copy; CUDA: ``non_blocking`` copies
    out of pinned memory), and for token batches ``input_ids``/``labels`` (int64 views of ``tokens``)."""
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    fields = dict(fields)
    on_cuda = device.startswith("cuda")
    for key, value in list(fields.items()):
        if isinstance(value, np.ndarray):  # on the CPU most arrays are tensor_of's plain from_numpy, one call
            plain = not on_cuda and value.dtype not in _WIDE_UNSIGNED
            value = torch.from_numpy(value) if plain else tensor_of(value, device if on_cuda else None)
        elif on_cuda and isinstance(value, torch.Tensor):
            value = value.to(device, non_blocking=True)
        elif on_cuda and isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            value = [t.to(device, non_blocking=True) for t in value]
        fields[key] = value
    if tokens:
        wide = widen_tokens(fields["tokens"])
        fields["input_ids"], fields["labels"] = wide[:, :-1], wide[:, 1:]
    return fields


def cuda_event() -> Any:
    """A CUDA event recorded now on the current stream: the slot's copies are done once it has completed."""
    import torch  # lazy: torch is an optional extra (foresight[torch]); CPU-only numpy use needs none

    event = torch.cuda.Event()
    event.record()
    return event


__all__ = ["ConsumerLease", "cuda_event", "slot_freed_by_event", "tensor_of", "to_device", "widen_tokens"]
