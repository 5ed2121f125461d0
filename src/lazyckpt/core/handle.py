"""SaveHandle and SaveStats: what ``save()`` returns, and what a finished save reports."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from lazyckpt.core.report import Report

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveStats:
    """Timings of one save, all in seconds from the moment ``save()`` was called."""

    path: str
    bytes: int  # tensor bytes staged and written
    file_bytes: int  # size of the file on disk
    blocked_s: float  # time the caller spent inside save()
    staged_s: float  # until every host copy was done
    durable_s: float  # until the file was committed (fsynced and renamed)
    write_s: float  # from the first write to the last byte of the file
    write_gbps: float  # bytes / write_s / 1e9
    guard_wait_s: float  # time optimizer steps waited for this save's copies
    skipped: bool = False  # True when on_backpressure="skip" dropped this save
    # URL saves (``path`` is the URL): durable_s is then until the object is complete in the store
    local_s: float = 0.0  # until the local copy was committed
    upload_s: float = 0.0  # the upload alone
    upload_gbps: float = 0.0  # file_bytes / upload_s / 1e9


class SaveHandle:
    """A pending save. Thread-safe; every method may be called from any thread.

    ``wait_staged()`` returns once the host copies are done: from then on the caller may change the
    saved tensors freely. ``wait()`` returns once the file is durable at its final path and raises
    the save's error (typed, cause chained) if it failed; an error raised here is not raised again
    by the checkpointer's ``wait()``, ``save()`` or ``close()``. A URL save's handle has one stage
    more (``lazyckpt.storage.remote.RemoteSaveHandle``): ``local()`` / ``wait_local()`` once the local copy
    is committed, ``done()`` / ``wait()`` once the object is complete in the store.

    Done-callbacks run on a lazyckpt callback thread, never on the committer, so a callback may wait
    for other saves (``handle.wait()``, the checkpointer's ``wait()``), ``remove()`` or ``close()``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._staged = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._report: Report | None = None  # the error, until someone has seen it
        self._seen_by_caller = False  # save() itself raised for this save (KeyboardInterrupt)
        self._stats: SaveStats | None = None
        self._callbacks: list[Callable[[SaveHandle], object]] = []
        self._settle: Callable[[float | None], None] | None = None  # set by the job: copy what is live
        self._confirm: Callable[[float | None], None] | None = None  # set by the job: check versions here

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done.is_set() else "pending"
        return f"<SaveHandle {self.path!r} {state}>"

    @property
    def reported(self) -> bool:
        """True once the save's error reached someone (this handle or the checkpointer)."""
        return self._report is not None and self._report.claimed

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._done.is_set()

    def staged(self) -> bool:
        """True once the host copies are done (or the save failed)."""
        return self._staged.is_set()

    def local(self) -> bool:
        """True once the file is committed on local disk (or the save failed). For a local save
        the same as ``done()``; for a URL save, before the upload ends."""
        return self._done.is_set()

    def wait_local(self, timeout: float | None = None) -> SaveStats:
        """Block until the local file is committed; return its stats or raise its error. For a
        local save the same as ``wait()``."""
        return self.wait(timeout)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the live tensors are no longer read; raises TimeoutError on timeout.

        Tensors still waiting to be written straight from their memory are copied now (on this
        thread), so this waits for memory copies, not for storage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        settle = self._settle
        if settle is not None:  # also once staged: it confirms the save on this thread (Job.confirm)
            settle(timeout)
        if not self._staged.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"save to {self.path} not staged after {timeout} s")

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the save is durable (``timeout=None``: for ever; else ``TimeoutError``);
        return its stats or raise its error."""
        if not self._wait_done(timeout):
            raise TimeoutError(f"save to {self.path} not durable after {timeout} s")
        if self._report is not None:
            self._report.claim()
            raise self._report.error
        if self._stats is None:  # cannot happen: a handle is done with stats or an error
            raise RuntimeError(f"lazyckpt: save to {self.path} finished without stats or error")
        return self._stats

    def exception(self, timeout: float | None = 0) -> BaseException | None:
        """The save's error (None on success); does not count as seen, so the checkpointer still
        reports it once. ``timeout=0`` (default): do not wait, None while pending; otherwise wait
        that many seconds (``None``: for ever), then ``TimeoutError`` if still pending."""
        if timeout != 0 and not self._wait_done(timeout):
            raise TimeoutError(f"save to {self.path} not done after {timeout} s")
        return self._error if self._done.is_set() else None

    @property
    def stats(self) -> SaveStats | None:
        return self._stats

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once the save is done (at once, on this thread, if it is); exceptions
        are logged. Callbacks of one checkpointer run one at a time, in commit order."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def _wait_done(self, timeout: float | None = None) -> bool:
        """Wait for the commit, which waits for the save to be confirmed by a thread that called into
        lazyckpt after the copies (see ``Job.confirm``): confirm it on this thread first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        confirm = self._confirm
        if confirm is not None and not self._done.is_set():
            confirm(timeout)
        return self._done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # -- engine side ------------------------------------------------------------------------------

    def _set_staged(self) -> None:
        self._staged.set()

    def _resolve(self, stats: SaveStats | None, error: BaseException | None) -> Report | None:
        """Fix the outcome (not yet visible as done); the report is published before ``_complete``."""
        self._stats, self._error = stats, error
        self._report = None if error is None else Report(error)
        if self._report is not None and self._seen_by_caller:
            self._report.claim()  # the caller already got an exception for it (save() interrupted)
        return self._report

    def _adopt(self, other: SaveHandle) -> None:
        """Take ``other``'s finished outcome as this handle's (the same report: claimed once)."""
        self._stats, self._error, self._report = other._stats, other._error, other._report

    def _complete(self) -> list[Callable[[SaveHandle], object]]:
        """Make the outcome visible; return the callbacks to run (off the committer)."""
        with self._lock:
            self._staged.set()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _finish(self, stats: SaveStats | None, error: BaseException | None) -> None:
        """Resolve, complete and run the callbacks here (handles no lazyckpt thread finishes)."""
        self._resolve(stats, error)
        for fn in self._complete():
            _call(fn, self)


def _call(fn: Callable[[SaveHandle], object], handle: SaveHandle) -> None:
    # BaseException too: a SystemExit from a callback must not end a lazyckpt thread.
    try:
        fn(handle)
    except BaseException:  # noqa: BLE001 - nobody to raise to; logged
        logger.exception("lazyckpt: done-callback %r for %s raised", fn, handle.path)


class CallbackRunner:
    """One daemon thread, started on first use, that runs done-callbacks in commit order.

    Callbacks may block on other saves, so they must not run on the committer that commits those.
    If the thread cannot be started (thread limits; interpreter shutdown), callbacks run inline.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[SaveHandle, list[Callable[[SaveHandle], object]]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def submit(self, handle: SaveHandle, callbacks: list[Callable[[SaveHandle], object]]) -> None:
        if not callbacks:
            return
        with self._lock:
            if not self._stopped and self._started():
                self._q.put((handle, callbacks))
                return
        for fn in callbacks:
            _call(fn, handle)

    def owns_current_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def stop(self) -> None:
        """Run what is queued, then end the thread; from a callback, do not wait for itself."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is None:
            return
        self._q.put(None)
        if thread is not threading.current_thread():
            thread.join()

    def _started(self) -> bool:
        # caller holds _lock
        if self._thread is not None:
            return True
        thread = threading.Thread(target=self._run, name="lazyckpt-callbacks", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            logger.debug("lazyckpt: no callback thread; running done-callbacks inline", exc_info=True)
            return False
        self._thread = thread
        return True

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            handle, callbacks = item
            for fn in callbacks:
                _call(fn, handle)
