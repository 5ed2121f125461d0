"""``LevelsHandle``: the handle ``save(obj, step=)`` returns, done when every due level has its copy.

``wait()`` raises the source save's error, else the first ``LevelError`` (the others as notes); the
report is published to the saver's ledger before the handle reads as done.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from lazyckpt.core.handle import CallbackRunner, Completion, Outcome, SaveHandle, SaveStats, wait_finished
from lazyckpt.core.report import Report
from lazyckpt.threads import reentry


class Owner(Protocol):
    """What a ``Parts`` needs of the multi-level saver that made it."""

    @property
    def callbacks(self) -> CallbackRunner: ...

    def publish(self, report: Report) -> None: ...
    def forget(self, handle: LevelsHandle) -> None: ...


SOURCE = -1  # the part key of a staging file that is no level's copy


class LevelsHandle(SaveHandle):
    """A multi-level save. ``step``; ``levels_done``: level indices holding a complete copy once
    done; ``levels_skipped``: due levels whose copy was skipped. ``staged`` / ``wait_staged`` /
    ``local`` / ``wait_local`` report the fastest level's save."""

    def __init__(self, path: str, outcome: Outcome | None = None, *, step: int, source: SaveHandle) -> None:
        super().__init__(path, outcome)
        self.step = step
        self.levels_done: list[int] = []
        self.levels_skipped: list[int] = []
        self._source = source

    def staged(self) -> bool:
        return self._source.staged()

    def wait_staged(self, timeout: float | None = None) -> None:
        self._source.wait_staged(timeout)

    def local(self) -> bool:
        return self._source.done()

    def wait_local(self, timeout: float | None = None) -> SaveStats:
        return self._source.wait(timeout)

    def wait_done(self, timeout: float | None = None) -> bool:
        """Confirm the source save (it commits only once a caller's thread confirms it), then wait
        for every level."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.done():
            try:
                self._source.wait_staged(timeout)
            except TimeoutError:
                return False
        return wait_finished(self, None if deadline is None else max(0.0, deadline - time.monotonic()))


class Parts:
    """The producer's side of one ``LevelsHandle``: one part per admitted level (or ``SOURCE``); the
    last part to end finishes the handle."""

    def __init__(self, path: str, step: int, source: SaveHandle, parts: list[int], owner: Owner, t0: float):
        self.completion = Completion(path, LevelsHandle, step=step, source=source)
        self.handle: LevelsHandle = self.completion.handle  # type: ignore[assignment]
        self._source = source
        self._parts = set(parts)
        self._failures: dict[int, BaseException] = {}
        self._owner = owner
        self._t0 = t0
        self._lock = reentry.Lock()

    def part_done(self, part: int, error: BaseException | None = None, written: bool = True) -> None:
        """A part ended (any lazyckpt thread): ``error`` a LevelError; ``written`` False when no copy
        was made (source failed or skipped)."""
        with self._lock:
            self._parts.discard(part)
            if error is not None:
                self._failures[part] = error
            elif written and part != SOURCE:
                self.handle.levels_done.append(part)
            last = not self._parts
        if last:
            self._finish_all()

    def _finish_all(self) -> None:
        if self._source.exception() is not None:
            self.completion.adopt(self._source)  # the core published that report: claimed once
        else:
            stats = self._source.stats
            if stats is not None:
                stats = dataclasses.replace(stats, path=self.handle.path, durable_s=time.perf_counter() - self._t0)
            error = None
            failures = [self._failures[k] for k in sorted(self._failures)]
            if failures:
                error = failures[0]
                if hasattr(error, "add_note"):  # Python >= 3.11
                    for other in failures[1:]:
                        error.add_note(f"lazyckpt: also failed: {other}")
            report = self.completion.resolve(stats, error)
            if report is not None:
                self._owner.publish(report)
        self.handle.levels_done.sort()
        self._owner.forget(self.handle)
        self.completion.complete(self._owner.callbacks)


class NotDue(SaveHandle):
    """No level is due at ``step``: a finished, skipped handle."""

    def __init__(self, path: str, outcome: Outcome | None = None, *, step: int) -> None:
        super().__init__(path, outcome)
        self.step = step


def not_due(step: int, t0: float) -> SaveHandle:
    """The handle of ``save(obj, step=n)`` when no level is due at ``step``."""
    completion = Completion(f"step {step}: no level due", NotDue, step=step)
    skipped = SaveStats(completion.handle.path, 0, 0, time.perf_counter() - t0, 0.0, 0.0, 0.0, 0.0, 0.0, skipped=True)
    completion.finish(skipped, None)
    return completion.handle
