"""Replicas of a node-local level in peers' memory (``Level(replicas=k)``), and their restore.

Written once for any producer whose committed step folder can say which files each rank owns and
their CRC32s as written (the primary's): the distributed checkpointer's DCP folders today.

Ring (``Ring``): the nodes are the groups of ranks sharing the level's folder (``Scope.groups``, in
rank order), all of one size; node ``g`` sends to nodes ``g+1 .. g+k`` (mod the node count), each
rank its own files to the rank of the same local index there, so every link carries one rank's
files and any node count >= k+1 works (no pairs). A node's replicas live in its partners' level
folders, ``<level>/replicas/node-<g>/step-<n>/``, each sender's part completed by an index written
last (``.lazyckpt-replica-from-<rank>.json``: names, sizes, the primary's CRC32s).

Save side (``Replicator``, one ``lazyckpt-replica`` thread per checkpointer): after a step is
committed at the level (on every rank alike, in commit order), the producer's level thread opens
this rank's files of the committed folder (so retention may unlink them meanwhile: the open file
keeps its bytes) and queues them, waiting only for a place among the level's ``backlog``: never
``save()`` or the training step. For each ``j`` in ``1..k`` the thread sends its files to
``peer(+j)`` and receives ``peer(-j)``'s, chunk by chunk (``Link``: sizes, a JSON header, chunks,
an acknowledgment), on a gloo group of its own (host buffers; never the training's group). The
receiver writes each file under a temporary name, checks its CRC32 against the primary's one in
the header, renames it, then writes the index: a torn transfer leaves no index, a corrupt one no
file. A failure (a dead partner: gloo's timeout or a closed pair; ENOSPC; a CRC mismatch at the
receiver, acknowledged back) records the step as not replicated (``ReplicationError``), warns once
per partner until a step succeeds again, and never fails the save; a pair that failed is not used
again (gloo closes it). ``keep`` applies to replicas: each holder node's first rank removes the
older steps (and an abandoned timeline's) of each node it holds.

Restore (``restore``, collective, at ``latest()``): every rank posts its node's own steps and the
replicas it holds; the same plan is computed everywhere: for each node, the replicated steps newer
than anything its own folder holds (the newest ``keep``), each from the first partner holding it.
The holder's rank of each local index sends back the part its index lists; the receiver checks
every CRC32 against the primary's and writes into a staging folder of the step; once every rank of
the node has its part, the node's first rank renames it to ``step-<n>``. Then ``latest()`` goes on
as before: every rank checks what it would load (CRCs again) and the ranks agree on a step.
GPU clusters: the same protocol runs on host buffers (the level is node memory), so gloo over the
cluster's TCP network is what carries it; a NCCL group would need the files staged back to device
memory and would share the training's streams and NICs with no gain for a background copy of a few
GB. A side channel (RDMA to a peer's pinned host buffers, as NVRx and Gemini do) is the faster
transport; it would replace ``Link`` only.
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

from lazyckpt.core import reentry
from lazyckpt.core.workers import Worker

from ..errors import ReplicationError, ReplicationWarning
from ._level import FOLDER_RE, Level, step_name
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
    """The steps of node ``node`` held here (folder names; each part's index says if it is whole)."""
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
    """Who sends one replicated level's files to whom (see the module docstring)."""

    groups: tuple[tuple[int, ...], ...]
    rank: int
    k: int

    @classmethod
    def of(cls, index: int, level: Level, scope: Scope, rank: int) -> Ring:
        """The ring of level ``index``; ``ValueError`` (alike on every rank: the scopes are) when it
        cannot be one: a level every rank shares, fewer than ``k + 1`` nodes, unequal nodes."""
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
    """What the replicator did so far (this rank): steps sent whole to every partner, bytes sent
    and received, and the steps recorded as not replicated (step -> the last ``ReplicationError``)."""

    steps_replicated: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    not_replicated: dict[int, ReplicationError] = field(default_factory=dict)


def warn_once(warned: set[int], partner: int, err: ReplicationError) -> None:
    """A ``ReplicationWarning`` for ``err``, once per ``partner`` until a step reaches it again
    (the caller discards it from ``warned`` then); logged otherwise. Called on a replication
    thread: under ``-W error`` the warning must not end the round."""
    if partner in warned:
        logger.info("%s", err)
        return
    warned.add(partner)
    try:
        warnings.warn(f"{err} (warned once per partner until a step reaches it again)", ReplicationWarning, 3)
    except Exception:  # noqa: BLE001
        logger.warning("%s", err)


class Replicator:
    """The save side (see the module docstring): one thread, one gloo group, one replicated level."""

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
        """On the level's thread, right after the commit of ``step`` at level ``index`` (every rank
        alike, in commit order; ``expect``ed at its save): open this rank's ``files`` of the
        committed ``folder`` and queue them; waits only for a place among the level's backlog."""
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
        """A save due at the replicated level was made (caller's thread): ``drain`` waits for it
        until its level thread ``submit``s or ``cancel``s it, exactly once."""
        with self._cond:
            self._queued += 1

    def cancel(self) -> None:
        """An expected step will not be replicated: its commit failed (on every rank alike)."""
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
        """``keep`` on the replicas of ``node`` held here (this node's first rank): the steps older
        than the newest ``keep`` received, and an abandoned timeline's (after this run's first
        step, never submitted by it)."""
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
