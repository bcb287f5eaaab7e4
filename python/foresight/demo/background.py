"""Bed servers the demo starts on a thread while it works, so their start-up overlaps the earlier sections.

Each start is bounded by the bed's own ready timeout (SeaweedFS 60 s, a site 60 s), so ``get`` never hangs; a
start that failed is one line (``reason``) and its section is skipped. ``stop`` waits for a start still under
way and stops what it made, whatever happened in between (the servers are also tethered: they die with the demo).

Example::

    s3 = Starting("SeaweedFS", start_seaweed, lambda server: server.stop())
    ...
    server = s3.get()          # None when it could not start: s3.reason says why
    s3.stop()
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class Starting:
    """``start()`` run on a thread of its own; its result (or the error it raised, as one line) when asked."""

    def __init__(self, what: str, start: Callable[[], Any], stop: Callable[[Any], None]) -> None:
        self.what, self._start, self._stop = what, start, stop
        self.server: Any = None
        self.reason = ""
        self._thread = threading.Thread(target=self._run, name=f"demo-start-{what}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.server = self._start()
        except Exception as e:  # noqa: BLE001 - reported by get() as the section's one skip line
            self.reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]

    def get(self) -> Any:
        """The started server, or None (``reason`` holds why)."""
        self._thread.join()
        return self.server

    def stop(self) -> None:
        self._thread.join()
        server, self.server = self.server, None
        if server is not None:
            self._stop(server)
