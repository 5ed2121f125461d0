"""``Level``: where checkpoints go, how often, how many are kept; and its entry names.

Names: ``step-<8+ digits>.pt`` (a committed file) or ``step-<8+ digits>`` (a folder, possibly
incomplete: ``latest()`` checks). Only exact matches count; temporaries start with a dot.
"""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass
from typing import Any

from lazyckpt.core import remote as _remote
from lazyckpt.errors import SaveRefusedError

STEP_RE = re.compile(r"^step-(\d{8,})\.pt$")
FOLDER_RE = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class Level:
    """One checkpoint level.

    Args:
        path: a folder (``/dev/shm/run1``, ``/local/ckpt/run1``) or a URL prefix the remote tier
            takes (``s3://bucket/run1``).
        every: the level is due at steps with ``step % every == 0``.
        keep: how many of the newest complete checkpoints to keep (older ones are removed in the
            background); ``None`` keeps all.
        backlog: copies to this level that may be pending before ``save()`` waits
            (``on_backpressure="block"``) or skips this level's copy (``"skip"``).
        reuse_pages: opt-in, for tmpfs: the next save overwrites a file retention drops instead of
            deleting it. A reader outside lazyckpt may see a file rewritten under it: leave it off
            when anything else reads this level.
        replicas: ``k`` >= 1: every committed step is also held in the memory of ``k`` other nodes,
            in the background; ``latest()`` restores a node's missing steps from them. The level
            must be node-local (not a URL, not shared across nodes); ``keep`` applies to the copies.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        ValueError: ``every``, ``keep``, ``backlog`` or ``replicas`` not an int in range, or
            ``replicas`` on a URL level.
    """

    path: str
    every: int = 1
    keep: int | None = None
    backlog: int = 2
    reuse_pages: bool = False
    replicas: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"Level path must be a str or os.PathLike, got {type(self.path).__name__}")
        raw = os.fspath(self.path)
        object.__setattr__(self, "path", raw if _remote.is_url(raw) else os.path.abspath(raw))
        for name, least in (("every", 1), ("keep", 1), ("backlog", 1), ("replicas", 0)):
            value = getattr(self, name)
            if name == "keep" and value is None:
                continue
            number = _whole(value)
            if number is None or number < least:
                allowed = " or None" if name == "keep" else ""
                raise ValueError(f"Level {name} must be an int >= {least}{allowed}, got {value!r}")
            object.__setattr__(self, name, number)  # an int (a numpy integer becomes one)
        if self.replicas and self.is_url:
            raise ValueError(f"Level replicas: {self.path} is a URL; replicas are for a node's memory level")

    @property
    def is_url(self) -> bool:
        return _remote.is_url(self.path)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def file(self, step: int) -> str:
        """The path of this level's file checkpoint of ``step``."""
        return self.join(step_name(step))

    def folder(self, step: int) -> str:
        """The path of this level's folder checkpoint of ``step``."""
        return self.join(step_name(step, folder=True))

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}" if self.is_url else os.path.join(self.path, name)


@dataclass(frozen=True)
class Naming:
    """A saver's folder names in a level other than ``step-<8 digits>`` (``checkpoint-N``, ``global_stepN``):
    ``template`` (``str.format`` with ``step``) and ``pattern``, whose group 1 is the step."""

    template: str
    pattern: re.Pattern[str]

    def name(self, step: int) -> str:
        return self.template.format(step=step)

    def step(self, name: str) -> int | None:
        m = self.pattern.fullmatch(name)
        return int(m.group(1)) if m else None


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is an integer (numpy integers too, not bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_step(step: Any) -> int:
    """``step`` as an ``int`` >= 0 (any integer type, not bool); else ``SaveRefusedError``."""
    value = _whole(step)
    if value is None or value < 0:
        raise SaveRefusedError(f"step must be an int >= 0, got {step!r}")
    return value


def step_name(step: int, folder: bool = False) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}" if folder else f"step-{step:08d}.pt"


def step_of(name: str, folder: bool | None = None) -> int | None:
    """The step a level entry's name stands for, or None (``folder``: True folders only, False
    files only, None either)."""
    for pattern, is_folder in ((STEP_RE, False), (FOLDER_RE, True)):
        if folder in (None, is_folder) and (m := pattern.match(name)):
            return int(m.group(1))
    return None


def as_level(entry: Level | str | os.PathLike[str]) -> Level:
    return entry if isinstance(entry, Level) else Level(os.fspath(entry))


def list_steps(
    level: Level,
    storage_options: dict[str, Any] | None = None,
    folder: bool | None = None,
    naming: Naming | None = None,
) -> dict[int, str]:
    """{step: path} of the checkpoints named at ``level`` ({} when its folder does not exist);
    ``folder`` as for ``step_of`` (a step with both: the file), or names by ``naming``. Folders may be incomplete."""
    if not level.is_url:
        try:
            names = os.listdir(level.path)
        except (FileNotFoundError, NotADirectoryError):
            return {}
    else:
        fs, prefix = _remote.filesystem(level.path, storage_options)
        prefix = prefix.rstrip("/")
        try:
            fs.invalidate_cache(prefix)
            names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(prefix, detail=False)]
        except FileNotFoundError:
            return {}
    out: dict[int, str] = {}
    for name in sorted(names, key=lambda n: n.endswith(".pt")):  # files last: they win a tie
        step = step_of(name, folder) if naming is None else naming.step(name)
        if step is not None:
            out[step] = level.join(name)
    return out
