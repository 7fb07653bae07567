"""A one-line progress display for long work (capture, solving), on stderr, off when not a terminal."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool = True, what: str = "working"):
        self.enabled = enabled and sys.stderr.isatty()
        self.what = what
        self._status = None
        self.t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console

            self._status = Console(stderr=True).status(self.what)
            self._status.__enter__()
        return self

    def update(self, message: str) -> None:
        if self._status is not None:
            self._status.update(f"{self.what} [{time.perf_counter() - self.t0:5.1f}s] {message}")

    def __exit__(self, *exc) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)
