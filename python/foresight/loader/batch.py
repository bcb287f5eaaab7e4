"""A step's batch: tensors that view an arena slot, and the slot's lifetime.

Example::

    for batch in loader:            # the previous batch's slot is recycled when the next one is asked for
        model(batch["input_ids"], labels=batch["labels"])
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping


class Batch(Mapping):
    """Read-only mapping of tensors/arrays for one step on one rank.

    ``step`` is the global step, ``sample_ids`` the (dataset, sample) pairs behind it. The host tensors view
    pinned arena memory: they stay valid until :meth:`release` (the loader calls it when the consumer asks
    for the next batch, unless ``Loader(auto_release=False)``).
    """

    def __init__(self, step: int, data: dict[str, Any], release: Callable[[], None] | None = None) -> None:
        self.step = step
        self._data = data
        self._release = release

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def released(self) -> bool:
        return self._release is None

    def release(self) -> None:
        """Hand the batch's arena slot back; its host views must not be used afterwards."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __repr__(self) -> str:
        parts = []
        for k, v in self._data.items():
            shape = getattr(v, "shape", None)
            parts.append(f"{k}={tuple(shape)}" if shape is not None else f"{k}=<{type(v).__name__}>")
        return f"Batch(step={self.step}, {', '.join(parts)})"


__all__ = ["Batch"]
