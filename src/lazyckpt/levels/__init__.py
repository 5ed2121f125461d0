"""Multi-level checkpoints: ``Level``, ``latest()`` and ``load()`` (public).

Names below ``__all__`` are internal pieces the multi-level producers share (checkpointer,
Accelerate, Lightning, ``lazyckpt.distributed``); they import them from here, never from the
private modules. No stability promise.
"""

from ._found import Found
from ._latest import latest
from ._level import Level, LevelError, MemoryLevelWarning
from ._load import load

__all__ = ["Found", "Level", "LevelError", "MemoryLevelWarning", "latest", "load"]

# Shared with the producers (internal).
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
