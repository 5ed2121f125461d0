"""``install(trainer, levels=[...])``: ``<level>/checkpoint-N`` folders at every level due at a step.

The fastest due level holds the lazy checkpoint; after its commit, the commit thread copies it whole to each
slower due level (``schedule.copy_tree``: every file fsynced, nested folders too, one rename) and applies
each level's ``keep`` (the best checkpoint is kept too).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence

from lazyckpt import Level, LevelError, SaveRefusedError
from lazyckpt.schedule import copy_tree, refuse_replicas

_NAME = re.compile(r"^checkpoint-(\d+)$")


class TrainerLevels:
    """The levels of one handle: which folder a step saves to, copies and retention after its commit."""

    def __init__(self, levels: Sequence[Level]) -> None:
        if not levels:
            raise SaveRefusedError("lazyckpt.transformers: levels=[] names no level")
        for level in levels:
            if not isinstance(level, Level):
                raise SaveRefusedError(f"lazyckpt.transformers: levels takes lazyckpt.Level objects, got {level!r}")
            if level.is_url:
                raise SaveRefusedError(
                    f"lazyckpt.transformers: URL levels ({level.path}) are not supported; use local folders"
                )
            os.makedirs(level.path, exist_ok=True)
        refuse_replicas(tuple(levels), "the transformers Trainer's checkpoints")
        self.levels = tuple(levels)

    def due(self, step: int) -> list[Level]:
        return [lv for lv in self.levels if step % lv.every == 0]

    def fastest_due(self, step: int, run_dir: str) -> str | None:
        """The fastest due level's folder, or None when none is due."""
        due = self.due(step)
        return due[0].path if due else None

    def after_commit(self, step: int, final: str, best: str | None) -> None:
        """On the commit thread, after ``final`` was committed: copies (``LevelError``), then retention."""
        due = self.due(step)
        for level in due[1:]:
            try:
                copy_tree(final, os.path.join(level.path, os.path.basename(final)), True)
            except OSError as exc:
                raise LevelError(
                    f"lazyckpt.transformers: copying {final} to level {level.path} failed: {exc}",
                    path=final, errno=exc.errno, level=self.levels.index(level), level_path=level.path, step=step,
                ) from exc  # fmt: skip
        for level in due:
            retain(level, best)

    def drain(self, timeout: float | None = None) -> None:
        """Copies run on the commit thread: nothing of their own to wait for."""

    def close(self) -> None:
        """Nothing to stop (no thread of its own)."""


def checkpoints(folder: str) -> list[tuple[int, str]]:
    """``(N, path)`` of the ``checkpoint-N`` folders in ``folder``, oldest first."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(folder, n)) for n in names if (m := _NAME.match(n))]
    return sorted(p for p in found if os.path.isdir(p[1]))


def retain(level: Level, best: str | None) -> None:
    """Keep the newest ``level.keep`` checkpoint folders of ``level`` (and ``best``, if it is there)."""
    if level.keep is None:
        return
    found = checkpoints(level.path)
    keep = {p for _, p in found[-level.keep :]}
    if best is not None:
        keep.add(os.path.abspath(best))
    for _, path in found:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
