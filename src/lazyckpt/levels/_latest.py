"""``latest(levels)``: the newest step complete at some level, verified; the fastest level holding it.

Works on names and files only (``_level.list_steps``, ``lazyckpt.verify`` for files,
``recovery.check.folder_problems`` for folder checkpoints), not on who wrote them: a restarted
process, another node, or a distributed saver's folders are read the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from lazyckpt.core.warn import user_stacklevel
from lazyckpt.recovery import READ_THREADS, FileIdentity
from lazyckpt.recovery.check import folder_problems
from lazyckpt.recovery.dcp import is_dcp_folder, rank_problems
from lazyckpt.recovery.verify import verify as verify_file
from lazyckpt.storage import remote as _remote

from ..errors import IncompleteCheckpointWarning
from . import _collective, _single
from ._found import Found, Preread
from ._level import Level, as_level, list_steps, step_of
from ._preread import preread
from ._replica import replicated_index
from ._restore import restore
from ._topology import Scope, probe

logger = logging.getLogger(__name__)


def latest(
    levels: Iterable[Level | str | os.PathLike[str]],
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    *,
    collective: bool | None = None,
    timeout: float = 600.0,
    threads: int = READ_THREADS,
    preload: bool = True,
) -> Found | None:
    """The newest step that is complete at some level and passes verification (every CRC; a URL
    by ranged reads); among the levels holding that step, the first one given (the fastest).

    A copy that fails verification (torn, corrupt, truncated) is skipped with an
    ``IncompleteCheckpointWarning`` naming it, and the next candidate is tried: the same step at a
    slower level, then older steps. ``None`` when no level holds a complete checkpoint. A level
    that cannot be listed (a missing bucket, no credentials) is skipped with a warning.
    ``verify=False`` trusts the names of files (each is made by an atomic rename or object
    creation) and checks only the completeness of folders (no pending marker; at a URL, its last
    key), not their CRCs.

    Folder checkpoints (``step-<8 digits>``: Accelerate folders, DCP folders) are candidates as
    files are; a folder is complete and intact when ``recovery.check.folder_problems`` says so.
    When a level holds a step as both a file and a folder, the file is the candidate.

    Distributed checkpoints (``lazyckpt.distributed.DistributedCheckpointer(levels=...)``): in a
    job (torch.distributed initialized with more than one rank) whose levels hold DCP folders of
    ``lazyckpt.distributed``, it is collective: call it on every rank (each with its own levels: a
    node-local level's folder is its node's), and every rank gets the same step, the newest that
    every rank can load from some level (see ``_collective.py``): such a folder is checked for what
    this rank reads (its own items, when the job has the layout that saved it; else the whole
    folder, which then must be a whole checkpoint, loadable with resharding), anything else whole.
    ``found.path`` and ``found.level`` are this rank's fastest usable copy. A rank that does not
    answer within ``timeout`` seconds makes the others raise ``TimeoutError`` naming it; a rank
    whose levels hold nothing posts so and returns None at once (no step is held by every rank).
    Levels holding other checkpoints only (files, Accelerate folders) are this process's own view,
    as outside a job (callers that pick on one process and broadcast keep working).
    ``collective=True`` / ``False`` forces either. With a level with ``replicas`` whose folders hold
    one writer's files (``LazyCheckpointer(levels=)`` saved by rank 0), it is collective too: the
    newest step any node holds whole is first copied into every node's folder that lacks it
    (``_single.restore_files``), and the ranks must end on one step (else ``RuntimeError``).

    ``threads``: readers of a local file, whose CRCs are computed as it is read (see
    ``recovery/_read.py``); the ``Found`` names the file so checked (``Found.verified``), and
    ``load()`` does not check it again. ``preload`` (default True, with ``verify``): that one pass
    reads a torch.save file's storages into memory of their own, as ``load()`` would, and the
    ``Found`` holds them (``Found.preread``) until ``lazyckpt.load(found)`` takes them: a resume
    reads the file once (``latest()`` costs the allocation, ``load()`` only the unpickling).
    ``preload=False`` for a caller that only wants the name (``found.path`` read by another loader);
    a ``Found`` dropped unused frees them."""
    listings = _listings(levels, storage_options)
    is_dcp = lambda path: is_dcp_folder(path, storage_options)  # noqa: E731
    single = collective is None and _replicated(levels) and _single.files_of_one_writer(listings, is_dcp, timeout)
    if not single and _collective.active(collective, listings, is_dcp):
        return latest_agreed(levels, _collective.StoreExchange.default(timeout), storage_options, verify, listings)
    if single:
        entries = [as_level(entry) for entry in levels]
        index = replicated_index(entries)
        assert index is not None
        # read ahead by the restore's check (a node's first rank): _newest takes them, not a second read
        checked = _single.restore_files(entries, index, min(timeout, 60.0), fsync=False, threads=threads,
                                        preload=preload and verify)  # fmt: skip
        listings = _listings(levels, storage_options)  # a node's folder may have gained the newest step
    found = _newest(listings, storage_options, verify, threads, preload)
    if single:
        del checked  # what _newest did not take is freed
        _single.agree(None if found is None else found.step, min(timeout, 60.0))
    return found


def _newest(
    listings: dict[int, dict[int, str]], storage_options: dict[str, Any] | None, verify: bool, threads: int,
    preload: bool,
) -> Found | None:  # fmt: skip
    """This process's newest usable candidate, the fastest level first (see ``latest``)."""
    candidates = [(step, index, path) for index, steps in listings.items() for step, path in steps.items()]
    candidates.sort(key=lambda c: (-c[0], c[1]))
    for step, index, path in candidates:
        problem, identity, held = _problem(path, storage_options, verify, threads=threads, preload=preload)
        if problem is None:
            return Found(path, step, index, verified=identity, preread=held)
        warnings.warn(
            f"lazyckpt.latest: skipping {path} (level {index}, step {step}): {problem}",
            IncompleteCheckpointWarning,
            stacklevel=user_stacklevel(),
        )
    return None


def latest_agreed(
    levels: Iterable[Level | str | os.PathLike[str]],
    exchange: _collective.StoreExchange,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    listings: dict[int, dict[int, str]] | None = None,
    scopes: Sequence[Scope] | None = None,
    replication_group: Any = None,
) -> Found | None:
    """``latest()`` agreed among ``exchange``'s ranks (every one of them calls it); ``listings``:
    this rank's levels as already listed. Levels with ``replicas``: first, each node's folder gets
    back the replicated steps newer than its own from its partners (``_restore.restore``), over
    ``replication_group`` (a distributed checkpointer's) or a gloo group made for it; ``scopes``:
    who shares each level's folder, probed here when not given."""
    rank, world = exchange.rank, exchange.world
    if _replicated(levels) and _restore_replicas(levels, exchange, scopes, replication_group):
        listings = None  # a node's folder gained the steps restored from its partners' replicas

    def usable(index: int, step: int, path: str) -> bool:
        problem, _, _ = _problem(path, storage_options, verify, rank=rank, world=world)
        if problem is not None:
            warnings.warn(
                f"lazyckpt.latest: skipping {path} (level {index}, step {step}) on rank {rank}: {problem}",
                IncompleteCheckpointWarning,
                stacklevel=user_stacklevel(),
            )
        return problem is None

    mine = _listings(levels, storage_options) if listings is None else listings
    agreed = _collective.agree(mine, usable, exchange)
    return None if agreed is None else Found(agreed[2], agreed[0], agreed[1])


def _replicated(levels: Iterable[Level | str | os.PathLike[str]]) -> bool:
    return any(as_level(entry).replicas for entry in levels)


def _restore_replicas(
    entries: Iterable[Level | str | os.PathLike[str]],
    exchange: _collective.StoreExchange,
    scopes: Sequence[Scope] | None,
    group: Any,
) -> bool:
    """Collective: ``_restore.restore`` with the levels' scopes (probed now when not given) and a
    gloo group (``group``, else one made for it and destroyed after: the default group's ranks)."""
    levels = [as_level(entry) for entry in entries]
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
        return restore(levels, scopes, exchange.all_gather, exchange.rank, the_group)
    finally:
        if made:
            import torch.distributed as dist

            dist.destroy_process_group(made[0])


def _listings(
    levels: Iterable[Level | str | os.PathLike[str]], storage_options: dict[str, Any] | None
) -> dict[int, dict[int, str]]:
    """{level index: {step: path}} of every level that can be listed (the others warn)."""
    out: dict[int, dict[int, str]] = {}
    for index, entry in enumerate(levels):
        level = as_level(entry)
        try:
            out[index] = list_steps(level, storage_options)
        except Exception as exc:  # an unreachable level must not hide the others
            warnings.warn(
                f"lazyckpt.latest: cannot list level {index} ({level.path}): {exc}",
                IncompleteCheckpointWarning,
                stacklevel=user_stacklevel(),
            )
    return out


def _problem(
    path: str,
    storage_options: dict[str, Any] | None,
    verify: bool,
    rank: int | None = None,
    world: int = 1,
    threads: int = READ_THREADS,
    preload: bool = False,
) -> tuple[str | None, FileIdentity | None, Preread | None]:
    """(why ``path`` is not a complete checkpoint, or None when it is; the identity of the file
    whose every CRC was checked, when one was; with ``preload``, its storages read by that check).
    With ``rank``: whether that rank (of ``world``) can load its own items from a DCP folder saved
    by a job of that layout (``recovery.dcp.rank_problems``); other paths, and such folders without
    a list for that rank, are checked whole."""
    if rank is not None and step_of(path.rstrip("/").rsplit("/", 1)[-1], folder=True) is not None:
        try:
            problems = rank_problems(path, rank, world, storage_options, verify)
        except Exception as exc:  # unreadable: not a checkpoint to resume from
            return f"cannot be read: {exc}", None, None
        if problems is not None:
            return "; ".join(problems) or None, None, None
    return _whole_problem(path, storage_options, verify, threads, preload)


def _whole_problem(
    path: str, storage_options: dict[str, Any] | None, verify: bool, threads: int, preload: bool
) -> tuple[str | None, FileIdentity | None, Preread | None]:
    """(why ``path`` is not a complete checkpoint, or None when it is; the verified file's identity;
    its storages, read into memory by the check, with ``preload`` and a local torch.save file)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    held = None
    try:
        if step_of(name, folder=True) is not None:
            return "; ".join(folder_problems(path, storage_options, verify)) or None, None, None
        if not verify:
            return None, None, None
        if preload and not _remote.is_url(path):
            ahead = _read_ahead(path)
            if ahead is not None:
                return None, ahead.identity, ahead
            report, held = preread(path, threads)
        else:
            report = verify_file(path, storage_options, threads=threads)
    except FileNotFoundError:  # removed by retention since the listing
        return "gone since it was listed", None, None
    except Exception as exc:  # unreadable: not a checkpoint to resume from
        return f"cannot be read: {exc}", None, None
    return (None, report.identity, held) if report.ok else ("; ".join(report.problems), None, None)


def _read_ahead(path: str) -> Preread | None:
    """The storages of the very file at ``path`` (same identity) that a check in this process has
    read and verified already and nobody took (the one writer's restore reads each node's newest
    file ahead so): the same bytes, verified, so not read again."""
    held = Preread.registered(path)
    if held is None or held.nbytes == 0:
        return None
    try:
        return held if FileIdentity.at(path) == held.identity else None
    except OSError:
        return None
