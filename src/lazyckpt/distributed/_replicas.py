"""A node-local DCP level's replicas (``Level(replicas=k)``): what the distributed levels hand to
``lazyckpt.levels``'s replicator."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lazyckpt.cluster import Replicator, Ring, Scope, replicated_index
from lazyckpt.formats.dcp import MANIFEST, METADATA
from lazyckpt.levels import Level

logger = logging.getLogger(__name__)


def replicator_of(
    levels: Sequence[Level], scopes: Sequence[Scope], rank: int, group: Any, commit_timeout: float, fsync: bool
) -> Replicator | None:
    """The replicator of the level with ``replicas``, on a gloo group of its own (collective over
    ``group``); None without replicas. ``ValueError`` alike on every rank for a level that cannot
    be replicated (``Ring.of``)."""
    index = replicated_index(levels)
    if index is None:
        return None
    rings = {index: Ring.of(index, levels[index], scopes[index], rank)}
    timeout = timedelta(seconds=max(10.0, min(60.0, commit_timeout)))
    ranks = dist.get_process_group_ranks(group)
    own = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
    return Replicator(levels, rings, own, fsync)


def replicate(
    replicator: Replicator, index: int, step: int, folder: str, name: str, crc: int | None, leader: bool
) -> None:
    """After level ``index``'s commit of ``step`` (on its thread): submit this rank's file ``name``
    of ``folder`` and, for its ``leader``, the ``.metadata``, manifest and extra files."""
    files: list[tuple[str, int | None]] = [(name, crc)]
    if leader:
        try:
            with open(os.path.join(folder, MANIFEST)) as stream:
                manifest = json.load(stream)
            files += [(n, e.get("crc32")) for n, e in manifest["files"].items() if e.get("rank") is None]
            files += [(METADATA, manifest[METADATA].get("crc32")), (MANIFEST, None)]
        except (OSError, ValueError, KeyError) as exc:  # the replica will not be whole
            logger.warning("lazyckpt: %s: cannot read its manifest to replicate it: %s", folder, exc)
    replicator.submit(index, step, folder, files)
