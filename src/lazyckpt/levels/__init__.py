"""Multi-level checkpoints: ``Level``, the multi-level saver, ``latest()`` and ``load()``.

The scheduling (which levels are due), retention and ``latest()`` work on step numbers and level
folders only; they do not depend on the file format or on who writes the files, so a distributed
saver can reuse them with DCP folders (``_level.py`` names, ``_latest.py`` picks).

Below ``__all__``: the pieces the producers of multi-level saves share (the checkpointer's files,
Accelerate's folders, Lightning's plugins, the distributed checkpointer's DCP folders). They are
imported from here, never from this package's private modules; not public API, no stability promise.
``Runner`` (its ``LevelProducer`` interface, ``Feed``) is the one owner of the schedule, the level
threads and the handles; ``MultiLevel`` is its producer of one process's files and folders
(``check_levels`` / ``check_step`` / ``refuse_replicas`` check its arguments); ``LevelsHandle``
and ``not_due`` are the handles of a levels save; ``latest_agreed`` over a
``StoreExchange`` finds the newest step every rank holds (restoring a node's replicated steps first:
``_restore.py``); ``Scope`` / ``probe`` / ``dedup_groups`` say who shares each level's folder;
``Ring`` / ``Replicator`` / ``ReplicationStats`` hold a node-local level's steps in peers' memory
(``SingleWriter``: one writer's files or folders, its holders' side built by them too);
``check_memory`` is the first save's memory statement, ``tensor_bytes`` the size it is computed from;
``Preread`` what ``latest()`` read ahead for ``load()`` (a loader that reads a path itself releases it).
"""

from ._found import Found
from ._latest import latest
from ._level import Level, LevelError, MemoryLevelWarning
from ._load import load

__all__ = ["Found", "Level", "LevelError", "MemoryLevelWarning", "latest", "load"]

# Shared with the producers (see the module docstring).
from ._collective import StoreExchange as StoreExchange  # noqa: E402
from ._copy import check_memory as check_memory  # noqa: E402
from ._copy import tensor_bytes as tensor_bytes  # noqa: E402
from ._found import Preread as Preread  # noqa: E402
from ._handle import LevelsHandle as LevelsHandle  # noqa: E402
from ._handle import not_due as not_due  # noqa: E402
from ._latest import latest_agreed as latest_agreed  # noqa: E402
from ._level import check_step as check_step  # noqa: E402
from ._multi import MultiLevel as MultiLevel  # noqa: E402
from ._multi import check_levels as check_levels  # noqa: E402
from ._multi import refuse_replicas as refuse_replicas  # noqa: E402
from ._replica import ReplicationStats as ReplicationStats  # noqa: E402
from ._replica import Replicator as Replicator  # noqa: E402
from ._replica import Ring as Ring  # noqa: E402
from ._replica import replicated_index as replicated_index  # noqa: E402
from ._runner import Feed as Feed  # noqa: E402
from ._runner import LevelProducer as LevelProducer  # noqa: E402
from ._runner import Runner as Runner  # noqa: E402
from ._single import SingleWriter as SingleWriter  # noqa: E402
from ._topology import Scope as Scope  # noqa: E402
from ._topology import dedup_groups as dedup_groups  # noqa: E402
from ._topology import probe as probe  # noqa: E402
