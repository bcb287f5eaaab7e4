"""Export a committed foresight checkpoint to one safetensors file (for tools that read safetensors).

Tensors are named by their dotted path in the state dict (``model.layers.0.w``); the step and the
``extra_state`` travel in the safetensors metadata as JSON strings. Non-tensor leaves of the state dict
(optimizer hyper-parameters) have no place in safetensors and are carried as JSON in ``foresight.skeleton``.

Example::

    export_safetensors("/ckpt/step-00000100", "/export/model.safetensors")
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save, save_file

from foresight.checkpoint.loading import LoadedCheckpoint
from foresight.checkpoint.reader import read_checkpoint
from foresight.errors import CheckpointError


def export_safetensors(checkpoint: str | os.PathLike | LoadedCheckpoint, path: str | os.PathLike, *,
                       verify: bool = True) -> str:
    """Write the checkpoint directory (or a :class:`LoadedCheckpoint`'s directory) to ``path``; return it."""
    src = checkpoint.path if isinstance(checkpoint, LoadedCheckpoint) else os.fspath(checkpoint)
    tensors, index = read_checkpoint(src, verify=verify)
    names = index["tensors"]["name"]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:3]
        raise CheckpointError("tensor names collide; cannot export to safetensors", path=src, names=dup)
    _require_safetensors_dtypes(names, tensors, src)
    # safetensors refuses tensors that share storage: give each its own (they are views of one buffer)
    out = {name: t.clone() for name, t in zip(names, tensors)}
    metadata = {
        "format": "pt",
        "foresight.step": str(index["step"]),
        "foresight.extra_state": json.dumps(index.get("extra_state")),
        "foresight.skeleton": json.dumps(index["skeleton"], separators=(",", ":")),
    }
    dst = os.fspath(path)
    save_file(out, dst, metadata=metadata)
    return dst


def _require_safetensors_dtypes(names: list[str], tensors: list[torch.Tensor], path: str) -> None:
    """Refuse, naming a tensor, dtypes safetensors has no code for (it would raise a bare KeyError)."""
    first_of = {}
    for name, t in zip(names, tensors):
        first_of.setdefault(t.dtype, name)
    for dtype, name in first_of.items():
        try:
            save({"probe": torch.empty(0, dtype=dtype)})
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"safetensors cannot store {dtype} tensors; convert them before exporting "
                                  f"(e.g. torch.view_as_real for complex)", path=path, tensor=name) from e
