"""Each slower level's backlog bound and retention's choice, shared by every multi-level saver
through ``_runner.Runner``."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from lazyckpt.commit.folder import is_complete
from lazyckpt.core.remote import RemoteTier
from lazyckpt.core.report import Report
from lazyckpt.core.warn import user_stacklevel
from lazyckpt.errors import BackpressureWarning
from lazyckpt.levels import Level, LevelError, Naming, list_steps

logger = logging.getLogger(__name__)

WARN_AFTER_S = 0.5  # a save that waited longer than this for a level's backlog warns


class Backlog:
    """Admitted, unfinished copies per level, bounded by ``Level.backlog``, under the saver's ``cond``.
    ``admit`` runs on the caller's thread, ``done`` on the level's."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._pending: Counter[int] = Counter()
        self.skipped = 0  # copies skipped so far (``on_backpressure="skip"``)

    def admit(
        self,
        index: int,
        level: Level,
        step: int,
        skip: bool | None,
        confirm: Callable[[], None],
        warn_after: float = WARN_AFTER_S,
    ) -> bool:
        """Reserve a place in level ``index``'s backlog. At the bound: with ``skip``, return False
        (warned); otherwise call ``confirm()`` (lets pending saves commit: no deadlock), then wait
        for a place, warning when that took over ``warn_after`` seconds."""
        with self._cond:
            if self._pending[index] < level.backlog:
                self._pending[index] += 1
                return True
            pending = self._pending[index]
        if skip:
            self.skipped += 1
            warnings.warn(
                f"lazyckpt: skipped level {index} ({level.path}) for step {step}: {pending} earlier copies to it "
                f"still waiting, backlog bound {level.backlog} ({self.skipped} level copies skipped so far). "
                "The faster levels still save this step. Save to it less often, or raise its backlog.",
                BackpressureWarning,
                stacklevel=user_stacklevel(),
            )
            return False
        t0 = time.monotonic()
        confirm()
        with self._cond:
            while self._pending[index] >= level.backlog:
                self._cond.wait(1.0)
            self._pending[index] += 1
        waited = time.monotonic() - t0
        if waited > warn_after:
            other = ", or use on_backpressure='skip'." if skip is False else "."
            warnings.warn(
                f"lazyckpt: level {index} ({level.path}) falls behind: save(step={step}) waited {waited:.2f} s for "
                f"{pending} earlier copies to it (backlog bound {level.backlog}); training slows to that level's "
                f"speed. Save to it less often, raise its backlog{other}",
                BackpressureWarning,
                stacklevel=user_stacklevel(),
            )
        return True

    def done(self, index: int) -> None:
        """A copy admitted to level ``index`` ended (or was never queued)."""
        with self._cond:
            self._pending[index] -= 1
            self._cond.notify_all()


class Retention:
    """Which checkpoints of each level a saver may remove, under its condition. Invariants: the
    newest complete checkpoint is never removed; a pinned step is skipped (retried after unpin); a
    step after this saver's first step that it did not write (an abandoned timeline) is removed."""

    def __init__(self, cond: threading.Condition, levels: int) -> None:
        self._cond = cond
        self._start: int | None = None  # the first step this saver saved (at any level)
        self._mine: dict[int, set[int]] = {i: set() for i in range(levels)}
        self._pins: Counter[tuple[int, int]] = Counter()  # (level, step) -> copies reading it
        self._removing: set[str] = set()

    def saved(self, levels: list[int], step: int, source: int | None, copies: int) -> None:
        """``step`` goes to ``levels``; ``copies`` copies will read it from level ``source``."""
        with self._cond:
            if self._start is None:
                self._start = step
            for i in levels:
                self._mine[i].add(step)
            if source is not None and copies:
                self._pins[(source, step)] += copies

    def claim(self, levels: list[int], step: int) -> None:
        """``step`` will be saved to ``levels`` by this saver (others may write there before
        ``saved``): never treat it as an abandoned timeline's step."""
        with self._cond:
            for i in levels:
                self._mine[i].add(step)

    def mine(self, level: int) -> set[int]:
        """The steps of ``level`` this saver wrote (or claimed)."""
        return self._mine[level]

    def unpin(self, level: int, step: int, copies: int = 1) -> None:
        with self._cond:
            self._pins[(level, step)] -= copies
            if self._pins[(level, step)] <= 0:
                del self._pins[(level, step)]

    def apply(
        self,
        index: int,
        level: Level,
        storage_options: dict[str, Any] | None,
        folder: bool | None,
        remove_local: Callable[[str], Any],
        remote_tier: Callable[[], RemoteTier],
        publish: Callable[[Report], None],
        reuse: Callable[[str], bool] | None = None,
        sweep: bool = False,
        naming: Naming | None = None,
        protected: Collection[str] = (),
    ) -> None:
        """Remove level ``index``'s checkpoints beyond its ``keep`` newest complete ones and an
        abandoned timeline's; runs right after a commit there. ``reuse``: offered first each victim
        this saver wrote (a refusal removes it). ``sweep`` (first save): only the abandoned
        timeline's steps, and only if the level holds a complete step at or before the start.
        ``naming``: the saver's names (``list_steps``); ``protected``: paths never removed."""
        try:
            steps = list_steps(level, storage_options, folder=folder, naming=naming)
        except Exception as exc:  # noqa: BLE001 - retention is housekeeping
            logger.warning("lazyckpt: level %d (%s): cannot list it for retention: %s", index, level.path, exc)
            return
        # Listed files and URL folders are complete; a local folder may still hold a pending marker.
        complete = {s for s, p in steps.items() if is_complete(p)} if folder and not level.is_url else None
        with self._cond:
            start, mine = self._start, self._mine[index]
            if sweep:
                held = [s for s in steps if complete is None or s in complete]
                if start is None or not any(s <= start for s in held):
                    return
                chosen = sorted(s for s in steps if s > start and s not in mine)
            else:
                chosen = retention_victims(steps, level.keep, start, mine, complete)
            victims = [
                steps[s] for s in chosen
                if (index, s) not in self._pins and steps[s] not in self._removing and steps[s] not in protected
            ]  # fmt: skip
            self._removing.update(victims)
            reusable = {steps[s] for s in chosen if s in mine} if reuse is not None else set()
            stale = [s for s in chosen if start is not None and s > start and s not in mine]
        if stale:
            logger.warning(
                "lazyckpt: level %d (%s): removing step(s) %s: after step %d, where this run started, and "
                "not saved by it (left by an earlier run: resumed from an older step, or started again in this folder)",
                index, level.path, stale, start,
            )  # fmt: skip
        for path in victims:
            try:
                if path in reusable and reuse is not None and reuse(path):
                    continue
                remove_copy(index, level, path, remove_local, remote_tier, publish)
            finally:
                with self._cond:
                    self._removing.discard(path)


@dataclass(eq=False)
class Sweep:
    """The first save's sweep of a URL level, on that level's thread."""

    level: int


def sweep(
    levels: Sequence[Level],
    retain: Callable[..., None],
    submit: Callable[[int, Sweep], object],
    owns: Callable[[int], bool] = lambda index: True,
) -> None:
    """At a saver's first save: remove every level's abandoned-timeline steps now, so ``latest()``
    cannot return them (``retain(index, sweep=True)``). Local levels on the caller's thread; a URL
    level as a ``Sweep`` on its level thread (``submit``). ``owns``: whether this process removes
    at that level."""
    for index, level in enumerate(levels):
        if not owns(index):
            continue
        if level.is_url:
            submit(index, Sweep(index))
        else:
            run_sweep(retain, index)


def run_sweep(retain: Callable[..., None], index: int) -> None:
    """Level ``index``'s sweep; an unexpected error is logged, never raised."""
    try:
        retain(index, sweep=True)
    except Exception:  # noqa: BLE001 - housekeeping
        logger.exception("lazyckpt: level %d: retention failed", index)


def retention_victims(
    steps: dict[int, str], keep: int | None, first: int | None, mine: set[int], complete: set[int] | None = None
) -> list[int]:
    """The steps of ``steps`` older than the ``keep`` newest complete ones (``complete``; None:
    all), plus those after ``first`` not in ``mine``. An incomplete step newer than the oldest kept
    one is not a victim; with no complete step, no old step is."""
    stale = {s for s in steps if first is not None and s > first and s not in mine}
    live = sorted(s for s in steps if s not in stale)
    done = [s for s in live if complete is None or s in complete]
    kept = done[-keep:] if keep is not None else []
    old = {s for s in live if s < kept[0]} if kept else set()
    return sorted(stale | old)


def remove_copy(
    index: int,
    level: Level,
    path: str,
    remove_local: Callable[[str], Any],
    remote_tier: Callable[[], RemoteTier],
    publish: Callable[[Report], None],
) -> None:
    """Delete level ``index``'s checkpoint ``path``: local through ``remove_local``, a URL through the
    remote tier. Already gone is fine; another failure is published once as a ``LevelError``."""
    try:
        if level.is_url:
            tier = remote_tier()
            tier.delete_object(path, *tier.resolve(path))
        else:
            remove_local(path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - reported once, as a failed save is
        err = LevelError(f"lazyckpt: level {index} ({level.path}): could not remove {path}: {exc}",
                         index, level.path, -1, path)  # fmt: skip
        err.__cause__ = exc
        publish(Report(err))
