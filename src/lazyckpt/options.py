"""The options of a :class:`~lazyckpt.LazyCheckpointer`, as one value the integrations pass through."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Backpressure = Literal["block", "skip"]


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every ``LazyCheckpointer`` constructor option with its default. Validated on construction
    with the errors the constructor raises: ``ValueError`` for a bad ``on_backpressure``,
    ``writer_threads < 1`` or a budget below 1. ``dataclasses.replace(options, fsync=False)``
    derives a variant.

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
        direct_io: write the whole pages of tensor data with ``O_DIRECT`` (no copy into the page
            cache, which on a busy host costs more CPU than everything else lazyckpt does; the
            partial pages at each tensor's ends go through the page cache). The file layout is
            the same either way. ``None`` (default): for files whose tensors average >= 1 MiB,
            where the filesystem supports it. ``False``: never.
        zero_copy: with direct I/O, or to a memory filesystem (tmpfs: a write is a memory copy from
            any buffer), write large CPU tensors that an optimizer owns straight from
            their memory, with no staging copy: a torch file then places each such tensor's data at
            its address's position within a page (padding of under a page in the record header,
            which every reader follows; the file carries no ``.format_version``, as torch < 2.5's
            files do not). An optimizer step (or ``wait_staged()``) that comes before the writers are
            through copies what is left, so training waits for memory copies, not for storage,
            unless the host budget is used up (then that copy waits for writers to free buffers,
            as any copy does). ``False``: copy
            everything into the staging buffers first (torch.save's exact layout).
        capture_in_save: copy every tensor inside ``save()``, the optimizer-owned ones too, as
            ``wait_staged()`` right after ``save()`` would: CPU tensors are in host buffers before
            ``save()`` returns; CUDA copies are queued on the current stream, so every kernel
            queued after ``save()`` (a replayed CUDA graph, a compiled step) runs after them, and
            the host does not wait. For training whose parameter updates do not go through
            ``Optimizer.step()`` (CUDA graph replay, ``torch.compile(mode="reduce-overhead")``
            steps, optimizers fused into a DDP communication hook), which the guard cannot hold
            back. Costs the overlap with forward/backward; storage still overlaps training. A
            checkpointer-wide option rather than a per-save flag: such training updates that way
            at every step.

    Remote storage: ``path`` may be a URL (``s3://bucket/key``, any fsspec URL). The save is the
    local save above into ``local_dir``, then a background upload (README, "Remote storage"); the
    handle's ``done()`` means the object is complete in the store, ``local()`` the local copy.

        local_dir: the local tier (default: a temporary directory, removed at ``close()``).
        keep_local: keep the uploaded file at ``<local_dir>/<protocol>/<key>`` (fast restart).
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, ``client_kwargs``); never logged.
        upload_threads: parts uploaded at once (S3 multipart).
        upload_part_bytes: multipart part size (>= 5 MiB); files up to one part are one PUT.
        upload_retries: retries per request on transient errors before ``UploadError``.
        upload_backlog_bytes: local bytes waiting for upload before a URL save waits (or is skipped
            with ``on_backpressure="skip"``); default half the local tier's free space.

        levels: multi-level checkpoints (``lazyckpt.Level`` list): ``save(obj, step=n)`` saves to
            every level due at ``n`` (README, "Multi-level checkpoints").
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
