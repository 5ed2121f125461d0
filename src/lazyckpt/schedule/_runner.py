"""``Runner``: the one owner of multi-level scheduling, threads and handles, behind ``LevelProducer``.

A save stages once into the fastest due level (the source); each slower due level copies it on its
own FIFO thread (``<name>-<i>``). The runner owns due levels, backlog, pins, retention, the handles
and their callback thread; producers (``MultiLevel``, ``lazyckpt.distributed``) make and commit the
source and each copy (``promote``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lazyckpt.core.handle import CallbackRunner, SaveHandle
from lazyckpt.core.remote import RemoteTier
from lazyckpt.core.report import Report
from lazyckpt.errors import SaveRefusedError
from lazyckpt.levels import Level, LevelError, Naming
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

from ._handle import SOURCE, LevelsHandle, Parts
from ._schedule import WARN_AFTER_S, Backlog, Retention, Sweep, run_sweep, sweep

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Feed:
    """One save's source at ``path`` (``level`` None: a staging path the producer discards after
    the copies) and the copies reading it."""

    level: int | None
    step: int
    path: str
    readers: int  # admitted copies still to read it
    context: Any = None  # the producer's own record of the save
    source_done: threading.Event = field(default_factory=threading.Event)
    parts: Parts | None = None
    source: SaveHandle | None = None


@dataclass(eq=False)
class Copy:
    """Level ``level``'s copy of a save's source, run on that level's thread."""

    level: int
    feed: Feed


class LevelProducer(Protocol):
    """What a runner needs of the producer that stages and commits."""

    def promote(self, index: int, feed: Feed) -> LevelError | None:
        """Level thread: copy ``feed``'s committed source to level ``index`` and commit it; its error."""

    def ended(self, index: int, feed: Feed) -> None:
        """Level ``index``'s item of ``feed`` ended (after ``promote``, or without it)."""

    def run(self, item: Any) -> None:
        """A producer's own item on a level thread (``Runner.submit``)."""

    def discard(self, path: str) -> None:
        """A staging source (``Feed.level`` None) that no copy reads any more."""

    def remove(self, path: str) -> Any: ...
    def remote_tier(self) -> RemoteTier: ...
    def publish(self, report: Report) -> None: ...
    def reuse(self, index: int) -> Callable[[str], bool] | None: ...


def written(handle: SaveHandle) -> bool:
    """Whether a source save left a checkpoint (not failed, not skipped)."""
    return handle.exception() is None and not (handle.stats is not None and handle.stats.skipped)


class Runner:
    """The schedule, threads and handles of one multi-level saver. ``folder``: what retention lists
    (folders True, files False, either None), ``naming``: by which names (default ``step-<8 digits>``);
    ``owns(index)``: whether this process applies retention at that level; ``protect(index)``: paths
    there that retention keeps whatever ``keep`` says (read on the thread that applies it)."""

    def __init__(
        self,
        levels: tuple[Level, ...],
        producer: LevelProducer,
        storage_options: dict[str, Any] | None,
        *,
        folder: bool | None,
        name: str = "lazyckpt-level",
        owns: Callable[[int], bool] = lambda index: True,
        naming: Naming | None = None,
        protect: Callable[[int], Collection[str]] = lambda index: (),
    ) -> None:
        self.levels = levels
        self.naming = naming
        self.protect = protect
        self.producer = producer
        self.storage_options = storage_options
        self.folder = folder
        self.owns = owns
        self._cond = reentry.condition()
        self._callbacks = CallbackRunner()
        self._backlog = Backlog(self._cond)  # admitted copies per level, not yet ended
        self._retention = Retention(self._cond, len(levels))  # steps saved, pinned, being removed
        self._workers = {i: Worker(f"{name}-{i}", self._run, lazy=True) for i in range(len(levels))}
        self._open: set[LevelsHandle] = set()
        self._swept = False  # the first save's sweep of an abandoned timeline ran
        self._closed = False

    # -- the schedule (caller's thread) ------------------------------------------------------------

    def due(self, step: int, due: Sequence[int] | None) -> list[int]:
        """The levels a save of ``step`` goes to: ``due`` (indices), or those with ``step % every == 0``."""
        if due is None:
            return [i for i, lv in enumerate(self.levels) if lv.due(step)]
        picked = sorted(set(due))
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.levels) for i in picked):
            raise SaveRefusedError(f"due must hold level indices in [0, {len(self.levels)}), got {list(due)!r}")
        return picked

    def admit(
        self, index: int, step: int, skip: bool | None, confirm: Callable[[], None], warn_after: float = WARN_AFTER_S
    ) -> bool:
        """A place in level ``index``'s backlog (``_schedule.Backlog.admit``)."""
        return self._backlog.admit(index, self.levels[index], step, skip, confirm, warn_after=warn_after)

    @property
    def skipped_copies(self) -> int:
        return self._backlog.skipped

    def begin(
        self, step: int, first: int | None, path: str, admitted: list[int], pin_save: bool, context: Any = None
    ) -> Feed:
        """The save's source, pinned per admitted copy and, with ``pin_save``, for the save itself
        until its handle is done."""
        saved = ([] if first is None else [first]) + admitted
        self._retention.saved(saved, step, first, len(admitted) + int(pin_save))
        return Feed(first, step, path, len(admitted), context)

    def claim(self, step: int) -> None:
        """Call before other processes may write into ``step``'s folder at the fastest due level."""
        self._retention.claim(self.due(step, None)[:1], step)

    def saved_synchronously(self, index: int, step: int) -> None:
        """``step`` is being written into level ``index`` outside the runner (from a signal handler): never an
        abandoned timeline's step. Takes no lock (the interrupted frame may hold it): one set insertion."""
        self._retention.mine(index).add(step)

    def refund(self, admitted: Sequence[int]) -> None:
        """Places ``admit`` gave for a save that will not ``begin``."""
        for i in admitted:
            self._backlog.done(i)

    def abandon(self, feed: Feed, admitted: list[int], pin_save: bool) -> None:
        """The source save could not start: the backlog places and pins ``begin`` took go back."""
        self.refund(admitted)
        if feed.level is not None:
            self._retention.unpin(feed.level, feed.step, len(admitted) + int(pin_save))

    def sweep_once(self) -> None:
        """At the first save: remove an abandoned timeline's steps at every level (``_schedule.sweep``)."""
        if self._swept:
            return
        self._swept = True
        sweep(self.levels, self.retain, self.submit, owns=self.owns)

    def parts(self, feed: Feed, source: SaveHandle, final: str, levels: list[int], t0: float) -> LevelsHandle:
        """The save's handle: one part per level in ``levels`` (``SOURCE`` for a staging source)."""
        feed.source = source
        feed.parts = Parts(final, feed.step, source, levels, self, t0)
        with self._cond:
            self._open.add(feed.parts.handle)
        return feed.parts.handle

    def start(self, feed: Feed, admitted: list[int], unpin_save: bool) -> None:
        """Queue the admitted copies on their level threads; when the source save is done (core
        callback thread), apply the source level's retention and end its part."""
        assert feed.source is not None and feed.parts is not None
        for i in admitted:
            if not self._workers[i].submit(Copy(i, feed)):  # no thread will run it (closed): never a hang
                logger.warning("lazyckpt: level %d: no level thread for the copy of step %d", i, feed.step)
                self._backlog.done(i)
                self.release(feed)
                self.producer.ended(i, feed)
                feed.parts.part_done(i, written=False)
        part = SOURCE if feed.level is None else feed.level

        def on_source(handle: SaveHandle) -> None:
            feed.source_done.set()
            ok = written(handle)
            if feed.level is not None and unpin_save:
                self._retention.unpin(feed.level, feed.step)
            if feed.level is not None and ok:
                self.retain(feed.level)
            if not admitted and feed.level is None:
                self.producer.discard(feed.path)
            assert feed.parts is not None
            feed.parts.part_done(part, written=ok)

        feed.source.add_done_callback(on_source)

    def submit(self, index: int, item: Any) -> bool:
        """An item for level ``index``'s thread (a ``Sweep``, or the producer's own)."""
        return self._workers[index].submit(item)

    # -- level threads -----------------------------------------------------------------------------

    def _run(self, item: Any) -> None:
        if isinstance(item, Sweep):
            run_sweep(self.retain, item.level)
        elif isinstance(item, Copy):
            try:
                self._copy(item)
            except BaseException:  # noqa: BLE001 - a bug: the handle must still end
                logger.exception("lazyckpt: level %d copy of step %d failed unexpectedly", item.level, item.feed.step)
                assert item.feed.parts is not None
                item.feed.parts.part_done(item.level, written=False)
            finally:
                self._backlog.done(item.level)
                self.producer.ended(item.level, item.feed)
        else:
            self.producer.run(item)

    def _copy(self, item: Copy) -> None:
        feed = item.feed
        feed.source_done.wait()  # always set: every source save ends
        assert feed.source is not None and feed.parts is not None
        ok = written(feed.source)
        error = self.producer.promote(item.level, feed) if ok else None
        self.release(feed)
        if ok and error is None:
            self.retain(item.level)
        feed.parts.part_done(item.level, error, written=ok and error is None)

    def release(self, feed: Feed) -> None:
        """A copy has read the source: unpin it; after the last, retention or staging removal."""
        with self._cond:
            feed.readers -= 1
            last = feed.readers == 0
        if feed.level is not None:
            self._retention.unpin(feed.level, feed.step)
        if not last:
            return
        if feed.level is None:
            self.producer.discard(feed.path)
        else:
            self.retain(feed.level)

    def retain(self, index: int, sweep: bool = False) -> None:
        """Level ``index``'s retention (``_schedule.Retention.apply``) where this process owns it."""
        if not self.owns(index):
            return
        p = self.producer
        self._retention.apply(
            index, self.levels[index], self.storage_options, self.folder, p.remove, p.remote_tier, p.publish,
            p.reuse(index), sweep, self.naming, self.protect(index),
        )  # fmt: skip

    # -- the handles' owner (``_handle.Owner``) ----------------------------------------------------

    @property
    def callbacks(self) -> CallbackRunner:
        return self._callbacks

    def publish(self, report: Report) -> None:
        self.producer.publish(report)

    def forget(self, handle: LevelsHandle) -> None:
        with self._cond:
            self._open.discard(handle)

    # -- lifecycle ---------------------------------------------------------------------------------

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every open multi-level save (each handle confirms its source on this thread)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            handles = list(self._open)
        for handle in handles:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 and not handle.done():
                raise TimeoutError(f"lazyckpt: the save of {handle.path} is not done after {timeout} s")
            handle.exception(timeout=left)  # (TimeoutError once ``left`` runs out)

    def close(self) -> None:
        """Stop the level threads (after what they hold) and the callback thread."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers.values():
            worker.stop()
        self._callbacks.stop()
