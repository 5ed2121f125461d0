"""Reading checkpoints back: verification of files, folders and URLs.

``reads`` (``_read.py``), ``READ_THREADS`` and ``FileIdentity`` are shared with ``lazyckpt.levels``
(``latest()``, ``load()``); not public API.
"""

from . import _read as reads  # noqa: F401 - shared with lazyckpt.levels
from ._read import READ_THREADS as READ_THREADS
from ._read import FileIdentity as FileIdentity
