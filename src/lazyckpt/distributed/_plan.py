"""DCP planning on the caller's thread: which items this rank writes, and the global metadata.

DCP's save pipeline up to ``finish_plan``, run on the checkpointer's own gloo group (never the
training's). A planning failure on any rank raises ``SaveRefusedError`` on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import _DistWrapper
from torch.distributed.tensor import DTensor

from ..errors import SaveRefusedError


@dataclass
class RankPlan:
    """This rank's share of one save."""

    planner: DefaultSavePlanner
    items: list[WriteItem]  # what this rank writes (replicated items: only those assigned to it)
    staging: str  # the staging directory the coordinator made
    metadata: Metadata | None  # the coordinator's global metadata (storage data filled in at commit)
    cached: bool = False  # the global plan was the previous one's (no plans exchanged)
    needs: frozenset[Any] = frozenset()  # every item this rank holds (its local plan, before deduplication)


@dataclass
class PlanCache:
    """The last global plan, this rank's part: reused while every rank's local plan is unchanged
    (compared by digest); ``metadata`` is copied per save (the commit fills in its storage data)."""

    digest: bytes = b""
    round: int = -1  # the save number whose full planning filled this cache
    items: list[WriteItem] | None = None
    metadata: Metadata | None = None
    local_key: bytes | None = None  # _state_key of the state the local plan below was made for
    local_plan: SavePlan | None = None
    needs: frozenset[Any] = frozenset()  # the item indices of ``local_plan``


def plan_save(
    state: dict[str, Any],
    wrapper: _DistWrapper,
    final: str,
    prepare: Callable[[], str],
    cache: PlanCache | None = None,
    round_no: int = 0,
    groups: list[list[int]] | None = None,
) -> RankPlan:
    """Collective over ``wrapper``'s group; raises ``SaveRefusedError`` on every rank if planning
    fails. ``prepare`` runs on the coordinator only, inside the collective (so its failure reaches
    every rank), and returns the staging folder. ``cache``: when every rank's local plan is
    unchanged since the same round, the cached global plan is used (one small collective).
    ``groups`` (a partition of the ranks): replicated items are deduplicated within each group only,
    and every rank gets the global ``Metadata``."""
    planner = DefaultSavePlanner()
    metadata: Metadata | None = None
    local: list[Any] = []
    share = groups is not None

    def local_step() -> Any:
        if not local:
            planner.set_up_planner(state, StorageMeta(checkpoint_id=final), wrapper.is_coordinator)
            key = _state_key(planner.state_dict) if cache is not None else None
            if cache is not None and key is not None and key == cache.local_key and cache.local_plan is not None:
                # DefaultSavePlanner.create_local_plan, without recomputing every shard's offsets
                planner.plan = dataclasses.replace(cache.local_plan, planner_data=planner.mappings)
                needs = cache.needs
            else:
                planner.create_local_plan()
                needs = frozenset(item.index for item in planner.plan.items) if share else frozenset()
                if cache is not None:
                    cache.local_key, cache.local_plan, cache.needs = key, planner.plan, needs
            local.append(planner.plan)
            local.append(needs)
            # The state key identifies the local plan; without one (ShardedTensor), a digest of its items.
            local.append(key if key is not None or cache is None else _digest(planner.plan.items))
        return local[0]

    def global_step(plans: list[Any]) -> list[Any]:
        nonlocal metadata
        deduped, metadata = planner.create_global_plan(plans)
        if groups is not None:  # the metadata does not depend on who writes a replica
            deduped = _dedup_within(plans, groups)
        staging = prepare()
        payload = (staging, metadata) if share else staging
        return [dataclasses.replace(p, storage_data=payload) for p in deduped]

    def probe() -> tuple[bool, int]:
        local_step()
        digest = local[2]
        assert cache is not None
        return cache.items is not None and cache.digest == digest, cache.round

    def decide(answers: list[tuple[bool, int]]) -> str | None:
        rounds = {r for _, r in answers}
        if all(hit for hit, _ in answers) and len(rounds) == 1:
            return prepare()
        return None

    try:
        if cache is not None:
            staging = wrapper.all_reduce("plan", probe, decide)
            if staging is not None:
                assert cache.items is not None
                meta = copy.copy(cache.metadata) if wrapper.is_coordinator or share else None
                return RankPlan(planner, cache.items, staging, meta, cached=True, needs=local[1])
        central = wrapper.reduce_scatter("plan", local_step, global_step)
    except BaseException as exc:  # CheckpointException derives from BaseException
        if isinstance(exc, RuntimeError):  # the channel itself (a peer died, a timeout): as stock DCP raises it
            raise
        if isinstance(exc, Exception) and not isinstance(exc, SaveRefusedError):  # the collective's payloads
            raise SaveRefusedError(
                f"planning the save to {final} failed (did every rank call save() with the same path?): {exc}"
            ) from exc
        if not _is_checkpoint_exception(exc):
            raise
        ranks = sorted(getattr(exc, "failures", {}))
        raise SaveRefusedError(
            f"planning the save to {final} failed on rank(s) {ranks}; nothing was written:\n{exc}"
        ) from exc
    staging, metadata = central.storage_data if share else (central.storage_data, metadata)
    items = planner.finish_plan(dataclasses.replace(central, storage_data=staging)).items
    if cache is not None:
        cache.digest = local[2]
        cache.round, cache.items, cache.metadata = round_no, items, copy.copy(metadata)
    return RankPlan(planner, items, staging, metadata, needs=local[1])


def _dedup_within(plans: list[SavePlan], groups: list[list[int]]) -> list[SavePlan]:
    """DCP's deduplication of replicated items, within each group of ranks only."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    out: list[SavePlan | None] = [None] * len(plans)
    for group in groups:
        for rank, plan in zip(group, dedup_save_plans([plans[r] for r in group]), strict=True):
            out[rank] = plan
    assert all(p is not None for p in out), "groups must cover every rank"
    return [p for p in out if p is not None]


def _state_key(flat: dict[str, Any]) -> bytes | None:
    """A digest of what DCP's local plan depends on in a flattened state dict; None (no caching)
    for tensor containers other than plain tensors and DTensors (ShardedTensor)."""
    h = hashlib.sha256()
    for fqn, obj in flat.items():
        if isinstance(obj, DTensor):
            local = _local(obj)
            desc: tuple[Any, ...] = (
                "D", tuple(obj.shape), repr(obj.placements), id(obj.device_mesh), tuple(local.shape),
                str(local.dtype), str(local.layout), local.requires_grad, local.is_pinned(),
            )  # fmt: skip
        elif type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            desc = ("T", tuple(obj.shape), str(obj.dtype), str(obj.layout), obj.requires_grad, obj.is_pinned())
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None
        else:
            desc = ("B",)  # a BYTE_IO item, whatever the value
        h.update(repr((fqn, desc)).encode())
    return h.digest()


def _local(dt: DTensor) -> torch.Tensor:
    """This rank's shard of ``dt``: ``to_local()`` with autograd off."""
    with torch.no_grad():
        return dt.to_local()


def _digest(items: list[WriteItem]) -> bytes:
    """A digest of a local plan's items (cheaper than pickling them)."""
    h = hashlib.sha256()
    for it in items:
        td = it.tensor_data
        tensor = None
        if td is not None:
            p = td.properties
            props = (str(p.dtype), str(p.layout), p.requires_grad, str(p.memory_format), p.pin_memory)
            tensor = (tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes), props)
        offset = None if it.index.offset is None else tuple(it.index.offset)
        h.update(repr((it.index.fqn, offset, it.index.index, it.type.value, tensor)).encode())
    return h.digest()


def resolve(plan: RankPlan) -> tuple[list[tuple[WriteItem, torch.Tensor]], list[tuple[WriteItem, bytes]]]:
    """This rank's tensors (local shards, assigned replicas) and its non-tensor values, serialized
    now (``torch.save`` bytes, as DCP writes them)."""
    tensors: list[tuple[WriteItem, torch.Tensor]] = []
    byte_items: list[tuple[WriteItem, bytes]] = []
    flat = plan.planner.state_dict
    for item in plan.items:
        obj = flat.get(item.index.fqn)
        data: torch.Tensor | io.BytesIO
        if isinstance(obj, DTensor) and item.type != WriteItemType.BYTE_IO:
            data = _local(obj)
        else:
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
