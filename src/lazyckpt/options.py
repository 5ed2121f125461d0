"""The options of a ``LazyCheckpointer``, as one value the integrations pass through."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Backpressure = Literal["block", "skip"]


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every ``LazyCheckpointer`` constructor option with its default; ``ValueError`` on construction
    for an invalid value. ``dataclasses.replace(options, fsync=False)`` derives a variant.

    Args:
        host_memory_budget: bytes of host buffers (pinned on CUDA) to stage through; default a
            quarter of RAM, at most 16 GiB. Larger checkpoints stream through it.
        writer_threads: threads writing to storage.
        fsync: make each file and its directory entry durable before the save counts as done.
        on_backpressure: when saves outrun storage, ``"block"`` (training waits for buffers) or
            ``"skip"`` (the new save is skipped with a warning, counted in ``skipped_saves``).
        crc: compute zip CRC32s for torch files (needed for ``zipfile.testzip`` and ``verify``).
        wait_in_closure: when ``optimizer.step(closure)`` is used (Lightning), wait after the
            closure (after forward/backward) instead of before it.
        chunk_bytes: size of one host buffer chunk; large tensors are split into pieces this big.
        pin_memory: pin host buffers (default: when CUDA is available).
        direct_io: write whole pages of tensor data with ``O_DIRECT``, bypassing the page cache;
            the file layout is the same. ``None`` (default): for files whose tensors average
            >= 1 MiB, where the filesystem supports it. ``False``: never.
        zero_copy: with direct I/O or on tmpfs, write large optimizer-owned CPU tensors straight
            from their memory with no staging copy (each tensor's data then sits at its page
            offset; every reader follows). The next optimizer step or ``wait_staged()`` copies
            what is not yet written. ``False``: stage everything (torch.save's exact layout).
        capture_in_save: copy every tensor, optimizer-owned ones too, inside ``save()`` (CUDA
            copies queued on the current stream). For training whose updates bypass
            ``Optimizer.step()`` (CUDA graph replay, compiled steps, optimizers in a DDP
            communication hook), which the guard cannot hold back. Storage still overlaps training.
        local_dir: for URL paths (``s3://...``, any fsspec URL), the local tier saved to before the
            background upload (default: a temporary directory, removed at ``close()``).
        keep_local: keep the uploaded file at ``<local_dir>/<protocol>/<key>``.
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, ``client_kwargs``); never logged.
        upload_threads: parts uploaded at once (S3 multipart).
        upload_part_bytes: multipart part size (>= 5 MiB); files up to one part are one PUT.
        upload_retries: retries per request on transient errors before ``UploadError``.
        upload_backlog_bytes: local bytes waiting for upload before a URL save waits (or is skipped
            with ``on_backpressure="skip"``); default half the local tier's free space.
        levels: multi-level checkpoints (a ``lazyckpt.Level`` list): ``save(obj, step=n)`` saves to
            every level due at ``n``.
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
    # remote storage (saves to URLs, core/remote.py)
    local_dir: str | None = None
    keep_local: bool = False
    storage_options: dict[str, Any] | None = None
    upload_threads: int = 8
    upload_part_bytes: int = 32 << 20
    upload_retries: int = 6
    upload_backlog_bytes: int | None = None
    # multi-level checkpoints (lazyckpt/levels/)
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
            # their type is checked by lazyckpt/levels/
            object.__setattr__(self, "levels", tuple(self.levels))


def merge(options: CheckpointerOptions | None, kwargs: dict[str, Any]) -> CheckpointerOptions:
    """``options`` with ``kwargs`` overriding its fields (the defaults when ``options`` is None)."""
    if options is None:
        return CheckpointerOptions(**kwargs)
    if not isinstance(options, CheckpointerOptions):
        raise TypeError(f"options must be a CheckpointerOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **kwargs) if kwargs else options
