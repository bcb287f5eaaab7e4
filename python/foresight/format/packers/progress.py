"""One progress bar per pack: a known total (so tqdm shows an ETA), and its final state written exactly once.

tqdm draws the bar on an ``update`` when ``mininterval`` has passed and again on ``close``; when the last update
lands after that interval the finished bar is printed twice (two identical 100% lines in a log). The last step is
therefore counted without drawing, and ``close`` draws the final state alone.

Example::

    with PackProgress(total=sum(sizes), desc="pack 3 files", enabled=True, unit="B") as bar:
        for size in sizes:
            bar.advance(size)
"""
from __future__ import annotations

from types import TracebackType

__all__ = ["PackProgress"]


class PackProgress:
    """A tqdm bar over ``total`` units (bytes: ``unit="B"``, shown in KiB/MiB/GiB)."""

    def __init__(self, total: int | None, desc: str, enabled: bool, unit: str = "B") -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B" else 1000,
                         disable=not enabled, dynamic_ncols=True)

    @property
    def count(self) -> int:
        """Units counted so far."""
        return int(self._bar.n)

    def advance(self, n: int) -> None:
        """Count ``n`` more units; the step that reaches the total is drawn by :meth:`close`, not here."""
        bar = self._bar
        if n <= 0 or bar.disable:
            return
        if bar.total is not None and bar.n + n >= bar.total:
            bar.n += n
        else:
            bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> PackProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
