"""``Found``, what ``latest()`` returns, and the storages it may carry to ``load()``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from lazyckpt.recovery import FileIdentity


class Preread:
    """The storages of a file that ``latest()`` read into memory while checking its CRCs, keyed
    by each storage record's data offset, for the file of ``identity``. ``load()`` takes them once
    (``take``): a second ``load()`` of the same ``Found`` reads the file again, and a ``Found``
    dropped unused frees them. Owned by the ``Found``; the lock makes ``take`` one-shot across
    threads."""

    def __init__(self, identity: FileIdentity, storages: dict[int, torch.UntypedStorage]) -> None:
        self.identity = identity
        self._storages: dict[int, torch.UntypedStorage] | None = storages
        self._lock = threading.Lock()

    def take(self, identity: FileIdentity) -> dict[int, torch.UntypedStorage] | None:
        """The storages, once, when ``identity`` is the file they were read from; else None."""
        with self._lock:
            storages, self._storages = self._storages, None
        return storages if identity == self.identity else None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in (self._storages or {}).values())


@dataclass(frozen=True)
class Found:
    """What ``latest()`` found: the file or folder (or URL) ``path``, its ``step``, and ``level``,
    the index of its level in the list given to ``latest()``.

    ``verified``: the identity of the local file whose every CRC ``latest()`` checked (None when
    it checked none: a folder, a URL, ``verify=False``, or a ``Found`` made by hand). ``load()``
    skips its own CRC pass only for a file it opens with that same identity. ``preread``: that
    file's storages, read into memory by the same pass (``latest(preload=True)``, the default),
    which ``load(found)`` unpickles instead of reading the file again."""

    path: str
    step: int
    level: int
    verified: FileIdentity | None = field(default=None, repr=False, compare=False, kw_only=True)
    preread: Preread | None = field(default=None, repr=False, compare=False, kw_only=True)
