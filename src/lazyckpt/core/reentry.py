"""Re-entry from a signal handler: the one rule that keeps a save asked for by a signal from deadlocking.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread is:
possibly inside lazyckpt, holding one of its locks or waiting in it (in ``save()``, in the step guard's
wait, in ``wait()``). A save the handler starts (Lightning's SLURM requeue handler calls
``trainer.save_checkpoint`` there; a user's SIGTERM handler may call ``save()``) must then take no lock
the interrupted frame may hold and change no state that frame is in the middle of changing.

The rule: every lock of lazyckpt is a :class:`Lock` and every wait of the main thread in lazyckpt is an
:func:`inside` region; both count, per thread, how deep the thread is in lazyckpt. The count goes up
*before* a lock is taken or a region entered and down *after* it is released or left, so it is never
zero while this thread holds a lazyckpt lock or waits in lazyckpt. A save that starts while the count
of its own thread is not zero (:func:`reentered`) is written synchronously, durable before it returns,
touching no shared state of lazyckpt (``LazyCheckpointer._save_now``); the integrations' saves take
the stock path then. Nothing here takes a lock: the count is a thread-local integer.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

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


synchronous_saves = 0  # saves written at once because they re-entered (tests: none but the signal tests')
refused_waits = 0  # waits refused because they re-entered (the same)


def count_synchronous() -> None:
    global synchronous_saves
    synchronous_saves += 1


def wait_refused(what: str) -> bool:
    """True (and a warning) when a wait for every pending save is asked from a signal handler that
    interrupted lazyckpt on this thread: such a wait may need the very frame it interrupted (a lock it
    holds, a confirmation it owes), so it returns at once instead. A save made there is already durable
    when it returns; the pending ones are drained by the next wait from the loop, or at exit."""
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
    """``threading.Lock`` that counts in :func:`depth` from before it is taken until after it is released.

    Usable with ``threading.Condition(Lock())`` (which then releases and retakes it around its wait).
    """

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
        self._lock._at_fork_reinit()


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


def write_temporary(obj: Any, final: str, format: str, metadata: dict[str, str] | None, fsync: bool) -> tuple[str, int]:
    """A re-entered save's bytes, written on this thread to a fresh temporary name beside ``final`` and
    fsynced: what ``torch.save(obj)`` writes, or ``safetensors.torch.save(obj, metadata)``. Returns the
    temporary path and the size; the caller renames it (``storage/fs.commit``). Takes no lock of lazyckpt
    and calls the unpatched writers (an integration's gate routes ``torch.save`` to lazyckpt)."""
    import torch.serialization

    from lazyckpt.storage import fs as _fs

    tmp = _fs.temporary_path(final)
    try:
        if format == "safetensors":
            import safetensors.torch

            data = safetensors.torch.save(obj, metadata)
            with open(tmp, "wb") as fh:
                fh.write(data)
                if fsync:
                    fh.flush()
                    _fs.fsync(fh.fileno())
        else:
            with open(tmp, "wb") as fh:
                torch.serialization.save(obj, fh)
                if fsync:
                    fh.flush()
                    _fs.fsync(fh.fileno())
        return tmp, os.path.getsize(tmp)
    except BaseException:
        _fs.discard(tmp)
        raise
