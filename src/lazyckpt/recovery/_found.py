"""``Found``, what ``latest()`` returns (a path-like record; it may carry storages read ahead to ``load()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._preread import Preread
from ._read import FileIdentity


@dataclass(frozen=True)
class Found:
    """What ``latest()`` found: the file, folder or URL ``path``, its ``step``, and ``level``, the
    index of its level in the list given to ``latest()``.

    ``verified``: the identity of the local file whose every CRC ``latest()`` checked, else None;
    ``load()`` skips its own CRC pass only for a file with that same identity. ``preread``: that
    file's storages read by the same pass (``latest(preload=True)``), which ``load(found)`` takes
    instead of reading the file again."""

    path: str
    step: int
    level: int
    verified: FileIdentity | None = field(default=None, repr=False, compare=False, kw_only=True)
    preread: Preread | None = field(default=None, repr=False, compare=False, kw_only=True)

    def __str__(self) -> str:
        return self.path

    def __fspath__(self) -> str:
        """A ``Found`` is a path-like object: ``os.fspath(found) == found.path``."""
        return self.path
