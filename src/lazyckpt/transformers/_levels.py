"""``install(trainer, levels=[...])``: ``<level>/checkpoint-N`` folders at every level due at a step.

The levels run on the one level runner (``schedule.MultiLevel``, in the writing process): the fastest due
level's ``checkpoint-N`` is the lazy save (its ``CheckpointSave``, the runner's source); once it is
committed, each slower due level's thread copies it whole (``schedule.copy_tree``), bounded by its
``backlog``; each level keeps its newest ``keep`` folders, and the best checkpoint too (a failed deletion is
logged: never raised by the main process alone while the others wait in a collective). A save waiting for a
slower level's backlog holds the other processes at the checkpoint's barrier meanwhile.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lazyckpt import Level, SaveRefusedError
from lazyckpt.core.handle import SaveHandle
from lazyckpt.levels import Naming
from lazyckpt.schedule import MultiLevel, refuse_replicas
from lazyckpt.storage import fs as _fs

if TYPE_CHECKING:
    from lazyckpt import LazyCheckpointer

NAMING = Naming("checkpoint-{step}", re.compile(r"checkpoint-(\d+)"))


class TrainerLevels:
    """The levels of one handle: which folder a step saves to; in the writing process (``writer``), the
    runner that copies it to the slower levels and keeps each level's newest (and the best)."""

    def __init__(self, levels: Sequence[Level], checkpointer: LazyCheckpointer, writer: bool) -> None:
        if not levels:
            raise SaveRefusedError("lazyckpt.transformers: levels=[] names no level")
        for level in levels:
            if not isinstance(level, Level):
                raise SaveRefusedError(f"lazyckpt.transformers: levels takes lazyckpt.Level objects, got {level!r}")
            if level.is_url:
                raise SaveRefusedError(
                    f"lazyckpt.transformers: URL levels ({level.path}) are not supported; use local folders"
                )
        refuse_replicas(tuple(levels), "the transformers Trainer's checkpoints")
        self.levels = tuple(levels)
        self.best: str | None = None  # the trainer's best checkpoint (training thread): kept at its level
        self.multi = (
            MultiLevel(checkpointer, self.levels, checkpointer.options, folder=True, naming=NAMING,
                       protect=lambda index: () if self.best is None else (os.path.abspath(self.best),),
                       remove=_fs.remove_quietly)
            if writer
            else None
        )  # fmt: skip
        if self.multi is None:
            for level in self.levels:
                os.makedirs(level.path, exist_ok=True)

    def folder(self, step: int) -> str | None:
        """The fastest due level's ``checkpoint-<step>``, or None when none is due."""
        due = [lv for lv in self.levels if lv.due(step)]
        return due[0].join(NAMING.name(step)) if due else None

    def save(self, step: int, final: str, source: SaveHandle) -> None:
        """The writer, before the checkpoint's files: ``final`` (``folder(step)``) to every level due at
        ``step``, copied once ``source`` (its commit) is done. May wait for a slower level's backlog."""
        assert self.multi is not None

        def produce(path: str) -> SaveHandle:
            assert path == final, (path, final)
            return source

        self.multi.save_with(step, produce)

    def take_errors(self) -> list[BaseException]:
        """The slower levels' failed copies and removals not raised yet."""
        return [] if self.multi is None else self.multi.take_errors()

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every level copy (``TimeoutError`` after ``timeout`` seconds)."""
        if self.multi is not None:
            self.multi.drain(timeout)

    def close(self) -> None:
        """Stop the level threads (after what they hold)."""
        if self.multi is not None:
            self.multi.close()


def checkpoints(folder: str) -> list[tuple[int, str]]:
    """``(N, path)`` of the ``checkpoint-N`` folders in ``folder``, oldest first."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(n, os.path.join(folder, name)) for name in names if (n := NAMING.step(name)) is not None]
    return sorted(p for p in found if os.path.isdir(p[1]))
