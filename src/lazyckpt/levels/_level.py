"""``Level``: one place checkpoints go to, how often, how many are kept; and its file names.

File names: ``<level>/step-<step, 8 digits>.pt``. Only names that match exactly count (temporary
files start with a dot and never match), so a listing shows committed checkpoints only: every final
name is made by an atomic rename (local) or an atomic object creation (S3), never written in place.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from lazyckpt.storage import remote as _remote

from ..errors import LevelError, MemoryLevelWarning

__all__ = ["Level", "LevelError", "MemoryLevelWarning", "as_level", "list_steps", "step_name"]

STEP_RE = re.compile(r"^step-(\d{8,})\.pt$")


@dataclass(frozen=True)
class Level:
    """One checkpoint level.

    Args:
        path: a folder (``/dev/shm/run1``, ``/local/ckpt/run1``) or a URL prefix the remote tier
            takes (``s3://bucket/run1``).
        every: the level is due at steps with ``step % every == 0``.
        keep: the newest ``keep`` complete checkpoints of this level are kept (older ones are
            removed in the background); ``None`` keeps all.
        backlog: copies to this level that may wait (queued or running) before ``save()`` waits
            for it (``on_backpressure="block"``) or skips this level's copy (``"skip"``). A faster
            level's file that feeds a waiting copy is kept until that copy is done, so a memory
            level holds at most ``keep`` plus the slower levels' backlogs of checkpoints.
    """

    path: str
    every: int = 1
    keep: int | None = None
    backlog: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"Level path must be a str or os.PathLike, got {type(self.path).__name__}")
        raw = os.fspath(self.path)
        object.__setattr__(self, "path", raw if _remote.is_url(raw) else os.path.abspath(raw))
        if int(self.every) < 1:
            raise ValueError(f"Level every must be >= 1, got {self.every}")
        if self.keep is not None and int(self.keep) < 1:
            raise ValueError(f"Level keep must be >= 1 or None, got {self.keep}")
        if int(self.backlog) < 1:
            raise ValueError(f"Level backlog must be >= 1, got {self.backlog}")

    @property
    def is_url(self) -> bool:
        return _remote.is_url(self.path)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def file(self, step: int) -> str:
        """Where this level's checkpoint of ``step`` lives."""
        name = step_name(step)
        return f"{self.path.rstrip('/')}/{name}" if self.is_url else os.path.join(self.path, name)


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}.pt"


def as_level(entry: Level | str | os.PathLike[str]) -> Level:
    return entry if isinstance(entry, Level) else Level(os.fspath(entry))


def list_steps(level: Level, storage_options: dict[str, Any] | None = None) -> dict[int, str]:
    """{step: path} of the committed checkpoints of ``level`` (an empty dict when it has none or
    its folder does not exist). A URL level is listed through fsspec."""
    if not level.is_url:
        try:
            names = os.listdir(level.path)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {int(m.group(1)): os.path.join(level.path, n) for n in names if (m := STEP_RE.match(n))}
    fs, prefix = _remote.filesystem(level.path, storage_options)
    prefix = prefix.rstrip("/")
    try:
        fs.invalidate_cache(prefix)
        entries = fs.ls(prefix, detail=False)
    except FileNotFoundError:
        return {}
    out = {}
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if m := STEP_RE.match(name):
            out[int(m.group(1))] = f"{level.path.rstrip('/')}/{name}"
    return out
