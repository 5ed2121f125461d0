"""``restore``: at ``latest()``, a node's replicated steps brought back from its partners' replicas
(see ``_replica.py``), collective over every rank."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from lazyckpt.errors import ReplicationWarning
from lazyckpt.levels import Level, list_steps, step_name
from lazyckpt.storage import fs as _fs

from ._collective import StoreExchange
from ._replica import INDEX_PREFIX, Ring, replica_folder, replica_steps
from ._topology import Scope, probe
from ._wire import Link, OutFile, Sink, header_of, open_files

logger = logging.getLogger(__name__)

RESTORE_SUFFIX = ".lazyckpt-replica-restore.tmp"


def step_folders(level: Level) -> list[int]:
    """The steps of ``level``'s own ``step-<n>`` folders (the default ``own`` of ``restore``)."""
    return sorted(list_steps(level, folder=True))


def restore_replicas(
    levels: Sequence[Level],
    exchange: StoreExchange,
    scopes: Sequence[Scope] | None = None,
    group: Any = None,
    own: Callable[[Level], list[int]] = step_folders,
    folder: Callable[[Level, int], str] = Level.folder,
) -> bool:
    """Collective ``restore`` through ``exchange``: ``scopes`` probed when not given; over ``group``, else a gloo
    group made (only when needed) and destroyed here."""
    if scopes is None:
        token = hashlib.sha1(exchange.prefix.encode()).hexdigest()
        scopes = probe(levels, token, exchange.rank, exchange.world, exchange.all_gather)
    made: list[Any] = []

    def the_group() -> Any:
        if group is not None:
            return group
        import torch.distributed as dist

        made.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=max(30.0, min(exchange.timeout, 600.0)))))
        return made[-1]

    try:
        return restore(levels, scopes, exchange.all_gather, exchange.rank, the_group, own=own, folder=folder)
    finally:
        if made:
            import torch.distributed as dist

            dist.destroy_process_group(made[0])


def restore(
    levels: Sequence[Level],
    scopes: Sequence[Scope],
    all_gather: Callable[[Any], list[Any]],
    rank: int,
    group: Callable[[], Any],
    fsync: bool = True,
    own: Callable[[Level], list[int]] = step_folders,
    folder: Callable[[Level, int], str] = Level.folder,
) -> bool:
    """Collective (``all_gather`` over every rank): bring back into each node's level folder the
    replicated steps newer than its own (``own(level)``), every CRC checked against the primary's,
    staged then renamed to ``folder(level, step)``. ``group()``: the gloo group, made only when needed.
    True when some step was restored."""
    replicated = [i for i, lv in enumerate(levels) if lv.replicas and scopes[i].node_local]
    if not replicated:
        return False
    rings = {i: Ring.of(i, levels[i], scopes[i], rank) for i in replicated}
    mine: dict[str, Any] = {}
    for i in replicated:
        ring, level = rings[i], levels[i]
        if ring.local == 0:
            _clean_restores(level)
        own_steps = own(level)
        held = {str(g): replica_steps(level, g) for g in range(len(ring.groups)) if g != ring.node}
        mine[str(i)] = {"own": own_steps, "held": held}
    everyone = all_gather(mine)
    pending = _plan(levels, rings, everyone)  # {(level, node): [(step, holder node), ...] newest first}
    if not pending:
        return False
    link = Link(group())
    restored = False
    while pending:  # one round per candidate: the newest first, an older one only where it failed
        batch = [(i, node, *cands[0]) for (i, node), cands in sorted(pending.items())]
        results = [
            _transfer(levels[i], i, rings[i], node, step, holder, link, rank, fsync) for i, node, step, holder in batch
        ]
        answers = all_gather(results)
        for n, (i, node, step, _) in enumerate(batch):
            ring, level = rings[i], levels[i]
            whole = all(answers[r][n] for r in ring.groups[node])
            if ring.node == node and ring.local == 0:
                restored |= _publish(level, step, folder(level, step), whole, fsync)
            cands = pending.pop((i, node))[1:]
            if not whole and cands:
                pending[(i, node)] = cands
    return any(all_gather(restored))  # every node's folder is in place before any rank checks it


def _transfer(level: Level, i: int, ring: Ring, node: int, step: int, holder: int, link: Link, rank: int,
              fsync: bool) -> bool:  # fmt: skip
    """This rank's part of restoring ``node``'s ``step`` from ``holder``: send, receive into the
    staging folder, or nothing. False when this rank received no whole part."""
    if ring.node not in (node, holder):
        return True
    if ring.node == holder:  # send back the part of the rank of my local index on that node
        source = ring.groups[node][ring.local]
        files, header = _part(level, node, step, source)
        try:
            link.run(source, header, files, None, None)
        except Exception as exc:  # noqa: BLE001 - the receiver learns it as a failed part
            logger.warning("lazyckpt.latest: sending the replica of step %d to rank %d failed: %s", step, source, exc)
        finally:
            for f in files:
                f.close()
        return True
    sender = ring.groups[holder][ring.local]
    sink: Sink | None = None
    why: Any = "no whole part there"
    try:
        _, sink = link.run(None, None, [], sender, functools.partial(_restore_sink, _staging(level, step), fsync))
    except Exception as exc:  # noqa: BLE001 - not restored: an older step or a slower level
        why = f"the link failed: {exc}"
    ok = sink is not None and sink.error is None and bool(sink.header.get("whole", False))
    if not ok:
        why = sink.error if sink is not None and sink.error is not None else why
        warnings.warn(
            f"lazyckpt.latest: the replica of step {step} (level {i}, {level.path}) held by rank {sender} cannot "
            f"be restored on rank {rank}: {why}; an older step or a slower level is used",
            ReplicationWarning,
            stacklevel=4,
        )
    return ok


def _staging(level: Level, step: int) -> str:
    return os.path.join(level.path, f".{step_name(step, folder=True)}{RESTORE_SUFFIX}")


def _publish(level: Level, step: int, final: str, whole: bool, fsync: bool) -> bool:
    """The node's first rank: rename the staging folder to ``final`` if ``whole``, else remove it."""
    staging = _staging(level, step)
    if whole and not os.path.lexists(final):
        _fs.publish_folder(staging, final, fsync)
        logger.warning("lazyckpt.latest: restored %s from a peer's replica", final)
        return True
    shutil.rmtree(staging, ignore_errors=True)
    return False


def _part(level: Level, node: int, step: int, source: int) -> tuple[list[OutFile], dict[str, Any]]:
    """The files and header this holder sends back for ``source``'s part of ``node``'s step (a
    header with ``whole`` False when it holds no whole part)."""
    folder = replica_folder(level, node, step)
    try:
        with open(os.path.join(folder, f"{INDEX_PREFIX}{source}.json")) as stream:
            index = json.load(stream)
        files = open_files(folder, [(e["name"], int(e["crc32"])) for e in index["files"]])
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("lazyckpt.latest: replica of step %d of rank %d: %s", step, source, exc)
        return [], {"files": [], "whole": False}
    if any(f.size != int(e["size"]) for f, e in zip(files, index["files"], strict=True)):
        for f in files:
            f.close()
        return [], {"files": [], "whole": False}
    return files, header_of(files, whole=True)


Plan = dict[tuple[int, int], list[tuple[int, int]]]


def _plan(levels: Sequence[Level], rings: dict[int, Ring], everyone: list[Any]) -> Plan:
    """{(level, node): [(step, holder node), ...]}: each node's replicated steps newer than its own,
    newest first (at most ``keep``), each from the first partner holding it; alike on every rank."""
    plan: Plan = {}
    for i, ring in sorted(rings.items()):
        for node, group in enumerate(ring.groups):
            newest = max(everyone[group[0]][str(i)]["own"], default=-1)
            holders: dict[int, int] = {}
            for j in range(1, ring.k + 1):
                h = (node + j) % len(ring.groups)
                for s in everyone[ring.groups[h][0]][str(i)]["held"].get(str(node), []):
                    if s > newest:
                        holders.setdefault(s, h)
            steps = sorted(holders, reverse=True)[: levels[i].keep or None]
            if steps:
                plan[(i, node)] = [(s, holders[s]) for s in steps]
    return plan


def _restore_sink(staging: str, fsync: bool, head: dict[str, Any]) -> Sink:
    return Sink(staging, head, fsync, None)


def _clean_restores(level: Level) -> None:
    try:
        names = os.listdir(level.path)
    except OSError:
        return
    for name in names:
        if name.endswith(RESTORE_SUFFIX):
            shutil.rmtree(os.path.join(level.path, name), ignore_errors=True)
