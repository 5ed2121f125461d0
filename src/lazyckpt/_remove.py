"""Deletion off the training thread: rename now, unlink later.

Deleting a large fsynced file is slow on some filesystems (ext4 mounted with ``discard`` frees and
trims every extent inside ``unlink``: ~50 ms per GB here), and ModelCheckpoint's ``save_top_k`` or
Accelerate's ``total_limit`` delete one old checkpoint per save. ``Remover.remove`` renames the
path to a lazyckpt temporary name (``.<name>.lazyckpt-<host>-<pid>-<n>.tmp``, so ``cleanup_temporaries``
removes it if the process dies first) in the same directory or a given one on the same filesystem;
the final name is free the moment ``remove`` returns. A daemon thread then unlinks (files) or
``rmtree``s (folders) it. Symlinks are unlinked at once (nothing to free).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

from . import _commit

logger = logging.getLogger(__name__)


class RemovalFuture(Future):  # type: ignore[type-arg]
    """A removal's future: once its error was fetched through it, ``wait()`` does not raise it again."""

    reported = False

    def result(self, timeout: float | None = None) -> None:
        try:
            return super().result(timeout)
        except BaseException:
            if self.done():
                self.reported = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        self.reported = True
        return exc


class Remover:
    """One daemon thread deleting renamed paths in order; ``wait()`` drains it."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[str, RemovalFuture] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: list[RemovalFuture] = []
        self._stopped = False

    def remove(self, path: str, trash_dir: str | None = None) -> RemovalFuture:
        """Take ``path`` away from its name now; free its space in the background."""
        done = RemovalFuture()
        if os.path.islink(path) or not os.path.lexists(path):
            os.unlink(path)  # a symlink; or raise FileNotFoundError as os.remove does
            done.set_result(None)
            return done
        trash = _commit.temporary_path(os.path.join(trash_dir or os.path.dirname(path), os.path.basename(path)))
        try:
            os.rename(path, trash)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EBUSY):
                raise
            _delete(path)  # another filesystem (or a mount point): delete in place, now
            done.set_result(None)
            return done
        with self._lock:
            if self._stopped:  # raced with close(): no thread any more, delete here
                _delete(trash)
                done.set_result(None)
                return done
            # keep failed ones until wait() reports them
            self._pending = [f for f in self._pending if not f.done() or Future.exception(f) is not None]
            self._pending.append(done)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lazyckpt-remover", daemon=True)
                self._thread.start()
            self._q.put((trash, done))
        return done

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued deletion ran; raise the first failure nobody fetched from its future."""
        with self._lock:
            pending = list(self._pending)
        done, not_done = futures_wait(pending, timeout)
        with self._lock:
            self._pending = [f for f in self._pending if f not in done]
        errors = []
        for f in pending:
            if f in done:
                if not f.reported:
                    errors.append(Future.exception(f))
                f.reported = True
        if not_done:
            raise TimeoutError(f"{len(not_done)} deletion(s) not done after {timeout} s")
        for exc in errors:
            if exc is not None:
                raise exc

    def stop(self) -> None:
        """Let the thread finish what is queued (the sentinel comes last), then join it."""
        with self._lock:
            self._stopped = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            trash, done = item
            try:
                _delete(trash)
            except BaseException as exc:  # noqa: BLE001 - reported through the future
                logger.warning("lazyckpt: could not delete %s: %s", trash, exc)
                done.set_exception(exc)
            else:
                done.set_result(None)


def _delete(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
