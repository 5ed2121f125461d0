"""LazyCheckpointer: the public facade over flatten -> stage -> write -> commit."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

import torch

from lazyckpt.core import exit as _exit
from lazyckpt.core import guard as _guard
from lazyckpt.core import remote as _remote
from lazyckpt.core.backpressure import BackpressureGate, skipped_handle
from lazyckpt.core.engine import Engine
from lazyckpt.core.handle import SaveHandle, SaveStats, done_handle
from lazyckpt.core.job import Job
from lazyckpt.core.pending import PendingSaves
from lazyckpt.core.plan import SavePlan
from lazyckpt.core.pool import HostBufferPool, default_host_memory_budget
from lazyckpt.core.producer import Producer
from lazyckpt.core.removal import Remover
from lazyckpt.core.report import ErrorLedger, Report, raise_first
from lazyckpt.formats import base as _format
from lazyckpt.options import Backpressure, CheckpointerOptions
from lazyckpt.options import merge as merge_options
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

from .errors import CheckpointerClosedError, SaveRefusedError

__all__ = ["LazyCheckpointer"]
from .levels import Level
from .schedule import MultiLevel, check_levels

logger = logging.getLogger(__name__)

Format = Literal["torch", "safetensors"]


class LazyCheckpointer(_exit.ClosedOnExit):
    """Saves checkpoints without stopping training.

    ``save(obj, path)`` returns once ``obj`` is pickled (tensors excluded) and the tensors no
    optimizer guards are copied; optimizer-owned tensors are copied in the background, and the next
    ``optimizer.step()`` waits only for copies not yet done. The file at ``path`` then holds exactly
    the state at ``save()``, or the save fails with a typed error; a partial file never appears.

    After ``save()`` the caller may keep training. Changing a saved tensor in place by other means
    before ``handle.wait_staged()`` fails that save with ``StaleTensorError``; the check runs on the
    next thread calling into lazyckpt (optimizer step, ``save()``, ``wait*()``, ``close()``), so a
    change still running on another thread then may be missed. Writes through ``tensor.data`` cannot
    be detected: call ``wait_staged()`` before them. Methods are thread-safe.

    Options come as one ``CheckpointerOptions`` (``options=``), as keywords, or both (keywords
    override those fields); ``self.options`` holds the result. See ``CheckpointerOptions``.
    """

    def __init__(self, options: CheckpointerOptions | None = None, **kwargs: Any) -> None:
        """Take ``options``, keyword options (the ``CheckpointerOptions`` fields), or both."""
        if options is not None and not isinstance(options, CheckpointerOptions):
            raise TypeError(
                f"LazyCheckpointer takes a CheckpointerOptions or keyword options, got {type(options).__name__}"
            )
        options = merge_options(options, kwargs)
        if options.levels is not None:
            check_levels(options.levels)  # before any thread starts
        self.options = options
        host_memory_budget, pin_memory = options.host_memory_budget, options.pin_memory
        budget = default_host_memory_budget() if host_memory_budget is None else int(host_memory_budget)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.fsync, self.crc, self.wait_in_closure = options.fsync, options.crc, options.wait_in_closure
        self.on_backpressure: Backpressure = options.on_backpressure
        self.pool = HostBufferPool(budget, options.chunk_bytes, pin)
        self._backpressure = BackpressureGate(self.pool, skip=options.on_backpressure == "skip")
        self.direct_io = options.direct_io
        self.zero_copy = options.zero_copy
        self.capture_in_save = options.capture_in_save
        self._errors = ErrorLedger()  # failed saves and removals whose error nobody has seen yet
        self._cleaned_dirs: set[str] = set()
        self._closed = False
        # before any thread starts: a level folder that cannot be made refuses the construction
        self._levels: MultiLevel | None = (
            None
            if options.levels is None
            else MultiLevel(self, options.levels, options, reuse=self._reuse, replicate=True)
        )
        self._engine = Engine(self.pool, options.writer_threads, self._job_done)
        self._remover = Remover(on_failed=self._errors.publish)
        self._pending = PendingSaves(self._remover, on_failed=self._errors.publish)  # saved, not yet committed
        self._producer = Producer(
            options, self.pool, self._engine, self._pending, self._remover, self._errors,
            closed=lambda: self._closed, on_remote=self._on_remote,
        )  # fmt: skip
        _exit.register(self, _close_at_exit, layer=_exit.CORE)

    # -- public API -------------------------------------------------------------------------------

    @property
    def skipped_saves(self) -> int:
        """Saves skipped so far (``on_backpressure="skip"``)."""
        return self._backpressure.skipped

    @property
    def skipped_copies(self) -> int:
        """Level copies skipped so far (``on_backpressure="skip"``, a slower level at its backlog bound)."""
        return 0 if self._levels is None else self._levels.skipped_copies

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels given at construction (``()`` without); ``lazyckpt.latest(ckpt.levels)``."""
        return () if self._levels is None else self._levels.levels

    def save(
        self,
        obj: Any,
        path: str | os.PathLike[str] | None = None,
        format: Format = "torch",
        metadata: dict[str, str] | None = None,
        before_commit: Callable[[], object] | None = None,
        *,
        step: int | None = None,
    ) -> SaveHandle:
        """Start saving ``obj`` to ``path`` (a file path or URL); returns a ``SaveHandle`` at once.

        ``format="torch"`` writes what ``torch.save`` writes; ``"safetensors"`` takes a flat
        ``dict[str, Tensor]`` and optional string ``metadata``. ``before_commit`` runs on the
        committer thread after the file is written and fsynced, right before the rename to ``path``;
        if it raises, the save fails and nothing appears at ``path``. A save with lazily copied
        tensors commits only after a later call into lazyckpt re-checks them (see the class).
        With ``levels`` at construction, ``save(obj, step=n)`` (no path) saves to every level due
        at ``n`` and returns one handle.

        Raises ``SaveRefusedError`` (nothing written) for input it cannot save, and the unseen error
        of an earlier failed save.
        """
        if reentry.reentered():  # a signal handler interrupted this thread inside lazyckpt
            return self._save_now(obj, path, format, metadata, before_commit, step)
        if path is None or step is not None:
            return self._save_step(obj, path, step, format, metadata, before_commit)
        with reentry.inside():
            t0 = time.perf_counter()
            if _remote.is_url(path):
                return self._save_url(obj, str(path), t0, format=format, metadata=metadata, before_commit=before_commit)
            return self._save_file(obj, path, t0, format, metadata, before_commit)

    def supersede_into(self, folder: str) -> None:
        """Internal (``threads/reentry.py``): pending saves into ``folder`` discard their file instead of committing."""
        inside = folder.rstrip(os.sep) + os.sep
        jobs = [j for j in self._pending.jobs_snapshot() if j.path.startswith(inside)]
        for path in {j.path for j in jobs}:
            self._engine.committer.supersede(path, jobs)

    def _save_now(
        self, obj: Any, path: Any, format: Format, metadata: dict[str, str] | None, before_commit: Any, step: Any
    ) -> SaveHandle:
        """``save()`` from a signal handler that interrupted lazyckpt (``threads/reentry.py``): written and
        durable before returning, taking no lazyckpt lock; a pending save to ``path`` is superseded."""
        t0 = time.perf_counter()
        reentry.count_synchronous()
        if path is None or step is not None or _remote.is_url(path):
            raise SaveRefusedError(
                "lazyckpt: a save from a signal handler that interrupted lazyckpt is written at once, to a local "
                "file path; a URL or a levels step cannot be (set a flag in the handler and save from the loop)"
            )
        self._check_open()
        final = _fs.final_path(path)
        tmp, size = _fs.write_temporary(obj, final, format, metadata, self.fsync)
        try:
            if before_commit is not None:
                before_commit()
            self._engine.committer.supersede(final, self._pending.jobs_snapshot())
            _fs.commit(tmp, final, self.fsync)
        except BaseException:
            _fs.discard(tmp)
            raise
        now = time.perf_counter() - t0
        return done_handle(SaveStats(final, 0, size, now, now, now, now, 0.0, 0.0))

    def _save_step(
        self, obj: Any, path: Any, step: int | None, format: str, metadata: Any, before_commit: Any
    ) -> SaveHandle:
        """``save(obj, step=n)`` with levels; refuses the mixes that have no meaning."""
        if path is not None:
            raise SaveRefusedError("save(obj, path) takes no step=; save(obj, step=n) takes no path (levels decide)")
        if self._levels is None or step is None:
            raise SaveRefusedError(
                "save(obj) needs a path (save(obj, 'ckpt.pt')), or levels=[Level(...), ...] at construction "
                "and a step (save(obj, step=n))"
            )
        if format != "torch" or metadata is not None or before_commit is not None:
            raise SaveRefusedError(
                "save(obj, step=n) writes torch files; format, metadata and before_commit are not taken"
            )
        self._check_open()
        return self._levels.save(obj, step)

    def _save_file(
        self,
        obj: Any,
        path: str | os.PathLike[str],
        t0: float,
        format: Format,
        metadata: dict[str, str] | None,
        before_commit: Callable[[], object] | None,
        named_as: str | None = None,
    ) -> SaveHandle:
        """``save()`` to a local ``path``; the archive's records are named after ``named_as`` (default ``path``)."""
        self._check_open()
        _guard.confirm_ready()  # earlier saves whose copies are over: this thread's ops came before
        self._raise_unreported()
        final = self._resolve(path)
        planner = _format.get(format).flatten(obj, metadata)
        plan = SavePlan.decide(self.options, planner.sources, final)
        layout = planner.plan(os.fspath(path) if named_as is None else named_as, plan.phases, crc=self.crc)
        sources, file_bytes = planner.sources, layout.file_bytes
        nbytes = sum(s.nbytes for s in sources)
        if self._backpressure.skip and self._backpressure.should_skip(self._pending.nbytes(), nbytes, final):
            return skipped_handle(final, t0)
        lazy, eager = plan.split(sources)
        job = Job(
            path=final, tmp=_fs.temporary_path(final), fmt=format, sources=sources, lazy=lazy,
            layout=layout, file_bytes=file_bytes, crc=self.crc, fsync=self.fsync,
            wait_in_closure=self.wait_in_closure, t0=t0, before_commit=before_commit,
        )  # fmt: skip
        self._producer.run_job(job, eager, plan.direct, plan.inline)
        job.t_returned = time.perf_counter()
        return job.handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is durable and every ``remove()`` has run, then raise the
        oldest unseen background error (see ``raise_errors``).

        ``timeout``: seconds (``None``: no limit); ``TimeoutError`` when not all are done by then."""
        if reentry.wait_refused("LazyCheckpointer.wait()"):
            return
        with reentry.inside():
            self._drain(timeout)
            self._raise_unreported()

    def _drain(self, timeout: float | None) -> None:
        """Wait for the levels' copies, then pending saves, removals and uploads; ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._levels is not None:  # first: its copies feed on this checkpointer's saves and removals
            self._levels.drain(_left(deadline))
        for job in self._pending.jobs():
            if not job.handle.wait_done(_left(deadline)):
                raise TimeoutError(f"pending saves not durable after {timeout} s")
        try:
            self._remover.wait(_left(deadline))
        except TimeoutError:
            raise TimeoutError(f"pending removals not done after {timeout} s") from None
        remote = self._producer.remote
        if remote is not None and not remote.wait(_left(deadline)):
            raise TimeoutError(f"pending uploads not done after {timeout} s")

    def raise_errors(self) -> None:
        """Raise the oldest unseen background error (failed save or removal, or one from ``add_error``),
        with a note naming the others; all of them then count as seen. Returns if there is none.

        Errors already raised by ``handle.wait()`` or fetched from a removal's future are not raised
        again; one raised here is still raised by its own ``handle.wait()``."""
        raise_first(self._errors.take() + (self._levels.take_errors() if self._levels is not None else []))

    def add_error(self, error: BaseException) -> None:
        """Queue a background error of the caller's own, raised once by the next ``save()``, ``wait()``,
        ``close()`` or ``raise_errors()``."""
        self._errors.publish(Report(error))

    def remove(self, path: str | os.PathLike[str], *, trash_dir: str | os.PathLike[str] | None = None) -> Future:
        """Delete a checkpoint file or folder (or URL) in commit order; returns a ``Future`` at once.

        The deletion runs after every save to ``path`` (or into the folder) pending now has committed
        or failed, and before any later save to it commits. The path is first renamed to a hidden
        name (in ``trash_dir`` if given, on the same filesystem), freeing the name; a background
        thread deletes the data. Symlinks are unlinked at once. Safe to call from a done-callback.

        With no pending save to ``path``, a missing ``path`` raises ``FileNotFoundError`` here;
        behind a pending save, a missing path is not an error. The future completes once the data
        is deleted; ``wait()`` and ``close()`` raise a failed removal's error once unless it was
        fetched from the future.
        """
        self._check_open()
        if _remote.is_url(path):
            url = str(path)
            tier = self._producer.remote_tier()
            return tier.remove(url, *tier.resolve(url))
        trash = None if trash_dir is None else os.path.abspath(os.fspath(trash_dir))
        return self._pending.remove(os.path.abspath(os.fspath(path)), trash)

    @reentry.region
    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until every pending save's host copies are done (saved tensors may change)."""
        for job in self._pending.jobs():
            job.handle.wait_staged(timeout)

    @reentry.region
    def wait_path(self, path: str | os.PathLike[str], timeout: float | None = None) -> None:
        """Block until every pending save to ``path`` is durable; raise its error if it failed."""
        handles: list[SaveHandle]
        if _remote.is_url(path):
            remote = self._producer.remote
            handles = remote.pending_handles(str(path)) if remote is not None else []
        else:
            handles = self._pending.handles_to(os.path.abspath(os.fspath(path)))
        for handle in handles:
            handle.wait(timeout)

    def pending_paths(self) -> set[str]:
        """Final paths of saves not yet committed (URLs: not yet complete in the store)."""
        remote = self._producer.remote
        return self._pending.paths() | (remote.pending_urls() if remote is not None else set())

    def track(self, *optimizers: torch.optim.Optimizer) -> None:
        """Declare optimizers whose ``step()`` guards their tensors, so those are copied in the background
        rather than inside ``save()``. Optimizers are also tracked after their first ``step()``."""
        for opt in optimizers:
            _guard.track(opt)

    def declare_frozen(self, *tensors: torch.Tensor | torch.nn.Module) -> None:
        """Declare tensors that training does not change (e.g. a frozen base model), so they are copied
        in the background instead of inside every ``save()``. For a module: its parameters that do
        not require grad. Process-wide, while the tensors live.

        A declared tensor changed in place while a save still reads it fails that save with
        ``StaleTensorError`` (changes through ``.data`` cannot be detected).
        """
        _guard.freeze(*tensors)

    @reentry.region
    def close(self) -> None:
        """Drain every pending save and removal, stop the threads, free the buffers; raise any unseen
        error. May be called from a done-callback (the callback thread then ends after it)."""
        if self._closed:
            self._engine.stop()  # joins a callback thread that closed us from inside
            return
        try:
            self._drain(None)
        finally:
            self._closed = True
            if self._levels is not None:
                self._levels.close()
            self._engine.stop()
            if self._producer.remote is not None:  # after the engine: its uploads wait for local commits
                self._producer.remote.close()
            self._remover.stop()
            self._engine.spares.clear()  # after the engine: no writer takes one any more
            self.pool.close()
            _exit.unregister(self)
        self._raise_unreported()

    # -- internals --------------------------------------------------------------------------------

    def _reuse(self, path: str) -> bool:
        return self._producer.reuse(path)  # the levels are made before the producer

    def _on_remote(self) -> None:
        _exit.register(self, _close_at_exit, layer=_exit.CORE, early=True)  # uploads: see core/exit.py

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError("this LazyCheckpointer is closed; create a new one")

    def _save_url(self, obj: Any, url: str, t0: float, **kwargs: Any) -> SaveHandle:
        """A URL save: a local save into the remote tier, then its upload (``core/remote.py``)."""
        self._check_open()
        tier = self._producer.remote_tier()
        fs, rpath = tier.resolve(url)
        if not tier.admit(skip=self.on_backpressure == "skip"):
            self._backpressure.skip_upload(url, tier)
            return skipped_handle(url, t0)
        self._backpressure.warn_if_uploads_behind(tier)
        local_path = tier.local_file(rpath)
        try:
            local = self._save_file(obj, local_path, t0, named_as=url, **kwargs)
        except BaseException:
            _remote.discard_local(local_path)
            raise
        nbytes = self._pending.file_bytes(local)
        if not nbytes and local.stats is not None:
            nbytes = local.stats.file_bytes
        return tier.register(url, fs, rpath, local, nbytes, t0)

    def _resolve(self, path: str | os.PathLike[str]) -> str:
        final = _fs.final_path(path)  # SaveRefusedError for what is no file path
        directory = os.path.dirname(final)
        if directory not in self._cleaned_dirs:
            self._cleaned_dirs.add(directory)
            _fs.cleanup_temporaries(directory)
        return final

    def _job_done(self, job: Job) -> None:
        """Engine callback on the committer thread; must not warn or call user code."""
        self._pending.finished(job)
        if job.error is not None:
            logger.debug("lazyckpt: save to %s failed: %s", job.path, job.error)
        else:
            logger.debug("lazyckpt: saved %s (%d bytes)", job.path, job.nbytes)

    def _raise_unreported(self) -> None:
        """On the caller's thread: raise an unseen background error, else issue pending warnings."""
        self.raise_errors()
        self._backpressure.warn_if_staging_waited()


def producer_of(ckpt: LazyCheckpointer) -> Producer:
    """Internal API: ``ckpt``'s producer (``core/producer.py``), for code that saves on its behalf."""
    return ckpt._producer


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _close_at_exit(ckpt: LazyCheckpointer) -> None:
    """At interpreter exit: finish pending saves, log what failed."""
    if ckpt.closed:
        return
    try:
        ckpt.close()
    except Exception as exc:  # nobody left to raise to
        logger.error("lazyckpt: a checkpoint save or upload failed before exit: %s", exc)
