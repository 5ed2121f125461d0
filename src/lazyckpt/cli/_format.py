"""Small formatting helpers shared by the commands: sizes, durations, tables, JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

GB = 1e9


def human_bytes(n: float | None) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as disks and bandwidths are quoted)."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover - unreachable


def fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    """A number with fixed decimals, or ``n/a``."""
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO | None = None) -> None:
    """Print a plain-text table: first column left-aligned, the others right-aligned."""
    out = out or sys.stdout
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        print("  ".join(parts).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)


def dump_json(doc: Any, out: TextIO | None = None) -> None:
    """Write ``doc`` as indented JSON (unknown objects as strings) followed by a newline."""
    out = out or sys.stdout
    json.dump(doc, out, indent=2, default=str)
    out.write("\n")
