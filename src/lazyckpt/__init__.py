"""lazyckpt: lazy asynchronous checkpointing for PyTorch.

``save()`` returns at once; tensors are copied and written in the background, and files that
``torch.load`` / ``safetensors`` read are committed atomically.
"""

from lazyckpt.commit.folder import is_complete
from lazyckpt.core.handle import SaveHandle, SaveStats
from lazyckpt.options import CheckpointerOptions
from lazyckpt.recovery.verify import VerifyReport, verify
from lazyckpt.storage.fs import cleanup_temporaries

from .checkpointer import LazyCheckpointer
from .errors import (
    BackpressureWarning,
    CheckpointerClosedError,
    IncompleteCheckpointError,
    IncompleteCheckpointWarning,
    LazyCkptError,
    ReplicationError,
    ReplicationWarning,
    SaveRefusedError,
    StaleTensorError,
    UploadError,
    VerificationError,
    WriteError,
)
from .levels import Level, LevelError, MemoryLevelWarning
from .resume import Found, latest, load

__version__ = "0.1.0"

__all__ = [
    "BackpressureWarning",
    "CheckpointerClosedError",
    "CheckpointerOptions",
    "Found",
    "IncompleteCheckpointError",
    "IncompleteCheckpointWarning",
    "LazyCheckpointer",
    "LazyCkptError",
    "Level",
    "LevelError",
    "MemoryLevelWarning",
    "ReplicationError",
    "ReplicationWarning",
    "SaveHandle",
    "SaveRefusedError",
    "SaveStats",
    "StaleTensorError",
    "UploadError",
    "VerificationError",
    "WriteError",
    "VerifyReport",
    "cleanup_temporaries",
    "is_complete",
    "latest",
    "load",
    "verify",
]
