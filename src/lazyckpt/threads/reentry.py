"""Re-entry from a signal handler: the rule that keeps a save started by a signal handler from deadlocking.

Every lazyckpt lock is a :class:`Lock` and every main-thread wait an :func:`inside` region; both count a
per-thread depth, up before the lock is taken and down after it is released, so it is never zero while
the thread holds a lock or waits in lazyckpt. A save starting at nonzero depth (:func:`reentered`) is
written synchronously, touching no shared state (``LazyCheckpointer._save_now``). Nothing here locks.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_local = threading.local()


def depth() -> int:
    """How deep this thread is in lazyckpt's locks and waits (0: not inside)."""
    return getattr(_local, "depth", 0)


def reentered() -> bool:
    """True when this thread is already inside lazyckpt: a call now comes from a signal handler that
    interrupted it (or from code lazyckpt runs while it holds a lock, which lazyckpt never does)."""
    return getattr(_local, "depth", 0) > 0


synchronous_saves = 0  # saves written at once because they re-entered
refused_waits = 0  # waits refused because they re-entered


def count_synchronous() -> None:
    global synchronous_saves
    synchronous_saves += 1


def wait_refused(what: str) -> bool:
    """True (and a warning) when a wait for every pending save comes from a signal handler that interrupted
    lazyckpt on this thread: it may need the interrupted frame, so the caller returns at once instead."""
    global refused_waits
    if not reentered():
        return False
    refused_waits += 1
    import logging

    logging.getLogger("lazyckpt").warning(
        "lazyckpt: %s called from a signal handler that interrupted lazyckpt: not waiting (saves made in the "
        "handler are already durable; wait from the training loop for the others)",
        what,
    )
    return True


def _enter() -> None:
    _local.depth = getattr(_local, "depth", 0) + 1


def _leave() -> None:
    _local.depth -= 1


@contextlib.contextmanager
def inside() -> Iterator[None]:
    """A region of lazyckpt code on this thread (a wait) during which a save must not re-enter."""
    _enter()
    try:
        yield
    finally:
        _leave()


class Lock:
    """``threading.Lock`` that counts in :func:`depth` from before it is taken until after it is released;
    usable with ``threading.Condition``."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        _enter()
        try:
            got = self._lock.acquire(blocking, timeout)
        except BaseException:
            _leave()
            raise
        if not got:
            _leave()
        return got

    def release(self) -> None:
        self._lock.release()
        _leave()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:  # acquire(), inlined: every lock of lazyckpt goes through here
        local = _local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            self._lock.acquire()
        except BaseException:
            local.depth -= 1
            raise
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        _local.depth -= 1

    def _at_fork_reinit(self) -> None:
        self._lock = _thread.allocate_lock()  # in a forked child: a fresh, unlocked lock


def condition() -> threading.Condition:
    """A ``threading.Condition`` over a :class:`Lock`."""
    return threading.Condition(Lock())  # type: ignore[arg-type]


def region(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` as an :func:`inside` region (a main-thread entry point of lazyckpt that waits or sets events)."""

    @functools.wraps(fn)
    def in_region(*args: P.args, **kwargs: P.kwargs) -> R:
        _enter()
        try:
            return fn(*args, **kwargs)
        finally:
            _leave()

    return in_region
