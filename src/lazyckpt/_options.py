"""The options of a :class:`~lazyckpt.LazyCheckpointer`, as one value the integrations pass through."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Backpressure = Literal["block", "skip"]


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every ``LazyCheckpointer`` constructor option with its default (see ``LazyCheckpointer`` for
    what each one means). Validated on construction with the errors the constructor raises:
    ``ValueError`` for a bad ``on_backpressure``, ``writer_threads < 1`` or a budget below 1.

    ``dataclasses.replace(options, fsync=False)`` derives a variant.
    """

    host_memory_budget: int | None = None
    writer_threads: int = 4
    fsync: bool = True
    on_backpressure: Backpressure = "block"
    crc: bool = True
    wait_in_closure: bool = True
    chunk_bytes: int = 64 << 20
    pin_memory: bool | None = None
    direct_io: bool | None = None
    zero_copy: bool = True
    capture_in_save: bool = False

    def __post_init__(self) -> None:
        if self.on_backpressure not in ("block", "skip"):
            raise ValueError(f"on_backpressure must be 'block' or 'skip', got {self.on_backpressure!r}")
        if self.writer_threads < 1:
            raise ValueError("writer_threads must be >= 1")
        if self.host_memory_budget is not None and int(self.host_memory_budget) < 1:
            raise ValueError("host_memory_budget must be positive")


def merge(options: CheckpointerOptions | None, kwargs: dict[str, Any]) -> CheckpointerOptions:
    """``options`` with ``kwargs`` overriding its fields (the defaults when ``options`` is None)."""
    if options is None:
        return CheckpointerOptions(**kwargs)
    if not isinstance(options, CheckpointerOptions):
        raise TypeError(f"options must be a CheckpointerOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **kwargs) if kwargs else options
