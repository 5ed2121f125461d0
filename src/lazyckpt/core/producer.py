"""The producer interface of a ``LazyCheckpointer``: its engine, error ledger, done-callback thread and
remote tier, for the code saving on its behalf (distributed checkpointer, levels, integrations), reached
through ``lazyckpt.checkpointer.producer_of(ckpt)`` rather than methods of the public class.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lazyckpt.core import guard as _guard
from lazyckpt.core import remote as _remote
from lazyckpt.core.committer import write_error
from lazyckpt.core.engine import Engine
from lazyckpt.core.handle import CallbackRunner
from lazyckpt.core.job import Job
from lazyckpt.core.pending import PendingSaves
from lazyckpt.core.pool import HostBufferPool
from lazyckpt.core.removal import Remover
from lazyckpt.core.report import ErrorLedger, Report
from lazyckpt.errors import WriteError
from lazyckpt.formats.capture import Source
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

if TYPE_CHECKING:
    from lazyckpt.options import CheckpointerOptions

logger = logging.getLogger(__name__)


class Producer:
    """One checkpointer's engine, pending saves, ledger and remote tier, as its producers use them.
    Thread-safe. ``closed`` tells whether the checkpointer is closed; ``on_remote`` runs once, when the
    remote tier is made (the checkpointer registers its early drain at exit then)."""

    def __init__(
        self,
        options: CheckpointerOptions,
        pool: HostBufferPool,
        engine: Engine,
        pending: PendingSaves,
        remover: Remover,
        errors: ErrorLedger,
        closed: Callable[[], bool],
        on_remote: Callable[[], None],
    ) -> None:
        self.options = options
        self.pool, self.engine, self.pending, self.remover, self.errors = pool, engine, pending, remover, errors
        self._closed, self._on_remote = closed, on_remote
        self._lock = reentry.Lock()  # the remote tier's creation
        self.remote: _remote.RemoteTier | None = None  # URL saves: started by the first one

    @property
    def callbacks(self) -> CallbackRunner:
        """The thread that runs the checkpointer's done-callbacks."""
        return self.engine.committer.callbacks

    def publish(self, report: Report) -> None:
        """Put a failed save's report (one made on the checkpointer's behalf: the distributed commit,
        a level's folder) on the checkpointer's ledger, to be claimed once."""
        self.errors.publish(report)

    def remote_tier(self) -> _remote.RemoteTier:
        """The remote tier (local folder, upload threads), made at the first use."""
        with self._lock:
            if self.remote is None:
                self.remote = _remote.RemoteTier(self.options, self.errors.publish, self.engine.committer.callbacks)
                self._on_remote()
            return self.remote

    def reuse(self, path: str) -> bool:
        """A memory level's retention: keep the pages of the file (or a folder's large files) at ``path`` for
        the next saves (``storage/spare.py``) instead of deleting it. False when it may not be reused (a
        save to it pending, closed, not a memory filesystem, ...: then ``remove()`` it). Never raises."""
        target = os.path.abspath(os.fspath(path))
        # no save to ``path`` may be registered (and commit onto it) meanwhile
        return self.pending.unless_behind(target, lambda: not self._closed() and self._reuse_now(target))

    def _reuse_now(self, target: str) -> bool:
        spares = self.engine.spares
        if not os.path.isdir(target) or os.path.islink(target):
            return spares.offer(target)
        root = os.path.dirname(target)
        if not _fs.is_memory_filesystem(root):
            return False
        try:
            self.remover.remove(target, salvage=lambda taken: spares.offer_folder(taken, root))
        except OSError as exc:
            logger.debug("lazyckpt: %s not reused: %s", target, exc)
            return False
        return True

    def run_job(self, job: Job, eager: list[Source], direct: bool, inline: bool = False) -> None:
        """Capture unguarded tensors (``inline``: write them), register the job with the guard, hand it to
        the engine. The temporary file is created by the first writer that needs it (``Engine.open``),
        here only when ``inline``; a failure there fails the save in its handle."""
        job.direct = direct
        folder = os.path.dirname(job.tmp)
        if _fs.is_memory_filesystem(folder):  # one writer at a time: see Job.serial
            job.serial = reentry.Lock()
        if not os.access(folder, os.W_OK):  # what is sure to fail fails here; the rest in the handle
            code = errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES
            refused = WriteError(f"cannot create {job.tmp}: {os.strerror(code)}", path=job.path, errno=code)
            _raise_described(job, refused)
        if inline:  # save() writes the file itself; a failed creation fails the job
            self.engine.open(job)
        if self.pool.pin_memory and self.pool.pin_device is None and torch.cuda.is_initialized():
            self.pool.pin_device = torch.cuda.current_device()
        for device in {s.device for s in job.lazy if s.device.type == "cuda"}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            job.save_events[device] = event
        self.pending.add(job)
        if job.lazy:
            _guard.add(job)
        try:
            if inline:
                self.engine.write_now_all(job, eager)
            else:
                for src in eager:
                    self.engine.stage_now(job, src)
        except Exception as exc:
            job.fail(write_error(job, "staging for", exc))
        except BaseException as exc:  # Ctrl-C on a full pool: the save fails cleanly, the interrupt goes on
            job.fail(write_error(job, "staging for", exc))
            job.completion.caller_saw_error()  # the caller sees the interrupt itself, not this save's error again
            self.engine.submit(job)  # the engine unlinks the temporary file and releases the guard
            raise
        self.engine.submit(job)


def _raise_described(job: Job, exc: BaseException) -> None:
    """Raise a save's refusal as its caller is to get it (a level's ``LevelError``: ``Job.described``)."""
    described = job.described(exc)
    if described is exc:
        raise exc
    raise described from exc
