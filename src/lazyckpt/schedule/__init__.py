"""Saving to levels: ``Runner`` owns the schedule (which levels are due), the level threads, backlog,
retention and the handles; ``MultiLevel`` is its producer of one process's files and folders; the other
producers (Accelerate, distributed) implement ``LevelProducer``."""

from ._copy import check_file, check_memory, copy_checked, copy_tree, tensor_bytes
from ._handle import LevelsHandle, not_due
from ._multi import MultiLevel, check_levels, refuse_replicas
from ._runner import Feed, LevelProducer, Runner

__all__ = [
    "Feed",
    "LevelProducer",
    "LevelsHandle",
    "MultiLevel",
    "Runner",
    "check_file",
    "check_levels",
    "check_memory",
    "copy_checked",
    "copy_tree",
    "not_due",
    "refuse_replicas",
    "tensor_bytes",
]
