"""A dependency-free progress bar on stderr: redrawn in place on a terminal, one line per phase otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``update(done, label)``; ``close()`` ends the line. Silent when ``enabled`` is False."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 30) -> None:
        self.total, self.width, self.enabled = max(1, total), width, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._last_label = ""

    def update(self, done: int, label: str) -> None:
        if not self.enabled:
            return
        frac = min(1.0, done / self.total)
        if self.tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            line = f"\r[{bar}] {frac:4.0%} {self._elapsed()} {label}"
            self.stream.write(line[:120].ljust(min(120, len(line))) + "\x1b[K")
            self.stream.flush()
        elif label != self._last_label or frac >= 1.0:
            self.stream.write(f"[{frac:4.0%}] {self._elapsed()} {label}\n")
            self.stream.flush()
        self._last_label = label

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _elapsed(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60}:{s % 60:02d}"
