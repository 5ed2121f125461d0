"""``Worker``: named daemon threads taking items from one queue until stopped; every lazyckpt background loop.

One failed item never ends a thread (a dead one would hang every later wait): its exception goes to
``on_error`` (default: logged). ``submit`` returns False when no thread will run the item (stopped, or
none could start); the caller then does the work inline. ``stop()`` lets the threads finish every item
queued before it, then joins them (never the calling thread).
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lazyckpt.threads import reentry

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STOP: Any = object()


class Worker(Generic[T]):
    """``threads`` threads named ``name`` (``name-<i>`` when several, or ``numbered``) running ``handle`` on each
    submitted item, in submission order per thread. ``lazy``: start them at the first ``submit``
    (a checkpointer that never deletes starts no remover)."""

    def __init__(
        self,
        name: str,
        handle: Callable[[T], object],
        *,
        threads: int = 1,
        numbered: bool = False,
        lazy: bool = False,
        on_error: Callable[[T, BaseException], object] | None = None,
    ) -> None:
        self.name = name
        self._handle = handle
        self._on_error = on_error
        self._count = threads
        self._numbered = numbered or threads > 1
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = reentry.Lock()
        self._threads: list[threading.Thread] = []
        self._stopped = False
        if not lazy:
            with self._lock:
                if not self._start():
                    raise RuntimeError(f"lazyckpt: cannot start the {name} thread(s)")

    def submit(self, item: T) -> bool:
        """Queue ``item``; False when no thread will run it (stopped, or none could be started)."""
        with self._lock:
            if self._stopped or not self._start():
                return False
            self._q.put(item)
            return True

    def owns_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def stop(self) -> None:
        """Finish what is queued, end the threads, join them (never the calling thread; a thread that
        stopped its own worker is joined by the next ``stop()`` from elsewhere)."""
        with self._lock:
            threads = list(self._threads)
            if not self._stopped:
                self._stopped = True
                for _ in threads:
                    self._q.put(_STOP)
        for t in threads:  # joined again on a later stop() (a callback that closed its own checkpointer)
            if t is not threading.current_thread():
                t.join()

    def _start(self) -> bool:
        # caller holds _lock
        if self._threads:
            return True
        names = [f"{self.name}-{i}" for i in range(self._count)] if self._numbered else [self.name]
        started = []
        for n in names:
            # a fresh context: no context variable of the starting thread (error_context) reaches its items
            t = threading.Thread(target=contextvars.Context().run, args=(self._run,), name=n, daemon=True)
            try:
                t.start()
            except RuntimeError:
                logger.debug("lazyckpt: cannot start thread %s", n, exc_info=True)
                break
            started.append(t)
        self._threads = started  # fewer than asked (thread limits) still make progress
        return bool(started)

    def _run(self) -> None:
        while (item := self._q.get()) is not _STOP:
            try:
                self._handle(item)
            except BaseException as exc:  # noqa: BLE001 - the loop must outlive one item
                self._failed(item, exc)

    def _failed(self, item: T, exc: BaseException) -> None:
        if self._on_error is None:
            logger.exception("lazyckpt: %s failed on an item", threading.current_thread().name)
            return
        try:
            self._on_error(item, exc)
        except BaseException:  # noqa: BLE001 - nothing may end the thread
            logger.exception("lazyckpt: %s could not report a failure", threading.current_thread().name)
