"""Flatten a nested state dict into (tensors, JSON skeleton) and back; encode a save's ``extra_state``.

The skeleton keeps the exact container structure (dicts with str/int keys, lists, tuples) and every
non-tensor leaf (the step counters, hyper-parameters and flags an optimizer state dict carries), with each
tensor replaced by its position in the flat tensor list. A tensor object that appears twice (tied weights)
is stored once and restored as one tensor.

Example::

    tensors, names, skeleton = flatten({"w": torch.ones(2), "opt": {"step": 3}})
    tree = unflatten(skeleton, tensors)
    structure_key(tree) == structure_key({"w": torch.zeros(2), "opt": {"step": 4}})  # True
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from foresight.checkpoint.layout import require_raw
from foresight.errors import CheckpointError

_SCALARS = (str, int, float, bool, type(None))


def flatten(state: Any) -> tuple[list[torch.Tensor], list[str], Any]:
    """Return the unique tensors, their dotted names, and a JSON-serialisable skeleton of ``state``."""
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    seen: dict[int, int] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            idx = seen.get(id(obj))
            if idx is None:
                if obj.is_sparse or obj.layout != torch.strided or obj.device.type == "meta":
                    raise CheckpointError("only dense strided tensors can be checkpointed", tensor=path)
                require_raw(obj.dtype, tensor=path)  # refused here, at save time, not when loading
                idx = seen[id(obj)] = len(tensors)
                tensors.append(obj)
                names.append(path)
            return {"t": idx}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not isinstance(k, _SCALARS):
                    raise CheckpointError("state dict keys must be str, int, float, bool or None",
                                          key=repr(k), at=path or "<root>")
                items.append([k, walk(v, f"{path}.{k}" if path else str(k))])
            return {"d": items}
        if isinstance(obj, (list, tuple)):
            tag = "l" if isinstance(obj, list) else "u"
            return {tag: [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]}
        if isinstance(obj, _SCALARS):
            if isinstance(obj, float) and not math.isfinite(obj):
                return {"f": repr(obj)}  # JSON has no inf/nan; keep them exactly
            return {"v": obj}
        raise CheckpointError("value is not checkpointable (tensors, dicts, lists, tuples and JSON scalars are)",
                              at=path or "<root>", type=type(obj).__name__)

    skeleton = walk(state, "")
    return tensors, names, skeleton


def unflatten(skeleton: Any, tensors: Sequence[Any]) -> Any:
    """Rebuild the nested structure described by ``skeleton`` using ``tensors`` for the tensor leaves."""
    if "t" in skeleton:
        return tensors[skeleton["t"]]
    if "d" in skeleton:
        return {k: unflatten(v, tensors) for k, v in skeleton["d"]}
    if "l" in skeleton:
        return [unflatten(v, tensors) for v in skeleton["l"]]
    if "u" in skeleton:
        return tuple(unflatten(v, tensors) for v in skeleton["u"])
    if "f" in skeleton:
        return float(skeleton["f"])
    return skeleton["v"]


def _fits(target: Any, shape: Sequence[int], dtype: torch.dtype) -> bool:
    return (isinstance(target, torch.Tensor) and tuple(target.shape) == tuple(shape) and target.dtype == dtype
            and not target.is_inference())


def match_targets(target: Any, skeleton: Any, shapes: Sequence[Sequence[int]],
                  dtypes: Sequence[torch.dtype]) -> dict[int, torch.Tensor]:
    """Map tensor index -> the tensor of ``target`` it will be restored into (same rules as restore_into)."""
    out: dict[int, torch.Tensor] = {}

    def walk(t: Any, sk: Any) -> None:
        if "t" in sk:
            i = sk["t"]
            if _fits(t, shapes[i], dtypes[i]) and i not in out:
                out[i] = t
        elif "d" in sk and isinstance(t, dict):
            for k, v in sk["d"]:
                walk(t.get(k), v)
        elif "l" in sk and isinstance(t, list) and len(t) == len(sk["l"]):
            for x, v in zip(t, sk["l"]):
                walk(x, v)
        elif "u" in sk and isinstance(t, tuple) and len(t) == len(sk["u"]):
            for x, v in zip(t, sk["u"]):
                walk(x, v)

    walk(target, skeleton)
    return out


def restore_into(target: Any, skeleton: Any, tensors: Sequence[torch.Tensor], *, clone_new: bool = False,
                 copied: dict[int, torch.Tensor] | None = None) -> Any:
    """Copy loaded tensors into ``target``'s tensors in place where shape and dtype match.

    Containers of ``target`` are updated in place (dict items, list items); a tensor whose shape, dtype or
    presence differs is replaced by the loaded one (cloned with ``clone_new``, when ``tensors`` live in a
    buffer that will be reused). Returns the restored object (``target`` itself when it
    is a mutable container).
    """
    if "t" in skeleton:
        src = tensors[skeleton["t"]]
        if _fits(target, src.shape, src.dtype):
            # ``copied``: tensors already filled while reading (pipelined restore; see match_targets)
            if copied is None or copied.get(skeleton["t"]) is not target:
                with torch.no_grad():
                    target.copy_(src)
            return target
        return src.clone() if clone_new else src
    if "d" in skeleton and isinstance(target, dict):
        for k, v in skeleton["d"]:
            target[k] = restore_into(target.get(k), v, tensors, clone_new=clone_new, copied=copied)
        return target
    if "l" in skeleton and isinstance(target, list) and len(target) == len(skeleton["l"]):
        for i, v in enumerate(skeleton["l"]):
            target[i] = restore_into(target[i], v, tensors, clone_new=clone_new, copied=copied)
        return target
    if "u" in skeleton and isinstance(target, tuple) and len(target) == len(skeleton["u"]):
        return tuple(restore_into(t, v, tensors, clone_new=clone_new, copied=copied) for t, v in zip(target, skeleton["u"]))
    new = unflatten(skeleton, tensors)
    return _clone_tree(new) if clone_new else new


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def structure_key(obj: Any) -> tuple:
    """A hashable summary of everything a staged copy of ``obj`` bakes in: containers and their keys, and
    for each tensor its kind, shape and dtype (a DTensor also its placements and local shape, a
    ShardedTensor its shards). Other leaves count only as "not a tensor": staging deep-copies them."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    def key(o: Any) -> Any:
        if isinstance(o, DTensor):
            return ("D", tuple(o.shape), o.dtype, tuple(o.placements), o.device_mesh, tuple(o.to_local().shape))
        if isinstance(o, ShardedTensor):
            shards = tuple((tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement))
                           for m in o.metadata().shards_metadata)
            return ("S", tuple(o.size()), o.dtype, shards, tuple(tuple(s.tensor.shape) for s in o.local_shards()))
        if isinstance(o, torch.Tensor):
            return ("T", tuple(o.shape), o.dtype)
        if isinstance(o, dict):
            return ("d", tuple((k, key(v)) for k, v in o.items()))
        if isinstance(o, (list, tuple)):
            return ("l" if isinstance(o, list) else "u", tuple(key(v) for v in o))
        return ("o",)

    return key(obj)


def encode_extra_state(extra_state: Any, step: int) -> dict[str, Any]:
    """Index fields for ``extra_state``: plain JSON as ``extra_state`` (what other tools read) and, when
    JSON alone would change it (int keys, tuples, nan), an exact encoding as ``extra_state_exact``."""
    try:
        tensors, names, tree = flatten(extra_state)
    except CheckpointError as e:
        if "key" in e.context:
            what = f"the key {e.context['key']}"
        elif "type" in e.context:
            what = f"a value of type {e.context['type']}"
        else:
            raise CheckpointError(f"extra_state is not JSON-serialisable: {e}", step=step) from None
        raise CheckpointError(f"extra_state is not JSON-serialisable: it holds {what} (dicts, lists, tuples and "
                              "str/int/float/bool/None can be saved exactly)", step=step,
                              at=e.context.get("at")) from None
    if tensors:
        raise CheckpointError("extra_state holds a tensor; put tensors in the state dict", step=step,
                              at=names[0] or "<root>")
    try:
        plain = json.loads(json.dumps(extra_state))  # a deep copy, and what JSON makes of it
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state is not JSON-serialisable: {e}", step=step) from e
    return {"extra_state": plain} if plain == extra_state else {"extra_state": plain, "extra_state_exact": tree}


def decode_extra_state(index: dict[str, Any]) -> Any:
    """The ``extra_state`` a checkpoint's index holds, exactly as it was saved."""
    tree = index.get("extra_state_exact")
    return index.get("extra_state") if tree is None else unflatten(tree, [])
