"""Multi-level checkpoints (issue 22): ``Level``, the multi-level saver, ``latest()`` and ``load()``.

The scheduling (which levels are due), retention and ``latest()`` work on step numbers and level
folders only; they do not depend on the file format or on who writes the files, so a distributed
saver can reuse them with DCP folders (``_level.py`` names, ``_latest.py`` picks).
"""

from ._latest import Found, latest
from ._level import Level, LevelError, MemoryLevelWarning
from ._load import load

__all__ = ["Found", "Level", "LevelError", "MemoryLevelWarning", "latest", "load"]
