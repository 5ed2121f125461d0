"""Backpressure: what a save does when saves outrun storage, and the warnings that say so.

Warnings are issued on the caller's thread only (``save()``, ``wait()``), so a warning filter set to
"error" raises in the caller and never ends a lazyckpt thread.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from lazyckpt.core import remote as _remote
from lazyckpt.core.handle import SaveHandle, SaveStats, done_handle
from lazyckpt.core.pool import HostBufferPool
from lazyckpt.errors import BackpressureWarning
from lazyckpt.threads import reentry

logger = logging.getLogger(__name__)


class BackpressureGate:
    """One checkpointer's skip decisions and backpressure warnings (``skipped`` counts the skips)."""

    def __init__(self, pool: HostBufferPool, skip: bool) -> None:
        self.pool = pool
        self.skip = skip  # on_backpressure == "skip"
        self.skipped = 0
        self._lock = reentry.Lock()
        self._last_warning = 0.0

    def should_skip(self, pending: int, nbytes: int, final: str) -> bool:
        """``skip`` mode: skip a save that would not fit in the host budget beside ``pending`` bytes."""
        if not self.skip or pending == 0 or pending + nbytes <= self.pool.capacity_bytes:
            return False
        self.skipped += 1
        warnings.warn(
            f"lazyckpt: skipped save to {final}: {pending / 1e9:.2f} GB of earlier saves still pending and "
            f"this one needs {nbytes / 1e9:.2f} GB, host budget {self.pool.capacity_bytes / 1e9:.2f} GB "
            f"({self.skipped} skipped so far). Save less often, or raise host_memory_budget.",
            BackpressureWarning,
            stacklevel=4,
        )
        return True

    def skip_upload(self, url: str, tier: Any) -> None:
        """A URL save skipped: the local tier's backlog of uploads is at its bound."""
        self.skipped += 1
        warnings.warn(
            f"lazyckpt: skipped save to {url}: {tier.backlog() / 1e9:.2f} GB on local disk still waiting "
            f"for upload, bound {tier.backlog_bound / 1e9:.2f} GB ({self.skipped} skipped so far). "
            "Save less often, raise upload_backlog_bytes, or give uploads more bandwidth.",
            BackpressureWarning,
            stacklevel=4,
        )

    def warn_if_uploads_behind(self, tier: Any) -> None:
        waited = tier.take_wait_s()
        if waited <= _remote.WARN_AFTER_S:
            return
        rate = tier.uploaded_bytes / tier.upload_s / 1e9 if tier.upload_s else 0.0
        warnings.warn(
            f"lazyckpt: uploads fall behind: save() waited {waited:.2f} s for {tier.backlog() / 1e9:.2f} GB of "
            f"local copies to upload (bound {tier.backlog_bound / 1e9:.2f} GB, uploads ran at {rate:.2f} GB/s). "
            "Save less often, raise upload_backlog_bytes or upload_threads, or use on_backpressure='skip'.",
            BackpressureWarning,
            stacklevel=5,
        )

    def warn_if_staging_waited(self) -> None:
        """Staging waited for host buffers: at most one warning per 30 s, for the wait since the last."""
        now = time.monotonic()
        with self._lock:  # one caller warns for a given wait
            waited = self.pool.wait_s
            if waited <= 0.5 or now - self._last_warning < 30:
                return
            self._last_warning = now
            self.pool.wait_s = 0.0
        logger.warning("lazyckpt: staging waited %.2f s for host buffers", waited)
        warnings.warn(
            f"lazyckpt: saves outrun storage: staging waited {waited:.2f} s for host buffers "
            f"(budget {self.pool.capacity_bytes / 1e9:.2f} GB); training slows to storage speed. "
            "Save less often, raise host_memory_budget, or use on_backpressure='skip'.",
            BackpressureWarning,
            stacklevel=5,  # the caller of save() / wait()
        )


def skipped_handle(final: str, t0: float) -> SaveHandle:
    """The finished handle of a skipped save (its stats say ``skipped``)."""
    return done_handle(SaveStats(final, 0, 0, time.perf_counter() - t0, 0.0, 0.0, 0.0, 0.0, 0.0, skipped=True))
