"""Warnings attributed to the user's line: the first caller outside lazyckpt and the frameworks."""

from __future__ import annotations

import inspect
from types import FrameType

# Frames of these packages are passed over: a warning names the user's line that led to lazyckpt.
_SKIPPED = frozenset(
    {"lazyckpt", "lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers", "torch"}
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for the caller's ``warnings.warn`` that names the first frame outside lazyckpt and
    the frameworks it plugs into (the outermost frame when there is none, e.g. on a lazyckpt thread)."""
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_back is not None and _package(frame) in _SKIPPED:
        frame = frame.f_back
        level += 1
    return level


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "").partition(".")[0]
