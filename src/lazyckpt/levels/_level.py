"""``Level``: one place checkpoints go to, how often, how many are kept; and its file names.

Names: ``<level>/step-<step, 8 digits>.pt`` for a file checkpoint (one ``torch.save`` file), and
``<level>/step-<step, 8 digits>`` for a folder checkpoint (an Accelerate ``save_state`` folder, a
DCP folder of ``lazyckpt.distributed``). Only names that match exactly count (temporaries start
with a dot and never match), so a listing shows committed checkpoints only: a final file name is
made by an atomic rename (local) or an atomic object creation (S3); a folder is complete once its
pending markers are gone (written in place) or by a rename of the whole folder (a copy), and at a
URL once its last key exists (a manifest, or DCP's ``.metadata``). ``latest()`` checks which.
"""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass
from typing import Any

from lazyckpt.storage import remote as _remote

from ..errors import LevelError, MemoryLevelWarning, SaveRefusedError

__all__ = ["Level", "LevelError", "MemoryLevelWarning", "as_level", "check_step", "list_steps", "step_name", "step_of"]

STEP_RE = re.compile(r"^step-(\d{8,})\.pt$")
FOLDER_RE = re.compile(r"^step-(\d{8,})$")


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
        reuse_pages: opt-in, for a memory filesystem (tmpfs): the next save into this level
            overwrites the file retention drops instead of deleting it (no allocation and zeroing of
            new pages). Files a lazyckpt reader holds (``lazyckpt.load``, ``verify``, ``latest``) are
            never reused, but a reader outside lazyckpt (plain ``torch.load`` in another process) may
            see an old file rewritten under it: leave it off when anything else reads this level.
        replicas: ``k`` >= 1: every committed step of this level is also held in the memory of
            ``k`` other nodes (the level must be node-local: a folder the construction's probe
            finds shared by one node's ranks only). ``DistributedCheckpointer`` levels: ring order
            over nodes, node ``g`` sends to nodes ``g+1 .. g+k``, each rank its own files to the
            same local rank there (``<level>/replicas/node-<g>/step-<n>``), in the background, on
            a gloo group of its own; ``latest()`` restores a node's copy from a peer's replica
            (CRC-checked against the primary's CRCs) when its own is gone. ``LazyCheckpointer``
            levels in a torch.distributed job (built on every rank, global rank 0 saving: DDP):
            rank 0's files are copied into the next ``k`` nodes' folders under their own names,
            and ``latest()`` gives every node the newest step any node holds. ``keep`` applies to
            the copies too. See docs/ARCHITECTURE.md, "Node loss".
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
        """Where this level's file checkpoint of ``step`` lives (``step-<8 digits>.pt``)."""
        return self.join(step_name(step))

    def folder(self, step: int) -> str:
        """Where this level's folder checkpoint of ``step`` lives (``step-<8 digits>``)."""
        return self.join(step_name(step, folder=True))

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}" if self.is_url else os.path.join(self.path, name)


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is an integer (``operator.index``: numpy integers too), else None
    (a float, a string, a bool)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_step(step: Any) -> int:
    """``step`` as an ``int`` >= 0 (any integer type: ``numpy.int64``, a 0-dim integer tensor), else
    ``SaveRefusedError`` (a ``ValueError``); ``bool`` is refused."""
    value = _whole(step)
    if value is None or value < 0:
        raise SaveRefusedError(f"step must be an int >= 0, got {step!r}")
    return value


def step_name(step: int, folder: bool = False) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}" if folder else f"step-{step:08d}.pt"


def step_of(name: str, folder: bool | None = None) -> int | None:
    """The step a level entry's name stands for (``folder``: only folder names; False: only file
    names; None: either), or None for any other name."""
    for pattern, is_folder in ((STEP_RE, False), (FOLDER_RE, True)):
        if folder in (None, is_folder) and (m := pattern.match(name)):
            return int(m.group(1))
    return None


def as_level(entry: Level | str | os.PathLike[str]) -> Level:
    return entry if isinstance(entry, Level) else Level(os.fspath(entry))


def list_steps(
    level: Level, storage_options: dict[str, Any] | None = None, folder: bool | None = None
) -> dict[int, str]:
    """{step: path} of the checkpoints named at ``level`` (an empty dict when it has none or its
    folder does not exist): file checkpoints (``folder=False``), folder checkpoints (True) or both
    (None; where a step has both, the file). A URL level is listed through fsspec. A folder's name
    says nothing of its completeness: ``latest()`` checks it."""
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
        step = step_of(name, folder)
        if step is not None:
            out[step] = level.join(name)
    return out
