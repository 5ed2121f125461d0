"""One registry of the owners of background work (checkpointers, integrations' handles) drained at exit.

Drain order: integrations, then distributed checkpointers, then core ones; newest first within a layer.
Each drain runs at most once; its errors are logged, never raised. Owners with uploads (``early=True``)
are drained at the start of interpreter shutdown (``threading._register_atexit``), before
``concurrent.futures`` refuses new work; the others at ``atexit``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lazyckpt.threads import reentry

logger = logging.getLogger(__name__)

INTEGRATION, DISTRIBUTED, CORE = 0, 1, 2  # drained in this order


@dataclass(eq=False)
class _Entry:
    ref: weakref.ref
    drain: Callable[[Any], None]
    layer: int
    seq: int
    early: bool


_lock = reentry.Lock()
_entries: dict[int, _Entry] = {}  # id(owner) -> entry
_seq = itertools.count()
_early_hooked = False


def register(owner: object, drain: Callable[[Any], None], *, layer: int, early: bool = False) -> None:
    """Drain ``owner`` (``drain(owner)``) at exit while it lives; registering again updates the entry
    (``early`` once set stays set)."""
    global _early_hooked
    with _lock:
        old = _entries.get(id(owner))
        early = early or (old is not None and old.early)
        _entries[id(owner)] = _Entry(weakref.ref(owner), drain, layer, next(_seq), early)
        hook = early and not _early_hooked
        _early_hooked = _early_hooked or hook
    if hook:
        _hook_shutdown()


def unregister(owner: object) -> None:
    """``owner`` has nothing left to drain (closed)."""
    with _lock:
        entry = _entries.get(id(owner))
        if entry is not None and entry.ref() is owner:
            del _entries[id(owner)]


def registered(layer: int | None = None) -> list[Any]:
    """The live owners still registered (of ``layer``), in drain order."""
    with _lock:
        entries = sorted(_entries.values(), key=lambda e: (e.layer, -e.seq))
    return [o for e in entries if (layer is None or e.layer == layer) and (o := e.ref()) is not None]


def drain(early_only: bool = False) -> None:
    """Drain every registered owner (``early_only``: those with uploads), in order; never raises."""
    while True:
        with _lock:
            entries = sorted(
                (e for e in _entries.values() if e.early or not early_only), key=lambda e: (e.layer, -e.seq)
            )
            if not entries:
                return
            entry = entries[0]
            _entries.pop(next(k for k, v in _entries.items() if v is entry))
        owner = entry.ref()
        if owner is None:
            continue
        try:
            entry.drain(owner)
        except BaseException as exc:  # noqa: BLE001 - nobody left to raise to
            logger.error("lazyckpt: draining %s at exit failed: %s", type(owner).__name__, exc)


class ClosedOnExit:
    """``with owner:`` closes it; when the block raised, a save's error from ``close()`` is logged
    so that the block's exception is the one that propagates. Subclasses set ``_closed``."""

    _closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        from lazyckpt.errors import LazyCkptError

        try:
            self.close()
        except LazyCkptError:
            logger.exception("lazyckpt: a save failed while another exception was propagating")


def _hook_shutdown() -> None:
    register_hook = getattr(threading, "_register_atexit", None)
    if register_hook is None:  # pragma: no cover - CPython >= 3.9 has it
        return
    try:
        register_hook(lambda: drain(early_only=True))
    except RuntimeError:  # already shutting down: atexit's drain is what is left
        logger.debug("lazyckpt: interpreter shutting down; uploads drain at exit only")


def _forget_in_child() -> None:
    # A forked child has none of the parent's threads: draining their work would hang (the shutdown hook
    # is inherited: _early_hooked stays).
    _entries.clear()


atexit.register(drain)
os.register_at_fork(after_in_child=_forget_in_child)
