"""Replicas of a node-local level in peers' memory (``Level(replicas=k)``) where every rank saves
every step (DCP folders); one writer's files: ``_single.py``; restore: ``_restore.py``.

Ring: node ``g`` sends to nodes ``g+1 .. g+k``, each rank its own files to the same local rank, into
``<level>/replicas/node-<g>/step-<n>/`` with a per-sender index written last. ``Replicator`` runs one
``lazyckpt-replica`` thread; it never blocks ``save()`` beyond the backlog, and a failure never fails
a save (``ReplicationError``, warned once per partner; a failed pair is not used again).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.errors import ReplicationError, ReplicationWarning
from lazyckpt.levels import FOLDER_RE, Level, step_name
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

from ._topology import Scope
from ._wire import CRC_MISMATCH as _CRC
from ._wire import OK as _OK
from ._wire import Link, OutFile, Sink, header_of, open_files

logger = logging.getLogger(__name__)

REPLICAS = "replicas"
INDEX_PREFIX = ".lazyckpt-replica-from-"


def node_folder(level: Level, node: int) -> str:
    return os.path.join(level.path, REPLICAS, f"node-{node:04d}")


def replica_folder(level: Level, node: int, step: int) -> str:
    return os.path.join(node_folder(level, node), step_name(step, folder=True))


def replica_steps(level: Level, node: int) -> list[int]:
    """The steps of node ``node`` held here, by folder name (a part is whole only with its index)."""
    try:
        names = os.listdir(node_folder(level, node))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for name in names if (m := FOLDER_RE.match(name)))


def replicated_index(levels: Sequence[Level]) -> int | None:
    """The index of the one level with ``replicas``; None for none; ``ValueError`` for two."""
    found = [i for i, lv in enumerate(levels) if lv.replicas]
    if len(found) > 1:
        raise ValueError(f"levels {found} both have replicas: give replicas to one level (node memory)")
    return found[0] if found else None


@dataclass(frozen=True)
class Ring:
    """Who sends one replicated level's files to whom."""

    groups: tuple[tuple[int, ...], ...]
    rank: int
    k: int

    @classmethod
    def of(cls, index: int, level: Level, scope: Scope, rank: int) -> Ring:
        """The ring of level ``index``; ``ValueError`` (on every rank alike) for a shared level,
        fewer than ``k + 1`` nodes, or nodes of unequal size."""
        k = int(level.replicas)
        if not scope.node_local:
            raise ValueError(
                f"level {index} ({level.path}): replicas={k} needs a node-local level (each node its own folder, "
                "e.g. /dev/shm/run on every node), but every rank sees this folder: it is already shared"
            )
        if len(scope.groups) < k + 1:
            raise ValueError(
                f"level {index} ({level.path}): replicas={k} needs at least {k + 1} nodes, the job has "
                f"{len(scope.groups)}"
            )
        if len({len(g) for g in scope.groups}) != 1:
            raise ValueError(
                f"level {index} ({level.path}): replicas need the same number of ranks on every node, got "
                f"{[list(g) for g in scope.groups]}"
            )
        return cls(tuple(scope.groups), rank, k)

    def node_of(self, rank: int) -> int:
        return next(i for i, g in enumerate(self.groups) if rank in g)

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local(self) -> int:
        return self.groups[self.node].index(self.rank)

    def peer(self, offset: int, node: int | None = None, local: int | None = None) -> int:
        """The rank ``offset`` nodes on from ``node`` (default: this rank's) at local index ``local``."""
        g = (self.node if node is None else node) + offset
        return self.groups[g % len(self.groups)][self.local if local is None else local]


@dataclass(eq=False)
class _Item:
    index: int
    step: int
    files: list[OutFile]


@dataclass
class ReplicationStats:
    """This rank's replication so far: steps sent to every partner, bytes sent and received, and
    the steps not replicated (step -> the last ``ReplicationError``)."""

    steps_replicated: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    not_replicated: dict[int, ReplicationError] = field(default_factory=dict)


def warn_once(warned: set[int], partner: int, err: ReplicationError) -> None:
    """A ``ReplicationWarning`` for ``err`` once per ``partner`` (until the caller discards it from
    ``warned``), logged otherwise. Replication thread: never raises, even under ``-W error``."""
    if partner in warned:
        logger.info("%s", err)
        return
    warned.add(partner)
    try:
        warnings.warn(f"{err} (warned once per partner until a step reaches it again)", ReplicationWarning, 3)
    except Exception:  # noqa: BLE001
        logger.warning("%s", err)


class Replicator:
    """The save side: one thread, one gloo group, one replicated level."""

    def __init__(self, levels: Sequence[Level], rings: dict[int, Ring], group: Any, fsync: bool) -> None:
        self.levels, self.rings, self.group, self.fsync = levels, rings, group, fsync
        self._link = Link(group)
        self._worker: Worker[_Item] = Worker("lazyckpt-replica", self._run, lazy=True)
        self._slots = {i: threading.Semaphore(levels[i].backlog) for i in rings}
        self._cond = reentry.condition()
        self._queued = 0
        self._broken: set[int] = set()  # partners whose pair failed (gloo closes it for good)
        self._warned: set[int] = set()
        self._submitted: dict[int, set[int]] = {i: set() for i in rings}
        self.stats = ReplicationStats()

    def submit(self, index: int, step: int, folder: str, files: Sequence[tuple[str, int | None]]) -> None:
        """Level thread, right after ``step``'s commit (every rank alike, in commit order; ``expect``ed
        at its save): open this rank's ``files`` of ``folder`` and queue them; waits only for backlog."""
        try:
            opened = open_files(folder, files)
        except OSError as exc:  # nothing to send: the partners still expect this round
            logger.warning("lazyckpt: step %d: cannot read its files to replicate them: %s", step, exc)
            opened = []
        self._slots[index].acquire()
        with self._cond:
            self._submitted[index].add(step)
        if not self._worker.submit(_Item(index, step, opened)):
            self._ended(_Item(index, step, opened))

    def expect(self) -> None:
        """Caller's thread, at a save due at the replicated level: ``drain`` waits for it until it is
        ``submit``ted or ``cancel``led, exactly once."""
        with self._cond:
            self._queued += 1

    def cancel(self) -> None:
        """An expected step will not be replicated (its commit failed on every rank)."""
        with self._cond:
            self._queued -= 1
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every queued replication (bounded by the group's timeout per partner)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued == 0, timeout)

    def close(self) -> None:
        self._worker.stop()

    def _ended(self, item: _Item) -> None:
        for f in item.files:
            f.close()
        self._slots[item.index].release()
        with self._cond:
            self._queued -= 1
            self._cond.notify_all()

    def _run(self, item: _Item) -> None:
        try:
            self._replicate(item)
        except BaseException:  # noqa: BLE001 - a bug: the step is not replicated, the thread goes on
            logger.exception("lazyckpt: replication of step %d failed unexpectedly", item.step)
        finally:
            self._ended(item)

    def _replicate(self, item: _Item) -> None:
        ring, level = self.rings[item.index], self.levels[item.index]
        whole = True
        for j in range(1, ring.k + 1):
            dst, src = ring.peer(j), ring.peer(-j)
            send_to = None if dst in self._broken else dst
            recv_from = None if src in self._broken else src
            src_node = ring.node_of(src)
            folder = replica_folder(level, src_node, item.step)
            index_name = f"{INDEX_PREFIX}{src}.json"

            def sink_for(head: dict[str, Any], folder: str = folder, name: str = index_name) -> Sink:
                return Sink(folder, head, self.fsync, name)

            header = header_of(item.files, step=item.step, node=ring.node, **{"from": self.rank})
            try:
                receiving = sink_for if recv_from is not None else None
                ack, sink = self._link.run(send_to, header, item.files, recv_from, receiving)
            except Exception as exc:  # noqa: BLE001 - the pair is gone: never used again
                self._broken.update(r for r in (send_to, recv_from) if r is not None)
                if send_to is not None:
                    self._failed(item, dst, None, f"the link to rank {dst} failed: {exc}")
                    whole = False
                continue
            if sink is not None:
                self.stats.bytes_received += sum(int(f["size"]) for f in sink.header.get("files", []))
                if sink.error is not None:
                    logger.warning("lazyckpt: step %d from rank %d: replica not stored: %s", item.step, src, sink.error)
                elif ring.local == 0:
                    self._retain(item.index, src_node, item.step)
            if send_to is None:
                if dst in self._broken:
                    self._failed(item, dst, None, f"rank {dst}'s pair failed earlier")
                whole = False
            elif ack != _OK:
                code = ack if ack is not None and ack > 0 else None
                why = (
                    "the bytes it received did not match the primary's CRC32"
                    if ack == _CRC
                    else "it could not store them"
                )
                self._failed(item, dst, code, why + (f" ({os.strerror(code)})" if code else ""))
                whole = False
            else:
                self.stats.bytes_sent += sum(f.size for f in item.files)
                self._warned.discard(dst)
        if whole:
            self.stats.steps_replicated += 1

    @property
    def rank(self) -> int:
        return next(iter(self.rings.values())).rank

    def _failed(self, item: _Item, partner: int, code: int | None, why: str) -> None:
        level = self.levels[item.index]
        err = ReplicationError(
            f"lazyckpt: level {item.index} ({level.path}), step {item.step}: not replicated to rank {partner}: {why}; "
            "the local copy stands",
            item.index, level.path, item.step, level.folder(item.step), errno=code, partner=partner,
        )  # fmt: skip
        self.stats.not_replicated[item.step] = err
        warn_once(self._warned, partner, err)

    def _retain(self, index: int, node: int, step: int) -> None:
        """``keep`` on ``node``'s replicas held here (this node's first rank); an abandoned timeline's
        steps go too."""
        level = self.levels[index]
        with self._cond:
            submitted = set(self._submitted[index])
        held = replica_steps(level, node)
        done = [s for s in held if s <= step and s in submitted]
        kept = set(done[-level.keep :]) if level.keep is not None else set(done)
        first = min(submitted)
        victims = [s for s in held if (s < step and s not in kept) or (s > first and s not in submitted)]
        for s in victims:
            shutil.rmtree(replica_folder(level, node, s), ignore_errors=True)
