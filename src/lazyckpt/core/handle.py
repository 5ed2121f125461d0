"""SaveHandle and SaveStats: what ``save()`` returns, and what a finished save reports."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.core.report import Report
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

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


@dataclass(eq=False)
class Outcome:
    """What one save's ``SaveHandle`` shows and its ``Completion`` changes. ``settle`` / ``confirm``: the
    producer's hooks a waiting thread runs first (see ``Job.confirm``)."""

    staged: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    lock: reentry.Lock = field(default_factory=reentry.Lock)
    stats: SaveStats | None = None
    error: BaseException | None = None
    report: Report | None = None  # the error, until someone has seen it
    seen_by_caller: bool = False  # save() itself raised for this save (KeyboardInterrupt)
    callbacks: list[Callable[[SaveHandle], object]] = field(default_factory=list)
    settle: Callable[[float | None], None] | None = None
    confirm: Callable[[float | None], None] | None = None


class SaveHandle:
    """A pending save. Thread-safe; every method may be called from any thread.

    ``wait_staged()`` returns once the host copies are done: the caller may then change the saved tensors.
    ``wait()`` returns once the file is durable at its final path, or raises the save's error; an error
    raised here is not raised again by the checkpointer's ``wait()``, ``save()`` or ``close()``. A URL
    save's handle adds ``local()`` / ``wait_local()`` for the local copy; ``done()`` / ``wait()`` then
    mean complete in the store. Done-callbacks run on a lazyckpt callback thread, never on the committer,
    so a callback may wait for other saves, ``remove()`` or ``close()``.
    """

    def __init__(self, path: str, outcome: Outcome | None = None) -> None:
        self.path = path
        self._o = Outcome() if outcome is None else outcome

    def __repr__(self) -> str:
        state = "failed" if self._o.error else "done" if self._o.done.is_set() else "pending"
        return f"<SaveHandle {self.path!r} {state}>"

    @property
    def reported(self) -> bool:
        """True once the save's error reached someone (this handle or the checkpointer)."""
        return self._o.report is not None and self._o.report.claimed

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._o.done.is_set()

    def staged(self) -> bool:
        """True once the host copies are done (or the save failed)."""
        return self._o.staged.is_set()

    def local(self) -> bool:
        """True once the file is committed on local disk (or the save failed). For a local save
        the same as ``done()``; for a URL save, before the upload ends."""
        return self._o.done.is_set()

    def wait_local(self, timeout: float | None = None) -> SaveStats:
        """Block until the local file is committed; return its stats or raise its error. For a
        local save the same as ``wait()``."""
        return self.wait(timeout)

    @reentry.region
    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the live tensors are no longer read; raises ``TimeoutError`` on timeout. Tensors
        still to be written from their own memory are copied now on this thread, so this never waits
        for storage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        settle = self._o.settle
        if settle is not None:  # also once staged: it confirms the save on this thread (Job.confirm)
            settle(timeout)
        if not self._o.staged.wait(_left(deadline)):
            raise TimeoutError(f"save to {self.path} not staged after {timeout} s")

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the save is durable (``timeout=None``: for ever; else ``TimeoutError``);
        return its stats or raise its error."""
        if not self.wait_done(timeout):
            raise TimeoutError(f"save to {self.path} not durable after {timeout} s")
        if self._o.report is not None:
            self._o.report.claim()
            raise self._o.report.error
        if self._o.stats is None:  # cannot happen: a handle is done with stats or an error
            raise RuntimeError(f"lazyckpt: save to {self.path} finished without stats or error")
        return self._o.stats

    def exception(self, timeout: float | None = 0) -> BaseException | None:
        """The save's error (None on success); does not count as seen, so the checkpointer still
        reports it once. ``timeout=0`` (default): do not wait, None while pending; otherwise wait
        that many seconds (``None``: for ever), then ``TimeoutError`` if still pending."""
        if timeout != 0 and not self.wait_done(timeout):
            raise TimeoutError(f"save to {self.path} not done after {timeout} s")
        return self._o.error if self._o.done.is_set() else None

    @property
    def stats(self) -> SaveStats | None:
        return self._o.stats

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once the save is done (at once, on this thread, if it is); exceptions
        are logged. Callbacks of one checkpointer run one at a time, in commit order."""
        with self._o.lock:
            if not self._o.done.is_set():
                self._o.callbacks.append(fn)
                return
        _call(fn, self)

    @reentry.region
    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until the save is committed or failed, without raising its error: True then, False when
        ``timeout`` runs out. Confirms the save on this thread first (``Job.confirm``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        confirm(self, timeout)
        return self._o.done.wait(_left(deadline))


# -- the producers' view of a handle they did not make: functions, not methods users see.


def _outcome(handle: SaveHandle) -> Outcome:
    return handle._o


def confirm(handle: SaveHandle, timeout: float | None = None) -> None:
    """Confirm ``handle``'s save on this thread once its copies are over (waiting for them at most
    ``timeout``); nothing once it is done. Every wait runs it first."""
    o = _outcome(handle)
    if o.confirm is not None and not o.done.is_set():
        o.confirm(timeout)


def wait_finished(handle: SaveHandle, timeout: float | None = None) -> bool:
    """For producer threads: wait for ``handle``'s outcome WITHOUT confirming (only a thread that mutates
    the tensors may confirm)."""
    return _outcome(handle).done.wait(timeout)


def finished_report(handle: SaveHandle) -> Report | None:
    """The failed save's ``Report`` (claimed once, shared with the ledger), once done; else None."""
    o = _outcome(handle)
    return o.report if o.done.is_set() else None


def claim_error_of(handles: Iterable[SaveHandle], error: BaseException) -> bool:
    """Whether ``error`` is the failure of one of ``handles`` (then claimed: the checkpointer no longer raises it;
    the handle's ``wait()`` still does). For a caller that reports its handles' errors itself."""
    # the report is set (``resolve``) before the ledger has it (``finish``): matched before the handle is done too
    reports = [r for h in handles if (r := _outcome(h).report) is not None and r.error is error]
    for report in reports:
        report.claim()
    return bool(reports)


class Completion:
    """The producer's side of one save: the only way to change its handle's state. Protocol: ``staged()``
    when the host copies are done; then ``finish``: resolve, publish the error (before the handle is
    visibly done), make it visible, run the done-callbacks (on the callback thread when given)."""

    def __init__(self, path: str, handle_type: type[SaveHandle] | None = None, **handle_args: Any) -> None:
        """``handle_type``: a ``SaveHandle`` subclass taking ``(path, outcome=..., **handle_args)``."""
        self._o = Outcome()
        self.handle = (handle_type or SaveHandle)(path, outcome=self._o, **handle_args)

    @property
    def report(self) -> Report | None:
        """The failed save's report, once resolved."""
        return self._o.report

    def bind(
        self,
        settle: Callable[[float | None], None] | None = None,
        confirm: Callable[[float | None], None] | None = None,
    ) -> None:
        """Hooks a waiting thread runs first (``wait_staged``: ``settle``; every wait: ``confirm``)."""
        self._o.settle, self._o.confirm = settle, confirm

    def staged(self) -> None:
        self._o.staged.set()

    def caller_saw_error(self) -> None:
        """``save()`` itself raised for this save (an interrupt): its error is not reported again."""
        self._o.seen_by_caller = True

    def resolve(self, stats: SaveStats | None, error: BaseException | None) -> Report | None:
        """Fix the outcome (not yet visible as done); its report is to be published before ``complete``."""
        self._o.stats, self._o.error = stats, error
        self._o.report = None if error is None else Report(error)
        if self._o.report is not None and self._o.seen_by_caller:
            self._o.report.claim()  # the caller already got an exception for it (save() interrupted)
        return self._o.report

    def adopt(self, other: SaveHandle) -> None:
        """Resolve as ``other``'s finished outcome (the same report: claimed once)."""
        self._o.stats, self._o.error, self._o.report = other.stats, other.exception(), finished_report(other)

    def complete(self, runner: CallbackRunner | None = None) -> None:
        """Make the outcome visible; the done-callbacks go to ``runner`` (or run here)."""
        with self._o.lock:
            self._o.staged.set()
            self._o.done.set()
            callbacks, self._o.callbacks = self._o.callbacks, []
            self._o.settle = self._o.confirm = None
        if runner is not None:
            runner.submit(self.handle, callbacks)
        else:
            for fn in callbacks:
                _call(fn, self.handle)

    def finish(
        self,
        stats: SaveStats | None,
        error: BaseException | None,
        publish: Callable[[Report], None] | None = None,
        runner: CallbackRunner | None = None,
    ) -> None:
        """The whole protocol: resolve, publish the error, complete."""
        report = self.resolve(stats, error)
        if report is not None and publish is not None:
            publish(report)
        self.complete(runner)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _run_callbacks(item: tuple[SaveHandle, list[Callable[[SaveHandle], object]]]) -> None:
    for fn in item[1]:
        _call(fn, item[0])


def _call(fn: Callable[[SaveHandle], object], handle: SaveHandle) -> None:
    # BaseException too: a SystemExit from a callback must not end a lazyckpt thread.
    try:
        fn(handle)
    except BaseException:  # noqa: BLE001 - nobody to raise to; logged
        logger.exception("lazyckpt: done-callback %r for %s raised", fn, handle.path)


class CallbackRunner:
    """One daemon thread, started on first use, that runs done-callbacks in commit order (inline when no
    thread can start). Callbacks may block on other saves, so never on the committer."""

    def __init__(self) -> None:
        self._worker: Worker[tuple[SaveHandle, list[Callable[[SaveHandle], object]]]] = Worker(
            "lazyckpt-callbacks", _run_callbacks, lazy=True
        )

    def submit(self, handle: SaveHandle, callbacks: list[Callable[[SaveHandle], object]]) -> None:
        if callbacks and not self._worker.submit((handle, callbacks)):
            for fn in callbacks:
                _call(fn, handle)

    def owns_current_thread(self) -> bool:
        return self._worker.owns_current_thread()

    def stop(self) -> None:
        """Run what is queued, then end the thread; from a callback, do not wait for itself."""
        self._worker.stop()


def done_handle(stats: SaveStats) -> SaveHandle:
    """The handle of a save that is over when it is made (a skipped save; a save written at once)."""
    completion = Completion(stats.path)
    completion.finish(stats, None)
    return completion.handle
