"""Reading checkpoints back: verification of files, folders and URLs.

Shared with ``lazyckpt.levels`` (``latest()`` and ``load()`` read through it; not public API, no
stability promise): ``reads``, the parallel piecewise reader that computes CRCs as it reads
(``_read.py``), with its ``READ_THREADS`` and ``FileIdentity``.
"""

from . import _read as reads  # noqa: F401 - shared with lazyckpt.levels (above)
from ._read import READ_THREADS as READ_THREADS
from ._read import FileIdentity as FileIdentity
