"""Warnings attributed to the user's line: the first caller outside lazyckpt and the frameworks;
and the module ``__getattr__`` that keeps an old public name working with a DeprecationWarning."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

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


def deprecated_names(module: str, old: dict[str, tuple[Any, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``old`` names ({name: (value, what to use instead)}): each
    use warns with a DeprecationWarning naming the new spelling; any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        if name not in old:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value, instead = old[name]
        warnings.warn(f"{module}.{name} is deprecated; use {instead}", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
