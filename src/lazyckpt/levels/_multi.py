"""``MultiLevel``: the multi-level saver behind ``LazyCheckpointer(levels=...).save(obj, step=)``.

Data flow of one ``save(obj, step=s)`` (see docs/ARCHITECTURE.md, "Multi-level checkpoints"); a
folder saver (``MultiLevel(..., folder=True).save_with(step, produce)``: Accelerate's ``save_state``
folders) goes the same way, ``produce(path)`` making the fastest level's folder checkpoint:

    caller thread: due levels = those with s % every == 0; admit each slower due level (its backlog
        bound: wait, or skip that level's copy with on_backpressure="skip"); pin the source;
        ONE core save ``LazyCheckpointer.save(obj, <fastest due level>/step-s.pt)`` (the only
        device-to-host staging; a URL fastest level saves to a local staging file instead)
    lazyckpt-level-<i> (one thread per slower level, FIFO): waits for the source save's handle,
        copies the committed file or folder (``_copy.copy_file`` / ``copy_tree``; a URL level:
        ``RemoteTier.transfer`` / ``_copy.upload_folder``),
        unpins the source, applies level i's retention, ends its part of the handle
    core callback thread (the source save's done-callback): the source level's retention

Ownership: this object owns the level threads, their queues, the pins, the multi-level error
ledger, a callback runner for the handles it finishes, its remote tier (URL levels) and its staging
folder. The core checkpointer is used through its public methods only (``save``, ``remove``,
``wait_staged``, ``raise_errors``).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lazyckpt.core.handle import CallbackRunner, Completion, Outcome, SaveHandle, SaveStats
from lazyckpt.core.report import ErrorLedger, Report
from lazyckpt.core.workers import Worker
from lazyckpt.options import CheckpointerOptions
from lazyckpt.storage import fs as _fs
from lazyckpt.storage import remote as _remote

from ..errors import BackpressureWarning, SaveRefusedError
from . import _copy
from ._handle import SOURCE, LevelsHandle, Parts
from ._level import Level, LevelError, list_steps


def check_levels(levels: tuple[Any, ...]) -> None:
    """``TypeError`` unless ``levels`` is a non-empty sequence of ``Level``."""
    if not levels or not all(isinstance(lv, Level) for lv in levels):
        raise TypeError("levels must be a non-empty list of lazyckpt.Level")


class Saver(Protocol):
    """What the multi-level saver needs of its ``LazyCheckpointer`` (no import of the facade)."""

    def save(self, obj: Any, path: str) -> SaveHandle: ...
    def raise_errors(self) -> None: ...
    def remove(self, path: str) -> Any: ...
    def wait_staged(self, timeout: float | None = None) -> None: ...


logger = logging.getLogger(__name__)

WARN_AFTER_S = 0.5  # a save that waited longer than this for a level's backlog warns


@dataclass(eq=False)
class _Copy:
    """One slower level's copy of one step, fed by ``source`` (a committed file once it is done)."""

    level: int
    step: int
    src: str
    source: SaveHandle
    source_done: threading.Event
    parts: Parts
    feed: _Feed


@dataclass(eq=False)
class _Feed:
    """The source file of one save and the copies still reading it (pinned while any is)."""

    level: int | None  # the level it belongs to; None: a staging file, deleted after the copies
    step: int
    path: str
    readers: int


class _Worker:
    """One slower level's thread (FIFO) and its admitted copies not yet finished (owner's lock)."""

    def __init__(self, owner: MultiLevel, index: int) -> None:
        self.pending = 0
        self.thread: Worker[_Copy] = Worker(f"lazyckpt-level-{index}", lambda item: owner.run_copy(self, item))


class MultiLevel:
    """The multi-level saver of one checkpointer: file checkpoints (``folder=False``,
    ``step-<n>.pt``) or folder checkpoints (``folder=True``, ``step-<n>``)."""

    def __init__(
        self, ckpt: Saver, levels: tuple[Level, ...], options: CheckpointerOptions, *, folder: bool = False
    ) -> None:
        check_levels(levels)
        if len({lv.path for lv in levels}) != len(levels):
            raise ValueError("two levels share a path; give each level its own folder")
        self.ckpt = ckpt
        self.levels = levels
        self.options = options
        self.folder = folder
        self.skipped_copies = 0
        self._cond = threading.Condition()
        self._ledger = ErrorLedger()
        self._callbacks = CallbackRunner()
        self._workers: dict[int, _Worker] = {}
        self._pins: Counter[tuple[int, int]] = Counter()  # (level, step) -> copies reading that file
        self._removing: set[str] = set()
        self._first: dict[int, int] = {}  # level -> first step this checkpointer saved there
        self._mine: dict[int, set[int]] = {i: set() for i in range(len(levels))}
        self._open: set[LevelsHandle] = set()
        self._tier: _remote.RemoteTier | None = None
        self._staging: str | None = None
        self._counter = itertools.count()
        self._memory_checked = False
        self._closed = False
        for level in levels:
            if not level.is_url:
                os.makedirs(level.path, exist_ok=True)
                _fs.cleanup_temporaries(level.path)  # copies a killed process left half-done

    # -- caller side ------------------------------------------------------------------------------

    def save(self, obj: Any, step: int) -> SaveHandle:
        """``obj`` to every level due at ``step``: one core save of ``obj`` (file checkpoints)."""
        return self.save_with(step, lambda path: self.ckpt.save(obj, path), nbytes=lambda: _copy.tensor_bytes(obj))

    def save_with(
        self, step: int, produce: Callable[[str], SaveHandle], nbytes: Callable[[], int] | None = None
    ) -> SaveHandle:
        """Save ``step`` to every level due at it: ``produce(path)`` saves the checkpoint (a file,
        or with ``folder=True`` a folder) at the fastest due level's ``path`` (or a local staging
        path when that level is a URL) and returns its handle, done once it is complete there;
        slower levels copy it from there. ``nbytes()``: the checkpoint's size, for the memory
        statement at the first save (None: not checked)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SaveRefusedError(f"step must be an int >= 0, got {step!r}")
        t0 = time.perf_counter()
        self.ckpt.raise_errors()  # an unseen error of an earlier save (any level) first, as save() does
        due = [i for i, lv in enumerate(self.levels) if lv.due(step)]
        if not due:
            return _not_due(step, t0)
        if not self._memory_checked and nbytes is not None:
            self._memory_checked = True
            _copy.check_memory(self.levels, nbytes())
        first = due[0] if not self.levels[due[0]].is_url else None
        targets = due[1:] if first is not None else due
        admitted = [i for i in targets if self._admit(i, step)]
        src = self.path(first, step) if first is not None else self._staging_path(step)
        feed = _Feed(first, step, src, len(admitted))
        with self._cond:
            for i in ([] if first is None else [first]) + admitted:
                self._first.setdefault(i, step)
                self._mine[i].add(step)
            if first is not None and admitted:
                self._pins[(first, step)] += 1
        try:
            source = produce(src)
        except BaseException:
            self._unadmit(admitted, feed)
            raise
        part = SOURCE if first is None else first
        parts = Parts(self.path(due[0], step), step, source, [part, *admitted], self, t0)
        handle = parts.handle
        handle.levels_skipped = [i for i in targets if i not in admitted]
        with self._cond:
            self._open.add(handle)
        source_done = threading.Event()
        for i in admitted:
            self._workers[i].thread.submit(_Copy(i, step, src, source, source_done, parts, feed))

        def on_source(h: SaveHandle) -> None:  # core callback thread (or here, if already done)
            source_done.set()
            written = h.exception() is None and not (h.stats is not None and h.stats.skipped)
            if first is not None and written:
                self._retain(first)
            if not admitted and first is None:
                self._discard_staging(src)
            parts.part_done(part, written=written)

        source.add_done_callback(on_source)
        return handle

    def path(self, index: int, step: int) -> str:
        """Level ``index``'s checkpoint of ``step``: its file, or its folder (``folder=True``)."""
        level = self.levels[index]
        return level.folder(step) if self.folder else level.file(step)

    def take_errors(self) -> list[BaseException]:
        return self._ledger.take()

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every multi-level save (confirming their source saves on this thread);
        ``TimeoutError`` when they are not all done within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            handles = list(self._open)
        for handle in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            handle.exception(timeout=left)

    def close(self) -> None:
        """Stop the level threads (after ``drain``), the callback thread, the tier; remove staging."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers.values():
            worker.thread.stop()
        self._callbacks.stop()
        if self._tier is not None:
            self._tier.close()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    # -- handle side ------------------------------------------------------------------------------

    def publish(self, report: Report) -> None:
        self._ledger.publish(report)

    def forget(self, handle: LevelsHandle) -> None:
        with self._cond:
            self._open.discard(handle)

    @property
    def callbacks(self) -> CallbackRunner:
        return self._callbacks

    # -- level threads ----------------------------------------------------------------------------

    def run_copy(self, worker: _Worker, item: _Copy) -> None:
        try:
            self._promote(item)
        except BaseException:  # noqa: BLE001 - a bug: the handle must still end
            logger.exception("lazyckpt: level %d copy of step %d failed unexpectedly", item.level, item.step)
            item.parts.part_done(item.level, written=False)
        finally:
            with self._cond:
                worker.pending -= 1
                self._cond.notify_all()

    def _promote(self, item: _Copy) -> None:
        item.source_done.wait()  # always set: the engine ends every save it accepted
        source = item.source
        written = source.exception() is None and not (source.stats is not None and source.stats.skipped)
        error: LevelError | None = None
        if written:
            error = self._copy_to(item.level, item.step, item.src)
        self._release(item.feed)
        if written and error is None:
            self._retain(item.level)
        item.parts.part_done(item.level, error, written=written and error is None)

    def _copy_to(self, index: int, step: int, src: str) -> LevelError | None:
        level = self.levels[index]
        dst = self.path(index, step)
        try:
            if level.is_url and self.folder:
                _copy.upload_folder(self._remote_tier(), src, dst)
            elif level.is_url:
                tier = self._remote_tier()
                tier.transfer(dst, *tier.resolve(dst), src)
            elif self.folder:
                _copy.copy_tree(src, dst, self.options.fsync)
            else:
                _copy.copy_file(src, dst, self.options.fsync)
        except Exception as exc:
            code = getattr(exc, "errno", None)
            err = LevelError(
                f"lazyckpt: level {index} ({level.path}): copy of step {step} to {dst} failed: {exc}",
                index, level.path, step, dst, errno=code if isinstance(code, int) else None,
            )  # fmt: skip
            err.__cause__ = exc
            logger.debug("lazyckpt: %s", err)
            return err
        return None

    def _release(self, feed: _Feed) -> None:
        with self._cond:
            feed.readers -= 1
            last = feed.readers == 0
            if feed.level is not None:
                self._pins[(feed.level, feed.step)] -= 1
                if self._pins[(feed.level, feed.step)] <= 0:
                    del self._pins[(feed.level, feed.step)]
        if not last:
            return
        if feed.level is None:
            self._discard_staging(feed.path)
        else:  # its retention may have skipped this file while it was pinned
            self._retain(feed.level)

    # -- retention --------------------------------------------------------------------------------

    def _retain(self, index: int) -> None:
        """Remove level ``index``'s checkpoints beyond its ``keep`` newest, and those of steps after
        the first this checkpointer saved there that it did not save (a timeline abandoned by a
        rollback), skipping pinned files. Runs right after a copy was committed at that level, so
        its newest complete checkpoint is never among them. Deletions go through
        ``LazyCheckpointer.remove`` (local: renamed away now, freed on its remover thread) or the
        remote tier (a URL level: on its own level thread)."""
        level = self.levels[index]
        try:
            steps = list_steps(level, self.options.storage_options, folder=self.folder)
        except Exception as exc:
            logger.warning("lazyckpt: level %d (%s): cannot list it for retention: %s", index, level.path, exc)
            return
        with self._cond:
            first, mine = self._first.get(index), self._mine[index]
            stale = {s for s in steps if first is not None and s > first and s not in mine}
            live = sorted(s for s in steps if s not in stale)
            old = set(live[: -level.keep]) if level.keep is not None else set()
            victims = [
                steps[s] for s in sorted(stale | old)
                if (index, s) not in self._pins and steps[s] not in self._removing
            ]  # fmt: skip
            self._removing.update(victims)
        for path in victims:
            self._delete(index, path)

    def _delete(self, index: int, path: str) -> None:
        try:
            if self.levels[index].is_url:
                tier = self._remote_tier()
                tier.delete_object(path, *tier.resolve(path))
            else:
                self.ckpt.remove(path)
        except FileNotFoundError:
            pass
        except Exception as exc:
            level = self.levels[index]
            err = LevelError(f"lazyckpt: level {index} ({level.path}): could not remove {path}: {exc}",
                             index, level.path, -1, path)  # fmt: skip
            err.__cause__ = exc
            self._ledger.publish(Report(err))
        finally:
            with self._cond:
                self._removing.discard(path)

    # -- admission --------------------------------------------------------------------------------

    def _admit(self, index: int, step: int) -> bool:
        """Reserve a place in level ``index``'s backlog; at the bound, skip it (``"skip"``) or wait."""
        level = self.levels[index]
        with self._cond:
            worker = self._workers.get(index)
            if worker is None:
                worker = self._workers[index] = _Worker(self, index)
            if worker.pending < level.backlog:
                worker.pending += 1
                return True
            pending = worker.pending
        if self.options.on_backpressure == "skip":
            self.skipped_copies += 1
            warnings.warn(
                f"lazyckpt: skipped level {index} ({level.path}) for step {step}: {pending} earlier copies to it "
                f"still waiting, backlog bound {level.backlog} ({self.skipped_copies} level copies skipped so far). "
                "The faster levels still save this step. Save to it less often, or raise its backlog.",
                BackpressureWarning,
                stacklevel=4,
            )
            return False
        t0 = time.monotonic()
        self.ckpt.wait_staged()  # confirms the pending source saves here: their copies can then run
        with self._cond:
            while worker.pending >= level.backlog:
                self._cond.wait(1.0)  # the level thread ends every copy it holds
            worker.pending += 1
        waited = time.monotonic() - t0
        if waited > WARN_AFTER_S:
            warnings.warn(
                f"lazyckpt: level {index} ({level.path}) falls behind: save(step={step}) waited {waited:.2f} s for "
                f"{pending} earlier copies to it (backlog bound {level.backlog}); training slows to that level's "
                "speed. Save to it less often, raise its backlog, or use on_backpressure='skip'.",
                BackpressureWarning,
                stacklevel=4,
            )
        return True

    def _unadmit(self, admitted: list[int], feed: _Feed) -> None:
        with self._cond:
            for i in admitted:
                self._workers[i].pending -= 1
            if feed.level is not None and admitted:
                del self._pins[(feed.level, feed.step)]
            self._cond.notify_all()

    # -- resources --------------------------------------------------------------------------------

    def _remote_tier(self) -> _remote.RemoteTier:
        with self._cond:
            if self._tier is None:
                self._tier = _remote.RemoteTier(self.options, self._ledger.publish, self._callbacks)
            return self._tier

    def _staging_path(self, step: int) -> str:
        with self._cond:
            if self._staging is None:
                base = self.options.local_dir
                if base is not None:
                    os.makedirs(base, exist_ok=True)
                self._staging = tempfile.mkdtemp(prefix="lazyckpt-levels-", dir=base)
            suffix = "" if self.folder else ".pt"
            return os.path.join(self._staging, f"{next(self._counter):06d}-step-{step:08d}{suffix}")

    def _discard_staging(self, path: str) -> None:
        if self.folder:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            _fs.unlink(path)
        except OSError:
            pass


class _NotDue(SaveHandle):
    """No level is due at ``step``: a finished handle whose stats say skipped."""

    def __init__(self, path: str, outcome: Outcome | None = None, *, step: int) -> None:
        super().__init__(path, outcome)
        self.step = step


def _not_due(step: int, t0: float) -> SaveHandle:
    completion = Completion(f"step {step}: no level due", _NotDue, step=step)
    path = completion.handle.path
    completion.finish(SaveStats(path, 0, 0, time.perf_counter() - t0, 0.0, 0.0, 0.0, 0.0, 0.0, skipped=True), None)
    return completion.handle
