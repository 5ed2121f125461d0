"""Levels for DeepSpeed (``install(engine, levels=[...])``): each level is a DeepSpeed ``save_dir``, on the one
level runner (``schedule.Runner``; this module is its producer of tags).

A ``save_checkpoint`` at step ``engine.global_steps`` goes to the fastest level due at that step: the engine
writes the tag there, and its commit (the folder commit, then ``latest``) runs on that level's thread. Each
slower due level's thread, once that tag is published, copies every rank's own files of it (a file several
ranks wrote, once) and commits them with the same folder commit (all ranks or none), then its own ``latest``.
Every commit into a level runs on its thread in save order, on every rank alike. The runner bounds each
level's pending copies (``backlog``), pins a tag being copied, and keeps each level's newest ``keep`` tags
(never the one ``latest`` names). A level is one folder every rank shares, or node-local (each node its own
folder, found by ``cluster.probe``; the engine must then have DeepSpeed's ``use_node_local_storage``, so that
each node's first rank writes the model states there): each node's leader publishes its node's tag, writes
its ``latest`` and keeps. ``latest(levels)`` reads no other rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from lazyckpt.cluster import Replicator, Ring, Scope, StoreExchange, probe, replicated_index, restore_replicas
from lazyckpt.core.report import Report
from lazyckpt.errors import DistributedLevelError, DistributedSaveError, SaveRefusedError
from lazyckpt.levels import Level, Naming, list_steps
from lazyckpt.recovery import Found
from lazyckpt.schedule import Feed, Runner, check_levels, copy_checked
from lazyckpt.storage import fs as _fs

NAMING = Naming("global_step{step}", re.compile(r"global_step(\d+)"))
_STEP = re.compile(r"global_step(\d+)$")
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies beside its tags (0.19)


@dataclass(frozen=True)
class LevelCopy:
    """One slower level's copy of a tag: the level's index, its ``save_dir`` and its commit number."""

    index: int
    save_dir: str
    n: int = -1


class TagEngine(Protocol):
    """What the levels need of their ``LazyCheckpointEngine``."""

    def commit_tag(self, tag: Any) -> None: ...
    def copy_tag(self, tag: Any, copy: LevelCopy, failed: BaseException | None) -> DistributedLevelError | None: ...
    def hand_over_open(self) -> None: ...
    def report(self, error: BaseException) -> None: ...


@dataclass(eq=False)
class DeepSpeedLevels:
    """The levels of one installed engine: the runner's producer of its tags (``attach``)."""

    levels: tuple[Level, ...]
    scopes: tuple[Scope, ...]  # who shares each level's folder
    rank: int
    node_local_storage: bool  # DeepSpeed's: each node's first rank writes the model states (several ranks a name)
    replicator: Replicator | None = None  # the node-local level with replicas: its ring to the next nodes' memory
    engine: TagEngine | None = None
    runner: Runner | None = None

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

    def attach(self, engine: TagEngine) -> None:
        """The engine whose tags these levels hold; the runner starts (its threads on first use)."""
        self.engine = engine
        self.runner = Runner(
            self.levels, self, None, folder=True, name="lazyckpt-deepspeed-level", owns=self.leads, naming=NAMING,
            protect=self._named,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the level threads (after what they hold), then the replicator (it sends what is queued first,
        each transfer bounded by its group's timeout)."""
        if self.runner is not None:
            self.runner.close()
        if self.replicator is not None:
            self.replicator.close()

    # -- the training thread ---------------------------------------------------------------------------

    def due(self, step: int) -> list[int]:
        return [i for i, lv in enumerate(self.levels) if lv.due(step)]

    def admit(self, step: int, copies: Sequence[int]) -> list[int]:
        """Places in the slower due levels' backlogs for the save of ``step`` (every rank alike: it waits, never
        skips); at a bound, the open tag is handed over first (its copies may then go on)."""
        assert self.runner is not None and self.engine is not None
        engine = self.engine
        return [i for i in copies if self.runner.admit(i, step, None, engine.hand_over_open)]

    def refund(self, copies: Sequence[int]) -> None:
        """A save that never reached ``create``: its backlog places go back."""
        assert self.runner is not None
        self.runner.refund(copies)

    def begin(self, tag: Any) -> None:
        """``create``: the routed ``tag`` is the runner's source save at its level (its ``completion``); each
        admitted copy waits on its level's thread for it to be published."""
        assert self.runner is not None and tag.completion is not None
        runner, copies = self.runner, [c.index for c in tag.copies]
        feed = runner.begin(tag.step, tag.level, tag.final, copies, pin_save=False, context=tag)
        tag.leveled = runner.parts(feed, tag.completion.handle, tag.final, [tag.level, *copies], tag.t0)
        runner.sweep_once()
        runner.start(feed, copies, unpin_save=False)

    def saved_synchronously(self, step: int) -> None:
        """A signal handler saves ``step`` into the fastest level now (the stock engine): this run's step there,
        never removed as an earlier run's. Takes no lock."""
        if self.runner is not None:
            self.runner.saved_synchronously(0, step)

    def submit(self, tag: Any) -> bool:
        """A routed tag's commit, on its level's thread (False: closed)."""
        assert self.runner is not None
        return self.runner.submit(tag.level, tag)

    # -- the runner's producer (``schedule.LevelProducer``), on the level threads ------------------------

    def run(self, tag: Any) -> None:
        assert self.engine is not None
        self.engine.commit_tag(tag)

    def promote(self, index: int, feed: Feed) -> DistributedLevelError | None:
        """Level ``index``'s copy of a published tag, then its commit (every rank alike)."""
        assert self.engine is not None
        tag = feed.context
        tag.promoted.add(index)
        return self.engine.copy_tag(tag, self._copy(tag, index), None)

    def ended(self, index: int, feed: Feed) -> None:
        """A copy that did not run (its tag failed, alike on every rank): this rank still takes part in its
        commit, failed, so that a rank that saw the tag otherwise is not left waiting."""
        tag = feed.context
        if index not in tag.promoted and tag.folder and self.engine is not None:
            failed = tag.completion.handle.exception() or RuntimeError(f"lazyckpt: {tag.final} was not published")
            self.engine.copy_tag(tag, self._copy(tag, index), failed)

    def discard(self, path: str) -> None:  # pragma: no cover - the source is always a level's tag folder
        pass

    def remove(self, path: str) -> None:
        """Retention, by the folder's owner alone, here: a failure is logged, never raised by this rank's next save
        alone (which would fail that tag on every rank)."""
        _fs.remove_quietly(path)

    def remote_tier(self) -> Any:  # pragma: no cover - no URL levels here
        raise SaveRefusedError("lazyckpt.deepspeed: URL levels are not supported")

    def publish(self, report: Report) -> None:
        if report.claim() and self.engine is not None:
            self.engine.report(report.error)

    def reuse(self, index: int) -> None:
        return None

    @staticmethod
    def _copy(tag: Any, index: int) -> LevelCopy:
        return next(c for c in tag.copies if c.index == index)

    def _named(self, index: int) -> tuple[str, ...]:
        """Level ``index``'s tag that ``latest`` names: never removed (``save_latest=False`` saves came since)."""
        path = self.levels[index].path
        named = _latest_tag(path)
        return () if named is None else (os.path.join(path, named),)

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
    return NAMING.name(step)


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
    steps = list_steps(Level(save_dir), folder=True, naming=NAMING)
    return sorted(s for s, path in steps.items() if os.path.isdir(path))


def latest_in(save_dir: str, index: int = 0) -> Found | None:
    """The tag ``<save_dir>/latest`` names, if its folder is there."""
    tag = _latest_tag(save_dir)
    if not tag or not os.path.isdir(os.path.join(save_dir, tag)):
        return None
    m = _STEP.search(tag)  # (a custom tag ending in global_stepN counts as N, as before)
    return Found(save_dir, int(m.group(1)) if m else -1, index)


def _latest_tag(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, "latest")) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None
