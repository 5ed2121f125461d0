"""The saves a checkpointer has started and not yet committed, and the removals ordered behind them.

One lock orders registering a save (``add``), its commit (``finished``, on the committer) and a removal or
reuse of a path a pending save writes to or into (``remove``, ``unless_behind``). Such a removal runs on the
committer right after the last of those saves finishes, before any later save commits (``core/removal.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future

from lazyckpt.core.handle import SaveHandle
from lazyckpt.core.job import Job
from lazyckpt.core.removal import OrderedRemovals, Remover
from lazyckpt.core.report import Report
from lazyckpt.threads import reentry


class PendingSaves:
    """Saves registered and not yet committed or failed, in ``save()`` order. Thread-safe."""

    def __init__(self, remover: Remover, on_failed: Callable[[Report], None]) -> None:
        self._lock = reentry.Lock()
        self._jobs: list[Job] = []
        self._remover = remover
        self._removals = OrderedRemovals(remover)  # remove() calls waiting for pending saves
        self._on_failed = on_failed

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs.append(job)

    def finished(self, job: Job) -> None:
        """Committer thread: ``job`` is over (outcome resolved, not yet visible). Publishes its error first,
        then runs the removals that waited for it, before any later save commits."""
        with self._lock:
            self._jobs.remove(job)
            if job.completion.report is not None:
                self._on_failed(job.completion.report)
            ready = self._removals.finished(job)
            pending = list(self._jobs) if ready else []
        self._removals.run(ready, pending)

    def jobs(self) -> list[Job]:
        """A snapshot, oldest first."""
        with self._lock:
            return list(self._jobs)

    def jobs_snapshot(self) -> list[Job]:
        """The pending jobs without taking the lock (for a re-entered save): one copy under the GIL."""
        return list(self._jobs)

    def nbytes(self) -> int:
        """Bytes of tensors the pending saves still hold or will hold."""
        with self._lock:
            return sum(j.nbytes for j in self._jobs)

    def paths(self) -> set[str]:
        with self._lock:
            return {j.path for j in self._jobs}

    def handles_to(self, final: str) -> list[SaveHandle]:
        with self._lock:
            return [j.handle for j in self._jobs if j.path == final]

    def file_bytes(self, handle: SaveHandle) -> int:
        """The planned size of the pending save behind ``handle`` (0 once it is no longer pending)."""
        with self._lock:
            return next((j.file_bytes for j in self._jobs if j.handle is handle), 0)

    def remove(self, target: str, trash: str | None) -> Future:
        """Delete ``target`` (absolute) at once, or behind the pending saves to or into it."""
        with self._lock:  # orders this against finished(): a job is either still here or committed
            behind = self._behind(target)
            if behind:
                return self._removals.queue(target, trash, behind)
        return self._remover.remove(target, trash)

    def unless_behind(self, target: str, act: Callable[[], bool]) -> bool:
        """``act()`` with no save to or into ``target`` pending, none registered meanwhile; False
        without calling it when one is pending."""
        with self._lock:
            return not self._behind(target) and act()

    def _behind(self, target: str) -> set[Job]:
        inside = target.rstrip(os.sep) + os.sep
        return {j for j in self._jobs if j.path == target or j.path.startswith(inside)}
