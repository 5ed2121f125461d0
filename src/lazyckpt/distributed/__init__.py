"""Lazy sharded checkpoints across ranks, in DCP's on-disk format, with a multi-rank atomic commit.

``DistributedCheckpointer`` saves a DCP folder (or URL) committed on every rank or none, and with
``levels=[...]`` one folder per due level (``_levels.py``); ``verify_checkpoint`` checks a folder against
the sizes and CRCs recorded at save time. Usage: docs/distributed.md and docs/levels.md.
"""

from lazyckpt.recovery.dcp import verify_checkpoint

from ..errors import DistributedLevelError, DistributedSaveError, DistributedUploadError
from ._checkpointer import DistributedCheckpointer, DistributedSaveHandle

__all__ = [
    "DistributedCheckpointer",
    "DistributedLevelError",
    "DistributedSaveError",
    "DistributedSaveHandle",
    "DistributedUploadError",
    "verify_checkpoint",
]

# Not public API: the store heartbeat, shared with the integrations (Accelerate).
from ._commit import DEAD_AFTER_S as DEAD_AFTER_S  # noqa: E402
from ._commit import Liveness as Liveness  # noqa: E402
