"""Warnings attributed to the user's line: the first caller outside lazyckpt and the frameworks."""

from __future__ import annotations

import inspect
from types import FrameType

# Frames of these packages are passed over: a warning names the line of the user's code that led
# to lazyckpt (``ckpt.save(...)``, ``trainer.fit(...)``, ``accelerator.save_state(...)``).
_SKIPPED = frozenset(
    {"lazyckpt", "lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers", "torch"}
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the function calling this one,
    name the first frame outside lazyckpt and the frameworks it plugs into: right whatever path
    led there, where a fixed number is right for one path only. On a lazyckpt thread, or when
    every frame is a framework's, the outermost frame."""
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_back is not None and _package(frame) in _SKIPPED:
        frame = frame.f_back
        level += 1
    return level


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "").partition(".")[0]
