"""DCP planning on the caller's thread: which items this rank writes, and the global metadata.

Exactly DCP's save pipeline up to ``finish_plan`` (``state_dict_saver._save_state_dict``): the
``DefaultSavePlanner`` makes a local plan per rank, the coordinator a global one (replicated items
deduplicated and spread across ranks by size, ``Metadata`` for every item), and each rank gets its
final plan back. The gather and scatter run on the checkpointer's own gloo group, never on the
training's group. A failure on any rank (an unsupported value, a mismatched state dict) raises on
every rank as ``SaveRefusedError`` (DCP's ``CheckpointException`` is a ``BaseException``).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import _DistWrapper

from ..errors import SaveRefusedError


@dataclass
class RankPlan:
    """This rank's share of one save."""

    planner: DefaultSavePlanner
    items: list[WriteItem]  # what this rank writes (replicated items: only those assigned to it)
    staging: str  # the staging directory the coordinator made
    metadata: Metadata | None  # the coordinator's global metadata (storage data filled in at commit)


def plan_save(state: dict[str, Any], wrapper: _DistWrapper, final: str, prepare: Callable[[], str]) -> RankPlan:
    """Collective over ``wrapper``'s group. ``prepare`` runs on the coordinator only, inside the
    collective (so its failure reaches every rank): it returns the staging directory."""
    planner = DefaultSavePlanner()
    metadata: Metadata | None = None

    def local_step() -> Any:
        planner.set_up_planner(state, StorageMeta(checkpoint_id=final), wrapper.is_coordinator)
        return planner.create_local_plan()

    def global_step(plans: list[Any]) -> list[Any]:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        staging = prepare()
        return [dataclasses.replace(p, storage_data=staging) for p in plans]

    try:
        central = wrapper.reduce_scatter("plan", local_step, global_step)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, Exception) and not isinstance(exc, SaveRefusedError):  # the collective itself
            raise SaveRefusedError(
                f"planning the save to {final} failed (did every rank call save() with the same path?): {exc}"
            ) from exc
        if not _is_checkpoint_exception(exc):
            raise
        ranks = sorted(getattr(exc, "failures", {}))
        raise SaveRefusedError(
            f"planning the save to {final} failed on rank(s) {ranks}; nothing was written:\n{exc}"
        ) from exc
    return RankPlan(planner, planner.finish_plan(central).items, central.storage_data, metadata)


def resolve(plan: RankPlan) -> tuple[list[tuple[WriteItem, torch.Tensor]], list[tuple[WriteItem, bytes]]]:
    """This rank's tensors (local shards, assigned replicas) and its non-tensor values serialized
    now (``torch.save`` bytes, as DCP writes them: the snapshot of those values)."""
    tensors: list[tuple[WriteItem, torch.Tensor]] = []
    byte_items: list[tuple[WriteItem, bytes]] = []
    for item in plan.items:
        data = plan.planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            byte_items.append((item, data.getvalue()))
        else:
            assert isinstance(data, torch.Tensor)
            tensors.append((item, data.detach()))
    return tensors, byte_items


def _is_checkpoint_exception(exc: BaseException) -> bool:
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(exc, CheckpointException)
