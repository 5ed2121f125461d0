"""SaveHandle and SaveStats: what ``save()`` returns, and what a finished save reports."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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


class SaveHandle:
    """A pending save. Thread-safe; every method may be called from any thread.

    ``wait_staged()`` returns once the host copies are done: from then on the caller may change the
    saved tensors freely. ``wait()`` returns once the file is durable at its final path and raises
    the save's error (typed, cause chained) if it failed; an error raised here is not raised again
    by the checkpointer's ``wait()``, ``save()`` or ``close()``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._staged = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stats: SaveStats | None = None
        self._callbacks: list[Callable[[SaveHandle], object]] = []
        self.reported = False  # the error reached the user already
        self._settle: Callable[[float | None], None] | None = None  # set by the job: copy what is live
        self._confirm: Callable[[float | None], None] | None = None  # set by the job: check versions here

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done.is_set() else "pending"
        return f"<SaveHandle {self.path!r} {state}>"

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._done.is_set()

    def staged(self) -> bool:
        """True once the host copies are done (or the save failed)."""
        return self._staged.is_set()

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
        """Block until the save is durable; return its stats or raise its error."""
        if not self._wait_done(timeout):
            raise TimeoutError(f"save to {self.path} not durable after {timeout} s")
        if self._error is not None:
            self.reported = True
            raise self._error
        assert self._stats is not None
        return self._stats

    def exception(self) -> BaseException | None:
        """The save's error once done (None while pending or on success)."""
        return self._error if self._done.is_set() else None

    @property
    def stats(self) -> SaveStats | None:
        return self._stats

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once the save is done (at once if it is); exceptions are logged."""
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

    def _finish(self, stats: SaveStats | None, error: BaseException | None) -> None:
        with self._lock:
            self._stats, self._error = stats, error
            self._staged.set()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)


def _call(fn: Callable[[SaveHandle], object], handle: SaveHandle) -> None:
    try:
        fn(handle)
    except Exception:
        logger.exception("lazyckpt: done-callback %r for %s raised", fn, handle.path)
