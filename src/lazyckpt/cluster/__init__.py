"""Ranks and nodes: who shares each level's folder (``_topology``), agreement through the c10d store
(``_collective``), the point-to-point transfers (``_wire``), node-loss replicas in peers' memory (``_replica``:
the ring; ``_single``: one writer's files) and their restore (``_restore``)."""

from ._collective import StoreExchange, agree, in_job
from ._replica import ReplicationStats, Replicator, Ring, replicated_index
from ._restore import restore, restore_replicas
from ._single import SingleWriter, files_of_one_writer, restore_files
from ._topology import Scope, dedup_groups, probe

__all__ = [
    "ReplicationStats",
    "Replicator",
    "Ring",
    "Scope",
    "SingleWriter",
    "StoreExchange",
    "agree",
    "dedup_groups",
    "files_of_one_writer",
    "in_job",
    "probe",
    "replicated_index",
    "restore",
    "restore_files",
    "restore_replicas",
]
