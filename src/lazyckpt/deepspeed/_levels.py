"""Levels for DeepSpeed (``install(engine, levels=[...])``): each level is a DeepSpeed ``save_dir``.

A ``save_checkpoint`` at step ``engine.global_steps`` goes to the fastest level due at that step (the engine
writes the tag there, published by the folder commit, then ``latest``); each slower due level gets, on the
commit thread once that tag is published, a copy of every rank's own files of it (each rank copies what it
wrote; a file several ranks wrote, once), committed with the same folder commit (all ranks or none), then its
own ``latest``. A level is one folder every rank shares, or node-local (each node its own folder, found by
``cluster.probe``; the engine must then have DeepSpeed's ``use_node_local_storage``, so that each node's first
rank writes the model states there): each node's leader publishes its node's tag, writes its ``latest`` and
keeps its newest ``keep`` tags. ``latest(levels)`` reads no other rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from lazyckpt.cluster import Replicator, Ring, Scope, StoreExchange, probe, replicated_index, restore_replicas
from lazyckpt.errors import DistributedLevelError, DistributedSaveError, SaveRefusedError
from lazyckpt.levels import Level
from lazyckpt.recovery import Found
from lazyckpt.schedule import check_levels, copy_checked
from lazyckpt.storage import fs as _fs

_STEP = re.compile(r"global_step(\d+)$")
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies beside its tags (0.19)


@dataclass(frozen=True)
class LevelCopy:
    """One slower level's copy of a tag: the level's index, its ``save_dir`` and its commit number."""

    index: int
    save_dir: str
    n: int = -1


@dataclass(eq=False)
class DeepSpeedLevels:
    """The levels of one installed engine: which are due at a step, and rank 0's retention per level."""

    levels: tuple[Level, ...]
    scopes: tuple[Scope, ...]  # who shares each level's folder
    rank: int
    node_local_storage: bool  # DeepSpeed's: each node's first rank writes the model states (several ranks a name)
    replicator: Replicator | None = None  # the node-local level with replicas: its ring to the next nodes' memory
    kept: dict[int, list[str]] = field(default_factory=dict)  # level index -> its tags, oldest first

    @classmethod
    def check(
        cls, levels: Sequence[Level], rank: int, world: int, token: str, all_gather: Any, node_local_storage: bool,
        fsync: bool = True, timeout: float = 60.0,
    ) -> DeepSpeedLevels:  # fmt: skip
        """Collective (``all_gather``, every rank): ``SaveRefusedError`` on every rank alike for a URL level, a
        node-local level without DeepSpeed's ``use_node_local_storage``, or replicas the ring cannot serve (a
        shared level, too few nodes); with replicas, a gloo group of their own (``timeout``: each transfer's)."""
        levels = tuple(levels)
        check_levels(levels)
        if len({os.path.abspath(lv.path) for lv in levels}) != len(levels):
            raise ValueError("lazyckpt.deepspeed: two levels have the same path")
        for i, level in enumerate(levels):
            if level.is_url:
                raise SaveRefusedError(
                    f"lazyckpt.deepspeed: level {i} ({level.path}): URL levels are not supported with DeepSpeed yet; "
                    "use folders"
                )
        try:
            scopes = probe(list(levels), token, rank, world, all_gather)
        except ValueError as exc:
            raise SaveRefusedError(f"lazyckpt.deepspeed: cannot probe the levels' folders: {exc}") from exc
        for i, scope in enumerate(scopes):
            if scope.node_local and not node_local_storage:
                raise SaveRefusedError(
                    f"lazyckpt.deepspeed: level {i} ({levels[i].path}) is node-local (ranks {list(scope.groups)} "
                    'see different folders): set "checkpoint": {"use_node_local_storage": true} in the DeepSpeed '
                    "config, so that each node's first rank writes the model states into its node's folder"
                )
        made = cls(levels, tuple(scopes), rank, node_local_storage)
        try:
            index = replicated_index(levels)
            rings = {} if index is None else {index: Ring.of(index, levels[index], scopes[index], rank)}
        except ValueError as exc:
            raise SaveRefusedError(f"lazyckpt.deepspeed: {exc}") from exc
        if rings:
            import torch.distributed as dist

            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(10.0, min(60.0, timeout))))
            made.replicator = Replicator(levels, rings, group, fsync)
        return made

    def committed(self, index: int, step: int, final: str, names: Sequence[str], ok: bool) -> None:
        """Commit thread, after level ``index``'s decision on the tag ``final`` (every rank alike, in order): with
        replicas there, this rank's files of it go to the same rank of the next nodes (``cluster.Replicator``)."""
        replicator = self.replicator
        if replicator is None or index not in replicator.rings or os.path.basename(final) != tag_name(step):
            return  # (a custom tag is not replicated: a restore names what it brings back global_stepN)
        replicator.expect()
        if ok:
            replicator.submit(index, step, final, [(name, None) for name in names])
        else:
            replicator.cancel()

    def close(self) -> None:
        if self.replicator is not None:  # sends what is queued first, each transfer bounded by its group's timeout
            self.replicator.close()

    def due(self, step: int) -> list[int]:
        return [i for i, lv in enumerate(self.levels) if lv.due(step)]

    def leads(self, index: int) -> bool:
        """Whether this rank owns level ``index``'s folder: publishes, writes ``latest``, keeps."""
        return self.scopes[index].leader == self.rank

    def share(self, index: int, names: Sequence[str], all_gather: Callable[[Any], list[Any]]) -> list[str]:
        """Collective (every rank, ``names`` empty for a rank that copies nothing): which of this rank's ``names``
        it copies into level ``index``'s folder: a name that several ranks sharing that folder wrote (each node's
        model states, with node-local storage) is copied by the lowest of them only."""
        if not self.node_local_storage:  # DeepSpeed's names are then one rank's each: no exchange
            return list(names)
        everyone = all_gather(sorted(names))
        group = self.scopes[index].group
        return [n for n in names if min(r for r in group if n in everyone[r]) == self.rank]

    def published(self, index: int, tag: str, remove: Callable[[str], Any]) -> None:
        """The folder's owner (``leads``), once ``tag`` is in place in level ``index`` (``latest`` written): the
        level's tags beyond its ``keep`` go, oldest first (the tags of earlier runs too: ``global_stepN`` by N)."""
        level = self.levels[index]
        if index not in self.kept:
            self.kept[index] = _existing_tags(level.path)
        tags = [t for t in self.kept[index] if t != tag] + [tag]
        if level.keep is None or len(tags) <= level.keep:
            self.kept[index] = tags
            return
        named = _latest_tag(level.path)  # never the tag ``latest`` names (``save_latest=False`` saves came since)
        old = [t for t in tags[: len(tags) - level.keep] if t != named]
        self.kept[index] = [t for t in tags if t not in old]
        for name in old:
            folder = os.path.join(level.path, name)
            if os.path.isdir(folder):
                remove(folder)


def copy_own_files(source: str, names: Sequence[str], staging: str, fsync: bool) -> None:
    """Copy this rank's files ``names`` of the published tag ``source`` into ``staging`` (made here), each
    fsynced (space reserved first: a full disk fails before any byte), then the folder."""
    for name in names:
        copy_checked(os.path.join(source, name), staging, name, None, fsync)
    os.makedirs(staging, exist_ok=True)
    if fsync:
        _fs.fsync_dir(staging)


def copy_scripts(source: str, target: str, fsync: bool) -> None:
    """DeepSpeed's recovery scripts in ``source`` (a ``save_dir``) written into ``target``, modes kept."""
    for name in SCRIPTS:
        path = os.path.join(source, name)
        if os.path.exists(path):
            _fs.write_bytes(os.path.join(target, name), Path(path).read_bytes(), fsync)
            os.chmod(os.path.join(target, name), os.stat(path).st_mode & 0o777)


def tag_name(step: int) -> str:
    """DeepSpeed's default tag of ``step``."""
    return f"global_step{step}"


def write_latest(save_dir: str, tag: str, fsync: bool) -> None:
    """The tag folder in place: ``<save_dir>/latest`` names it (written aside, fsynced, renamed over)."""
    _fs.write_bytes(os.path.join(save_dir, "latest"), tag.encode(), fsync)


def level_error(copy: LevelCopy, level: Level, step: int, error: DistributedSaveError) -> DistributedLevelError:
    """A slower level's failed copy (``error``: its folder commit's, alike on every rank), raised once."""
    err = DistributedLevelError(
        f"lazyckpt.deepspeed: level {copy.index} ({level.path}) did not get step {step}: {error}",
        copy.index, level.path, step, error.path or copy.save_dir, error.errno, ranks=tuple(error.ranks),
    )  # fmt: skip
    err.__cause__ = error.__cause__ or error
    return err


def latest(levels: Sequence[Level]) -> Found | None:
    """The newest tag any level's ``latest`` names whose folder is there (the fastest level on a tie; a custom
    tag counts as step -1)."""
    best: Found | None = None
    for i, level in enumerate(levels):
        found = latest_in(level.path, i)
        if found is not None and (best is None or found.step > best.step):
            best = found
    return best


def latest_restored(levels: Sequence[Level], timeout: float) -> Found | None:
    """Collective (every rank, through the c10d store): each node's folder of a level with replicas first gets
    back the tags its peers hold newer than its own (``cluster.restore_replicas``), its ``latest`` then naming
    the newest restored where that is newer; then ``latest(levels)`` on every rank, which must agree
    (``RuntimeError`` naming what each rank found otherwise: load with an explicit tag)."""
    exchange = StoreExchange.default(timeout)
    token = hashlib.sha1(exchange.prefix.encode()).hexdigest()
    scopes = probe(list(levels), token, exchange.rank, exchange.world, exchange.all_gather)
    before = [_steps(lv.path) for lv in levels]
    restore_replicas(levels, exchange, scopes, own=lambda lv: _steps(lv.path),
                     folder=lambda lv, step: os.path.join(lv.path, tag_name(step)))  # fmt: skip
    for level, scope, had in zip(levels, scopes, before, strict=True):
        restored = set(_steps(level.path)) - set(had)
        named = latest_in(level.path)
        if restored and scope.leader == exchange.rank and max(restored) > (-1 if named is None else named.step):
            write_latest(level.path, tag_name(max(restored)), fsync=True)
    exchange.all_gather(None)  # every leader's latest written before any rank of its node reads it
    found = latest(levels)
    everyone = exchange.all_gather(None if found is None else [found.step, found.level])
    if len({json.dumps(f) for f in everyone}) > 1:
        raise RuntimeError(
            f"lazyckpt.deepspeed.latest: the ranks found different tags ([step, level] by rank: {everyone}); "
            "load a tag every rank holds explicitly (engine.load_checkpoint(save_dir, tag=...))"
        )
    return found


def _steps(save_dir: str) -> list[int]:
    """The N of the ``global_stepN`` folders in ``save_dir``, oldest first."""
    return [int(m.group(1)) for name in _existing_tags(save_dir) if (m := _STEP.search(name))]


def latest_in(save_dir: str, index: int = 0) -> Found | None:
    """The tag ``<save_dir>/latest`` names, if its folder is there."""
    tag = _latest_tag(save_dir)
    if not tag or not os.path.isdir(os.path.join(save_dir, tag)):
        return None
    m = _STEP.search(tag)
    return Found(save_dir, int(m.group(1)) if m else -1, index)


def _latest_tag(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, "latest")) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


def _existing_tags(save_dir: str) -> list[str]:
    """The ``global_stepN`` folders already in ``save_dir``, oldest first."""
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return []
    steps = [(int(m.group(1)), n) for n in names if (m := _STEP.fullmatch(n))]
    return [n for _, n in sorted(steps) if os.path.isdir(os.path.join(save_dir, n))]
