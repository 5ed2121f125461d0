"""The one place the distributed package touches the core's internals.

A rank's data file is one core ``Job``: its sources are the tensors this rank writes, its
``layout`` a ``RankFileLayout`` (a ``_format.Layout``, like ``_torchfmt.TorchLayout``:
``data_offset(key)`` and the ``_format.Layout`` protocol), and it runs on a
``LazyCheckpointer``'s engine: same pool, same guard (the next ``optimizer.step()`` waits for this
rank's lazy copies only), same writers, same commit of the file inside the staging directory.
If the core's job interface changes, only this module follows. (``RankFile`` builds the sources,
the zero-copy decision and the ``Job``; ``tensor_pickle`` serves it.)

The core's save lives on in two places here. Confirmation (``Job.confirm``): a rank's file is
committed only after its lazy tensors' versions were re-checked on the training thread once the
copies were over; the distributed commit thread therefore waits for the file without confirming
(``local_outcome``), and the training-thread entry points confirm (``confirm_ready``, and the
distributed handle's ``LocalPart``, ``bind_local``). Errors: one ``ErrorLedger``, the inner
checkpointer's: a rank file's own report is claimed by the distributed save that carries it as its
cause, and the distributed save's report is published there (``finish``).
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
from lazyckpt.core import reentry
from lazyckpt.core.capture import Source, flatten_torch
from lazyckpt.core.handle import Completion, SaveHandle, SaveStats, confirm, finished_report, wait_finished
from lazyckpt.core.job import Job
from lazyckpt.core.plan import SavePlan
from lazyckpt.formats.torch_zip import storage_alignment
from lazyckpt.storage import fs as _fs

from ..checkpointer import LazyCheckpointer, producer_of
from ..errors import LazyCkptError, SaveRefusedError, WriteError
from ._handle import Save
from ._layout import RankFileLayout
from ._plan import RankPlan, resolve


def tensor_pickle(t: torch.Tensor) -> bytes:
    """The pickle torch.save writes for a contiguous CPU tensor of ``t``'s dtype and shape whose
    storage (key "0") holds exactly its bytes: what DCP's writer saves for every tensor item (it
    clones views of larger storages). It depends on dtype and shape only: cached, since every save
    of a training run has the same items."""
    return _pickle_for(t.dtype, tuple(t.shape))


@functools.lru_cache(maxsize=8192)
def _pickle_for(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    # torch.empty reserves address space and touches none of it.
    pickle_bytes, sources = flatten_torch(torch.empty(shape, dtype=dtype))
    assert [s.key for s in sources] in ([], ["0"])
    return pickle_bytes


class RankFile:
    """One rank's data file on ``ckpt``'s engine: decides what is staged how, then starts the job.

    ``tensors``: (layout key, name for errors, contiguous tensor). Tensors an optimizer owns are
    copied lazily (the guard holds its next step back until they are); the rest inside ``save()``.
    With the core's zero copy (direct I/O, CPU), large optimizer-owned tensors are written straight
    from their memory: ``phases`` says at which position within a page their data must sit in the
    file (the layout honours it), exactly as the core lays out a torch file.
    """

    def __init__(self, ckpt: LazyCheckpointer, tensors: list[tuple[str, str, torch.Tensor]]) -> None:
        self.ckpt = ckpt
        self.sources = [Source.of_tensor(key, name, t) for key, name, t in tensors]
        # Rank files are never written inside save(): their folder is committed by the coordinator.
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
    """Lay out this rank's share of ``plan`` as one file (``entry.file``, in ``entry.staging``),
    its items' storage data in ``entry.storage``, and start writing it on ``ckpt``'s engine:
    ``entry.local`` is its handle, bound to the distributed handle so that waits confirm it."""
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
    """Until this process's pending saves are confirmed, also confirm them (``confirm_ready``) at
    the start of every module's forward pass, through a global forward pre-hook that removes
    itself once nothing is pending (so it costs nothing outside a save's window).

    Why: the distributed commit needs every rank's confirmation, and a rank confirms only when its
    training thread calls into lazyckpt. Without this, a rank waiting in ``wait()`` while the
    others run a forward pass whose collectives (FSDP's all-gathers) wait for it would stall until
    ``commit_timeout``: with it, the others confirm as soon as any module's forward starts after
    their copies are over, before they block in such a collective."""
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
    """Make the distributed handle's waits (``wait()``, ``exception(timeout)``, the checkpointer's)
    confirm ``local``, this rank's file, on the waiting thread first: the distributed outcome needs
    every rank's file committed, and this rank's is committed only once confirmed."""
    completion.bind(confirm=functools.partial(confirm, local))  # a no-op once the file is committed


def local_outcome(local: SaveHandle) -> BaseException | None:
    """For the distributed commit thread: wait until this rank's file is committed (or failed) and
    return its error. Does not confirm (this is not the thread that mutates the tensors: the
    training thread's next step or call into lazyckpt confirms), and claims the file's error: the
    distributed save reports it, as its cause. (The core publishes that error on the inner ledger
    just before the file is done: a ``raise_errors()`` on another thread in between would raise it
    bare; the distributed checkpointer's own waits first wait for the saves that carry it.)"""
    wait_finished(local)
    report = finished_report(local)
    if report is not None:
        report.claim()
        return report.error
    return None


def resolve_handle(
    ckpt: LazyCheckpointer, completion: Completion, stats: SaveStats | None, error: BaseException | None
) -> bool:
    """Fix a distributed save's outcome as the core fixes a job's, and publish its error on ``ckpt``'s
    ledger, before the handle is visible as done (``complete_handle``): a wait that sees it done finds the
    error. False if the handle was already finished."""
    if completion.handle.done():
        return False
    completion.bind()  # nothing left to confirm
    report = completion.resolve(stats, error)
    if report is not None:
        producer_of(ckpt).publish(report)
    return True


def complete_handle(ckpt: LazyCheckpointer, completion: Completion) -> None:
    """Make the outcome visible; done-callbacks run on the core's callback thread, as a job's do
    (they may wait for other saves, which the distributed commit thread commits)."""
    completion.complete(producer_of(ckpt).callbacks)


def classify_start_error(exc: BaseException, rank: int, final: str) -> BaseException:
    """What starting this rank's file raised, typed: ``SaveRefusedError`` for what cannot be
    serialized (raised by ``save()``), ``WriteError`` for I/O (the save's outcome, in the handle),
    an interrupt as it is."""
    if not isinstance(exc, Exception) or isinstance(exc, LazyCkptError):
        return exc
    if isinstance(exc, OSError):
        err: LazyCkptError = WriteError(f"rank {rank}: cannot write its part of {final}: {exc}", final, exc.errno)
    else:
        err = SaveRefusedError(f"rank {rank}: cannot save this state to {final}: {exc}")
    err.__cause__ = exc
    return err
