"""A step's batch: tensors that view an arena slot, and the slot's lifetime.

One rule, on every device: a batch is valid until the consumer asks the loader for the next one (a new
``iter(loader)`` counts; with ``Loader(auto_release=False)``: until ``batch.release()``). Then its slot goes
back to the loader and is read into again, so host tensors that view it (``tokens``, ``data``) would silently
show another step's bytes: every accessor of a released batch raises :class:`~foresight.errors.StaleBatchError`
instead. ``batch.clone()`` is a copy that owns its memory and never goes stale. A tensor taken out of a batch
follows the batch's rule too (nothing can check it once it is taken: clone it, or the batch, to keep it).

Example::

    for batch in loader:            # the previous batch's slot is recycled when the next one is asked for
        model(batch["input_ids"], labels=batch["labels"])
        kept = batch.clone()        # to keep a batch beyond its step
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np

from foresight.errors import StaleBatchError


class Batch(Mapping):
    """Read-only mapping of tensors/arrays for one step on one rank.

    ``step`` is the global step, ``sample_ids`` the (dataset, sample) pairs behind it. A batch built with a
    ``release`` callable is leased: after :meth:`release` (the loader calls it when the consumer asks for the
    next batch, unless ``Loader(auto_release=False)``) it is stale and every accessor raises
    :class:`StaleBatchError`. A batch without one (e.g. from :meth:`clone`) owns its data.
    """

    def __init__(self, step: int, data: dict[str, Any], release: Callable[[], None] | None = None) -> None:
        self.step = step
        self._data = data
        self._release = release
        self._released = False

    def _fields(self) -> dict[str, Any]:
        if self._released:
            raise StaleBatchError(
                f"batch of step {self.step} was used after its arena slot went back to the loader (the next "
                f"batch was asked for, or release() was called); clone() the batch, or a tensor, to keep it"
            )
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._fields()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields())

    def __len__(self) -> int:
        return len(self._fields())

    @property
    def released(self) -> bool:
        """True once the batch is stale (its slot went back to the loader)."""
        return self._released

    def release(self) -> None:
        """Hand the batch's arena slot back; the batch is stale afterwards. Once only; an owned batch ignores it."""
        release, self._release = self._release, None
        if release is not None:
            self._released = True
            release()

    def clone(self) -> "Batch":
        """A copy of every tensor and array, owned by the new batch (it never goes stale)."""
        return Batch(self.step, {k: _clone(v) for k, v in self._fields().items()})

    def __repr__(self) -> str:
        if self._released:
            return f"Batch(step={self.step}, released)"
        parts = []
        for k, v in self._data.items():
            shape = getattr(v, "shape", None)
            parts.append(f"{k}={tuple(shape)}" if shape is not None else f"{k}=<{type(v).__name__}>")
        return f"Batch(step={self.step}, {', '.join(parts)})"


def _clone(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    clone = getattr(value, "clone", None)  # torch tensors, without importing torch here
    return clone() if callable(clone) else value


__all__ = ["Batch"]
