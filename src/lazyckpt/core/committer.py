"""The committer: publishes each job's file (rename, directory fsync) strictly in ``save()`` order, so the last
save to a path wins, and is the only thread that finishes a file save's handle."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lazyckpt.core.handle import CallbackRunner
from lazyckpt.core.job import Job
from lazyckpt.errors import WriteError
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

logger = logging.getLogger(__name__)


def write_error(job: Job, what: str, exc: BaseException) -> WriteError:
    """The typed error for a failed step of ``job``, cause chained, errno kept."""
    code = exc.errno if isinstance(exc, OSError) else None
    err = WriteError(f"{what} {job.path} failed: {exc}", path=job.path, errno=code)
    err.__cause__ = exc
    return err


class Committer:
    """``submit`` from ``save()`` (any thread); the commit runs on the ``lazyckpt-committer`` thread; done-callbacks
    on the callback thread, never on the committer (they may wait)."""

    def __init__(self, on_done: Callable[[Job], None]) -> None:
        self._on_done = on_done
        self._worker: Worker[Job] = Worker("lazyckpt-committer", self._commit_one)
        self._order_lock = reentry.Lock()
        self._uncommitted: list[Job] = []  # in commit order (``ahead``)
        self.callbacks = CallbackRunner()

    def submit(self, job: Job) -> None:
        with self._order_lock:
            self._uncommitted.append(job)
        if not self._worker.submit(job):  # stopped (the checkpointer refuses saves before that)
            with self._order_lock:
                self._uncommitted.remove(job)

    def ahead(self, job: Job) -> list[Job]:
        """The jobs the committer takes before ``job`` (in submission order) and has not finished."""
        with self._order_lock:
            for i, queued in enumerate(self._uncommitted):
                if queued is job:
                    return self._uncommitted[:i]
        return []

    def _commit_one(self, job: Job) -> None:
        try:
            self._commit(job)
        except BaseException as exc:  # noqa: BLE001 - the worker must outlive one job
            logger.exception("lazyckpt: committing %s failed unexpectedly", job.path)
            job.fail(write_error(job, "committing", exc))
        finally:
            self._complete(job)
            with self._order_lock:
                self._uncommitted.remove(job)

    def _commit(self, job: Job) -> None:
        job.wait_committable()  # written, then confirmed on a thread that mutates the tensors, or failed
        if not job.failed and job.before_commit is not None:
            try:
                job.before_commit()
            except BaseException as exc:
                job.fail(write_error(job, "before committing", exc))
        try:
            if not job.failed:
                job.publishing = True
                if job.superseded:  # a later save of this path is already there: the last save wins
                    _fs.discard(job.tmp)
                else:
                    _fs.commit(job.tmp, job.path, job.sync_parent)
        except BaseException as exc:
            job.fail(write_error(job, "committing", exc))
        finally:
            job.published = True
        if job.failed:
            _fs.discard(job.tmp)

    @staticmethod
    def supersede(final: str, jobs: list[Job]) -> None:
        """A re-entered save (``threads/reentry.py``) is about to rename its file to ``final``: mark every pending
        job to ``final`` superseded (it discards its file) and wait out one being renamed now (no lock,
        bounded). The committer sets ``publishing`` before reading ``superseded``, this the reverse."""
        mine = [j for j in jobs if j.path == final]
        for job in mine:
            job.superseded = True
        deadline = time.monotonic() + 30.0
        for job in mine:
            while job.publishing and not job.published and time.monotonic() < deadline:
                time.sleep(0.001)

    def _complete(self, job: Job) -> None:
        """Finish the handle exactly once: resolve its outcome, let the checkpointer publish it (and run
        removals queued behind it), then make it visible and hand its callbacks to the callback thread."""
        completion = job.completion
        if completion.handle.done():
            return
        try:
            error = None if job.error is None else job.described(job.error)
            completion.resolve(None if job.failed else job.stats(time.perf_counter()), error)
        except BaseException as exc:  # noqa: BLE001 - stats of a committed file; keep the file, say why
            logger.exception("lazyckpt: stats of %s failed", job.path)
            completion.resolve(None, write_error(job, "finishing", exc))
        try:
            self._on_done(job)  # the checkpointer publishes the report: before the handle is done
        except BaseException:  # noqa: BLE001 - the handle must complete regardless
            logger.exception("lazyckpt: bookkeeping after %s failed", job.path)
        completion.complete(self.callbacks)
        job.sources.clear()
        job.lazy.clear()
        job.live_pieces.clear()

    def owns_current_thread(self) -> bool:
        return self._worker.owns_current_thread() or self.callbacks.owns_current_thread()

    def stop(self) -> None:
        self._worker.stop()
        self.callbacks.stop()
