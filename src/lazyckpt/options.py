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
    # remote storage (saves to URLs, ``_remote.py``)
    local_dir: str | None = None
    keep_local: bool = False
    storage_options: dict[str, Any] | None = None
    upload_threads: int = 8
    upload_part_bytes: int = 32 << 20
    upload_retries: int = 6
    upload_backlog_bytes: int | None = None
    # multi-level checkpoints (``lazyckpt.levels``): ``save(obj, step=n)`` saves to the levels due at n
    levels: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if self.on_backpressure not in ("block", "skip"):
            raise ValueError(f"on_backpressure must be 'block' or 'skip', got {self.on_backpressure!r}")
        if self.writer_threads < 1:
            raise ValueError("writer_threads must be >= 1")
        if self.host_memory_budget is not None and int(self.host_memory_budget) < 1:
            raise ValueError("host_memory_budget must be positive")
        if self.upload_threads < 1:
            raise ValueError("upload_threads must be >= 1")
        if self.upload_part_bytes < 5 << 20:
            raise ValueError("upload_part_bytes must be >= 5 MiB (S3's smallest multipart part)")
        if self.upload_retries < 0:
            raise ValueError("upload_retries must be >= 0")
        if self.levels is not None:
            # Their type is checked by the levels package (``MultiLevel``): options know no level.
            object.__setattr__(self, "levels", tuple(self.levels))


def merge(options: CheckpointerOptions | None, kwargs: dict[str, Any]) -> CheckpointerOptions:
    """``options`` with ``kwargs`` overriding its fields (the defaults when ``options`` is None)."""
    if options is None:
        return CheckpointerOptions(**kwargs)
    if not isinstance(options, CheckpointerOptions):
        raise TypeError(f"options must be a CheckpointerOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **kwargs) if kwargs else options
