"""``Found``, what ``latest()`` returns, and the storages it may carry to ``load()``."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.recovery import FileIdentity
from lazyckpt.threads import reentry


class Preread:
    """Storages of the file ``identity`` that ``latest()`` read while checking it, keyed by data
    offset. Owned by a ``Found``; findable by real path (``registered``) while it lives. ``take`` is
    one-shot across threads; a ``Found`` dropped unused frees them."""

    def __init__(self, path: str, identity: FileIdentity, storages: dict[int, torch.UntypedStorage]) -> None:
        self.identity = identity
        self._storages: dict[int, torch.UntypedStorage] | None = storages
        self._lock = reentry.Lock()
        _LIVE[os.path.realpath(path)] = self

    def take(self, identity: FileIdentity) -> dict[int, torch.UntypedStorage] | None:
        """The storages, once, when ``identity`` is the file they were read from; else None."""
        with self._lock:
            storages, self._storages = self._storages, None
        return storages if identity == self.identity else None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in (self._storages or {}).values())

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """Pickled as nothing: the storages are this process's memory, never sent."""
        return _nothing, ()

    def moved(self, path: str) -> None:
        """The file read was renamed to ``path``: findable there if it is the same file (only its
        ctime changed)."""
        try:
            now = FileIdentity.at(path)
        except OSError:
            return
        was = self.identity
        if (now.dev, now.ino, now.size, now.mtime_ns) == (was.dev, was.ino, was.size, was.mtime_ns):
            self.identity = now
            _LIVE[os.path.realpath(path)] = self

    @classmethod
    def registered(cls, path: str) -> Preread | None:
        """The live ``Preread`` of the file at ``path`` (by real path), if any."""
        return _LIVE.get(os.path.realpath(path))

    @classmethod
    def release(cls, path: str) -> None:
        """Free what was read ahead for ``path``."""
        held = cls.registered(path)
        if held is not None:
            held.drop()

    def drop(self) -> None:
        """Free the storages (a ``take`` after this gets None)."""
        with self._lock:
            self._storages = None


_LIVE: weakref.WeakValueDictionary[str, Preread] = weakref.WeakValueDictionary()  # by real path


def _nothing() -> None:
    return None


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

    def __fspath__(self) -> str:
        """A ``Found`` is a path-like object: ``os.fspath(found) == found.path``."""
        return self.path
