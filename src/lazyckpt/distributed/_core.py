"""The one place the distributed package touches the core's internals: a rank's data file as one
core ``Job`` on a ``LazyCheckpointer``'s engine (its pool, guard, writers, file commit).

A rank's file is committed only once the training thread confirmed its lazy copies: the commit
thread waits without confirming (``local_outcome``); training-thread entry points confirm
(``confirm_ready``, ``bind_local``, the forward hook). Errors go to the inner checkpointer's ledger.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from lazyckpt.core import guard as _guard
from lazyckpt.core.handle import Completion, SaveHandle, SaveStats, confirm, finished_report, wait_finished
from lazyckpt.core.job import Job
from lazyckpt.core.plan import SavePlan
from lazyckpt.formats.capture import Source, flatten_torch
from lazyckpt.formats.torch_zip import storage_alignment
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

from ..checkpointer import LazyCheckpointer, producer_of
from ..errors import LazyCkptError, SaveRefusedError, WriteError
from ._handle import Save
from ._layout import RankFileLayout
from ._plan import RankPlan, resolve


def tensor_pickle(t: torch.Tensor) -> bytes:
    """The pickle torch.save writes for a contiguous CPU tensor of ``t``'s dtype and shape (one
    storage, key "0"), as DCP's writer saves every tensor item; cached by dtype and shape."""
    return _pickle_for(t.dtype, tuple(t.shape))


@functools.lru_cache(maxsize=8192)
def _pickle_for(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    # torch.empty reserves address space and touches none of it.
    pickle_bytes, sources = flatten_torch(torch.empty(shape, dtype=dtype))
    assert [s.key for s in sources] in ([], ["0"])
    return pickle_bytes


class RankFile:
    """One rank's data file on ``ckpt``'s engine: decides what is staged how, then starts the job.

    ``tensors``: (layout key, name for errors, contiguous tensor). ``phases``: for zero-copy tensors,
    where within a page their data must sit in the file (the layout honours it).
    """

    def __init__(self, ckpt: LazyCheckpointer, tensors: list[tuple[str, str, torch.Tensor]]) -> None:
        self.ckpt = ckpt
        self.sources = [Source.of_tensor(key, name, t) for key, name, t in tensors]
        # Never written inside save(): the coordinator commits the folder.
        self.plan = SavePlan.decide(ckpt.options, self.sources, "", allow_inline=False, capture_in_save=False)
        if 64 % storage_alignment() != 0:  # the layout cannot honour page phases: no zero copy
            self.plan.phases = {}
            self.plan.zero_copy = False
        self.phases = self.plan.phases

    def start(self, path: str, layout: RankFileLayout, t0: float) -> SaveHandle:
        """Start writing ``path`` (atomically, through a temporary name beside it)."""
        for src in self.sources:
            src.file_offset = layout.data_offset(src.key)
        lazy, eager = self.plan.split(self.sources)
        job = Job(
            path=path, tmp=_fs.temporary_path(path), fmt="torch", sources=self.sources, lazy=lazy,
            layout=layout, file_bytes=layout.file_bytes, crc=self.ckpt.crc, fsync=self.ckpt.fsync,
            wait_in_closure=self.ckpt.wait_in_closure, t0=t0,
        )  # fmt: skip
        producer_of(self.ckpt).run_job(job, eager, self.plan.direct)
        job.t_returned = time.perf_counter()
        return job.handle


def start_rank_file(ckpt: LazyCheckpointer, entry: Save, plan: RankPlan) -> None:
    """Lay out this rank's share of ``plan`` as ``entry.file`` in ``entry.staging`` (storage data in
    ``entry.storage``) and start writing it; ``entry.local`` is its handle, bound so waits confirm it."""
    tensors, byte_items = resolve(plan)
    layout = RankFileLayout(ckpt.crc)
    sources = []
    for item, data in byte_items:
        offset, length = layout.add_bytes(data)
        entry.storage[item.index] = _StorageInfo(entry.file, offset, length)
    for i, (item, t) in enumerate(tensors):
        # A non-contiguous tensor is copied now (so captured now, not lazily).
        sources.append((str(i), item.index.fqn, t if t.is_contiguous() else t.contiguous()))
    rank_file = RankFile(ckpt, sources)
    for (item, _), (key, _, t) in zip(tensors, sources, strict=True):
        nbytes = t.numel() * t.element_size()
        offset, length = layout.add_tensor(key, tensor_pickle(t), nbytes, rank_file.phases.get(key))
        entry.storage[item.index] = _StorageInfo(entry.file, offset, length)
    entry.layout = layout
    path = os.path.join(entry.staging, entry.file)
    entry.local = rank_file.start(path, layout, entry.t0)
    assert entry.handle is not None and entry.completion is not None and entry.part is not None
    entry.part.handle = entry.local
    bind_local(entry.completion, entry.local)
    confirm_in_forward()


def confirm_ready() -> None:
    """On the training thread: confirm this process's saves whose copies are over (never blocks)."""
    _guard.confirm_ready()


_hook_lock = reentry.Lock()
_forward_hook: RemovableHandle | None = None


def confirm_in_forward() -> None:
    """Confirm pending saves at the start of every module's forward pass too, through a global
    forward pre-hook that removes itself once nothing is pending: ranks then confirm before they
    block in a forward pass's collectives (FSDP's all-gathers) waiting for a rank in ``wait()``."""
    global _forward_hook
    with _hook_lock:
        if _forward_hook is None:
            _forward_hook = register_module_forward_pre_hook(_confirm_hook)


def _confirm_hook(module: torch.nn.Module, args: Any) -> None:
    global _forward_hook
    _guard.confirm_ready()
    if not _guard.has_pending():
        with _hook_lock:
            if _forward_hook is not None and not _guard.has_pending():
                _forward_hook.remove()
                _forward_hook = None


def bind_local(completion: Completion, local: SaveHandle) -> None:
    """Make the distributed handle's waits confirm ``local``, this rank's file, on the waiting thread first."""
    completion.bind(confirm=functools.partial(confirm, local))  # a no-op once the file is committed


def local_outcome(local: SaveHandle) -> BaseException | None:
    """Commit thread: wait until this rank's file is committed (or failed), without confirming it,
    and return its error, claimed (the distributed save reports it as its cause)."""
    wait_finished(local)
    report = finished_report(local)
    if report is not None:
        report.claim()
        return report.error
    return None


def resolve_handle(
    ckpt: LazyCheckpointer, completion: Completion, stats: SaveStats | None, error: BaseException | None
) -> bool:
    """Fix a distributed save's outcome and publish its error on ``ckpt``'s ledger, before the handle
    is visible as done (``complete_handle``). False if the handle was already finished."""
    if completion.handle.done():
        return False
    completion.bind()  # nothing left to confirm
    report = completion.resolve(stats, error)
    if report is not None:
        producer_of(ckpt).publish(report)
    return True


def complete_handle(ckpt: LazyCheckpointer, completion: Completion) -> None:
    """Make the outcome visible; done-callbacks run on the core's callback thread."""
    completion.complete(producer_of(ckpt).callbacks)


def classify_start_error(exc: BaseException, rank: int, final: str) -> BaseException:
    """Type what starting this rank's file raised: ``WriteError`` for I/O (the save's outcome),
    ``SaveRefusedError`` for anything else (raised by ``save()``); lazyckpt errors and interrupts as is."""
    if not isinstance(exc, Exception) or isinstance(exc, LazyCkptError):
        return exc
    if isinstance(exc, OSError):
        err: LazyCkptError = WriteError(f"rank {rank}: cannot write its part of {final}: {exc}", final, exc.errno)
    else:
        err = SaveRefusedError(f"rank {rank}: cannot save this state to {final}: {exc}")
    err.__cause__ = exc
    return err


def renamed(storage: dict[Any, Any], name: str) -> dict[Any, Any]:
    """This rank's storage data with its file called ``name`` (same offsets: the same bytes)."""
    return {index: _StorageInfo(name, info.offset, info.length) for index, info in storage.items()}
