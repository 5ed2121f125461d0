"""Deletion off the training thread: rename now, unlink later.

``Remover.remove`` renames the path to a lazyckpt temporary name (``cleanup_temporaries`` removes it if the
process dies first), freeing the name at once; a daemon thread then deletes it. Symlinks are unlinked at
once. The checkpointer decides when the rename happens (now, or behind a pending save: ``OrderedRemovals``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Protocol

from lazyckpt.core.report import Report
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

logger = logging.getLogger(__name__)


class RemovalFuture(Future):  # type: ignore[type-arg]
    """A removal's future: once its error was fetched through it, ``wait()`` does not raise it again."""

    _report: Report | None = None

    @property
    def reported(self) -> bool:
        return self._report is not None and self._report.claimed

    def result(self, timeout: float | None = None) -> None:
        try:
            return super().result(timeout)
        except BaseException:
            if self.done() and self._report is not None:
                self._report.claim()
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        if self._report is not None:
            self._report.claim()
        return exc

    def fail(self, exc: BaseException, publish: Callable[[Report], None]) -> None:
        """The producer's side: publish the failure's report (claimed once: by this future's
        ``result()``/``exception()`` or by the ledger), then complete the future with it."""
        self._report = Report(exc)
        publish(self._report)  # before the future is done: whoever sees it done finds the error
        self.set_exception(exc)


class Remover:
    """One daemon thread deleting renamed paths in order; ``wait()`` drains it. A failed removal's report
    goes to ``on_failed`` before its future completes."""

    def __init__(self, on_failed: Callable[[Report], None] = lambda _r: None) -> None:
        self._on_failed = on_failed
        self._lock = reentry.Lock()
        self._pending: list[RemovalFuture] = []
        self._worker: Worker[tuple[str, RemovalFuture]] = Worker(
            "lazyckpt-remover", lambda item: self._delete_into(*item), lazy=True
        )  # one failed deletion never ends the thread: _delete_into catches everything

    def remove(
        self, path: str, trash_dir: str | None = None, salvage: Callable[[str], None] | None = None
    ) -> RemovalFuture:
        """Take ``path`` away from its name now (``FileNotFoundError`` and other ``OSError``s are
        raised here); free its space in the background. ``salvage(trash)``: called here with the
        temporary name first, to take out what is kept (a memory level's files, for reuse)."""
        done = RemovalFuture()
        trash = _take_away(path, trash_dir)
        if trash is not None and salvage is not None:
            salvage(trash)
        self._free(trash, done)
        return done

    def reserve(self) -> RemovalFuture:
        """A future for a removal that ``run`` performs later; ``wait()`` waits for it from now on."""
        done = RemovalFuture()
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(done)
        return done

    def run(self, path: str, trash_dir: str | None, done: RemovalFuture, keep: Sequence[Kept] = ()) -> None:
        """Perform a reserved removal; never raises (errors go to ``done``; a missing path is no error).
        ``keep``: pending saves into the folder ``path``: their temporaries stay at their names (the folder
        is made again around them), under their ``open_lock`` meanwhile."""
        try:
            with contextlib.ExitStack() as held:
                for saving in keep:
                    held.enter_context(saving.open_lock)
                trash = _take_away(path, trash_dir, [k.tmp for k in keep])
                if trash is not None and keep:
                    _put_back(trash, path, [k.tmp for k in keep])
        except FileNotFoundError:
            logger.debug("lazyckpt: %s is gone already; nothing to remove", path)
            done.set_result(None)
            return
        except BaseException as exc:  # noqa: BLE001 - reported through the future and the ledger
            self._fail(done, exc)
            return
        self._free(trash, done)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued deletion ran (``TimeoutError`` after ``timeout`` seconds);
        failures are reported through ``on_failed``, not here."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = futures_wait(pending, timeout)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
        if not_done:
            raise TimeoutError(f"{len(not_done)} deletion(s) not done after {timeout} s")

    def stop(self) -> None:
        """Let the thread finish what is queued, then join it."""
        self._worker.stop()

    def _free(self, trash: str | None, done: RemovalFuture) -> None:
        """Delete ``trash`` on the thread, or here when no thread will run it."""
        if trash is None:
            done.set_result(None)
            return
        with self._lock:
            if done not in self._pending:
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(done)
        if not self._worker.submit((trash, done)):
            self._delete_into(trash, done)

    def _fail(self, done: RemovalFuture, exc: BaseException) -> None:
        logger.warning("lazyckpt: could not remove: %s", exc)
        done.fail(exc, self._on_failed)

    def _delete_into(self, trash: str, done: RemovalFuture) -> None:
        try:
            _delete(trash)
        except BaseException as exc:  # noqa: BLE001 - reported through the future and the ledger
            self._fail(done, exc)
        else:
            done.set_result(None)


@dataclass(eq=False)
class _Queued:
    """A ``remove()`` waiting for the saves in ``behind`` (pending at the call) to finish."""

    path: str
    trash_dir: str | None
    future: RemovalFuture
    behind: set[Any]


class OrderedRemovals:
    """Removals queued behind pending saves to their path. The owner calls ``queue`` and ``finished`` under
    its lock on the pending saves, then ``run`` outside it, on the committer."""

    def __init__(self, remover: Remover) -> None:
        self._remover = remover
        self._queued: list[_Queued] = []

    def queue(self, path: str, trash_dir: str | None, behind: set[Any]) -> RemovalFuture:
        queued = _Queued(path, trash_dir, self._remover.reserve(), behind)
        self._queued.append(queued)
        return queued.future

    def finished(self, job: Any) -> list[_Queued]:
        """``job`` finished: the removals no longer behind any pending save."""
        ready = []
        for queued in self._queued:
            queued.behind.discard(job)
            if not queued.behind:
                ready.append(queued)
        self._queued = [q for q in self._queued if q.behind]
        return ready

    def run(self, ready: list[_Queued], pending: Sequence[Kept] = ()) -> None:
        """Run the ``ready`` removals; ``pending``: the saves still pending (those into a removed
        folder keep their temporaries there: ``Remover.run``)."""
        for queued in ready:
            inside = queued.path.rstrip(os.sep) + os.sep
            keep = [k for k in pending if k.path.startswith(inside)]
            self._remover.run(queued.path, queued.trash_dir, queued.future, keep)


class Kept(Protocol):
    """A pending save into a folder being removed (``Job``): its final and temporary names, and the
    lock its temporary is created under."""

    path: str
    tmp: str
    open_lock: reentry.Lock


def _put_back(trash: str, path: str, temporaries: list[str]) -> None:
    """Make the folder ``path`` again and move the ``temporaries`` (paths under it) back from ``trash``."""
    os.makedirs(path, exist_ok=True)
    _fs.fsync_dir(os.path.dirname(path))
    for tmp in temporaries:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        taken = os.path.join(trash, os.path.relpath(tmp, path))
        if os.path.lexists(taken):
            _fs.rename(taken, tmp)


def _take_away(path: str, trash_dir: str | None, keep: Sequence[str] = ()) -> str | None:
    """Free the name ``path`` now: rename it to a temporary (returned), or, for a symlink or across
    filesystems, delete it in place (None; the files named in ``keep`` stay). Raises
    ``FileNotFoundError`` as ``os.remove`` does."""
    if os.path.islink(path) or not os.path.lexists(path):
        _fs.unlink(path)  # a symlink; or raise FileNotFoundError
        return None
    trash = _fs.temporary_path(os.path.join(trash_dir or os.path.dirname(path), os.path.basename(path)))
    try:
        _fs.rename(path, trash)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EBUSY):
            raise
        _delete(path, keep)  # another filesystem (or a mount point): delete in place, now
        return None
    return trash


def _delete(path: str, keep: Sequence[str] = ()) -> None:
    if keep and os.path.isdir(path) and not os.path.islink(path):
        _delete_around(path, set(keep))
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        _fs.unlink(path)


def _delete_around(folder: str, keep: set[str]) -> None:
    """Delete what is in ``folder`` except the files in ``keep`` (and the folders holding them)."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            if os.path.join(root, name) not in keep:
                _fs.unlink(os.path.join(root, name))
        if root != folder and not os.listdir(root):
            os.rmdir(root)
