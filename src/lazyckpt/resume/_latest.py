"""``latest(levels)``: the newest complete, verified step; the fastest level holding it.

Works on names and files only, not on who wrote them. Runs on the caller's thread; collective when the
caller says so (the agreement, the restores of replicated steps: ``lazyckpt.cluster``).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from lazyckpt.cluster import (
    Scope,
    StoreExchange,
    agree,
    files_of_one_writer,
    in_job,
    replicated_index,
    restore_files,
    restore_replicas,
)
from lazyckpt.core import remote as _remote
from lazyckpt.core.warn import user_stacklevel
from lazyckpt.errors import IncompleteCheckpointWarning
from lazyckpt.levels import Level, as_level, list_steps, step_of
from lazyckpt.recovery import READ_THREADS, FileIdentity, Found, Preread, preread
from lazyckpt.recovery.check import folder_problems
from lazyckpt.recovery.dcp import is_dcp_folder, rank_problems
from lazyckpt.recovery.verify import verify as verify_file

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
    """The newest step complete at some level that passes verification, at the first (fastest)
    level holding it; ``None`` when there is none.

    A copy failing verification is skipped with an ``IncompleteCheckpointWarning`` (then the same
    step at a slower level, then older steps); so is a level that cannot be listed. A file wins
    over a folder of the same step.

    ``levels``: ``Level`` objects or paths, fastest first. ``storage_options``: passed to fsspec.
    ``verify``: check every CRC; ``False`` trusts file names and checks folders' completeness only.
    ``collective``: whether the call talks to the other ranks; the caller's choice, never inferred from
    what the levels hold. ``None`` (default) means ``True`` in a multi-rank job (torch.distributed
    initialized with more than one rank) and ``False`` otherwise. Collective: call it on every rank;
    all get the same step, the newest every rank can load (each its own fastest usable copy), after
    steps of a level with ``replicas`` are restored to nodes lacking them. Not collective: this
    process's own view, for a caller that asks on one rank (then broadcasts). ``timeout``: seconds
    to wait for other ranks (then ``TimeoutError``);
    ranks that end on different steps raise ``RuntimeError``. ``threads``: readers of a local file.
    ``preload`` (with ``verify``): the check also reads a torch.save file's storages, held by the
    ``Found`` until ``lazyckpt.load(found)`` takes them (one read per resume); pass ``False`` when
    another loader reads ``found.path``."""
    levels = list(levels)
    listings = _listings(levels, storage_options)
    if not (in_job() if collective is None else collective):
        return _newest(listings, storage_options, verify, threads, preload)
    is_dcp = lambda path: is_dcp_folder(path, storage_options)  # noqa: E731
    if not (_replicated(levels) and files_of_one_writer(listings, is_dcp, timeout)):
        exchange = StoreExchange.default(timeout)
        return latest_agreed(levels, exchange, storage_options, verify, listings, threads=threads, preload=preload)
    # one writer's files with replicas: restore the newest step to nodes lacking it, then agree on a step
    entries = [as_level(entry) for entry in levels]
    index = replicated_index(entries)
    assert index is not None
    # storages read ahead by the restore's check: the agreement's checks take them instead of reading again
    checked = restore_files(entries, index, min(timeout, 60.0), fsync=False, threads=threads,
                            preload=preload and verify)  # fmt: skip
    exchange = StoreExchange.default(timeout)
    found = latest_agreed(levels, exchange, storage_options, verify, threads=threads, preload=preload, restore=False)
    del checked  # what the checks did not take is freed
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
    exchange: StoreExchange,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    listings: dict[int, dict[int, str]] | None = None,
    scopes: Sequence[Scope] | None = None,
    replication_group: Any = None,
    *,
    threads: int = READ_THREADS,
    preload: bool = False,
    restore: bool = True,
) -> Found | None:
    """``latest()`` agreed among ``exchange``'s ranks (collective). ``listings``: this rank's levels
    as already listed. With ``restore``, replicated levels are restored first (``cluster.restore_replicas``) over
    ``replication_group`` or a gloo group made for it; ``scopes`` are probed when not given.
    ``threads``, ``preload``: as ``latest()``'s, for the files this rank checks."""
    rank, world = exchange.rank, exchange.world
    entries = [as_level(entry) for entry in levels]
    if restore and _replicated(entries) and restore_replicas(entries, exchange, scopes, replication_group):
        listings = None  # a node's folder gained the steps restored from its partners' replicas

    checked: dict[str, tuple[FileIdentity | None, Preread | None]] = {}

    def usable(index: int, step: int, path: str) -> bool:
        problem, identity, held = _problem(
            path, storage_options, verify, rank=rank, world=world, threads=threads, preload=preload
        )
        if problem is None:
            checked[path] = (identity, held)
        else:
            warnings.warn(
                f"lazyckpt.latest: skipping {path} (level {index}, step {step}) on rank {rank}: {problem}",
                IncompleteCheckpointWarning,
                stacklevel=user_stacklevel(),
            )
        return problem is None

    mine = _listings(levels, storage_options) if listings is None else listings
    agreed = agree(mine, usable, exchange)
    if agreed is None:
        return None
    identity, held = checked.get(agreed[2], (None, None))  # the other candidates' storages are dropped
    return Found(agreed[2], agreed[0], agreed[1], verified=identity, preread=held)


def _replicated(levels: Iterable[Level | str | os.PathLike[str]]) -> bool:
    return any(as_level(entry).replicas for entry in levels)


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
    """(why ``path`` is not a complete checkpoint or None, the verified file's identity, its preread
    storages). With ``rank``: a DCP folder is checked for that rank's own items where it can be."""
    folder = step_of(path.rstrip("/").rsplit("/", 1)[-1], folder=True) is not None
    if rank is not None and folder and is_dcp_folder(path, storage_options):  # others: checked whole
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
    """As ``_problem``, checking ``path`` whole."""
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
    """Storages of this very file (same identity) already read and verified in this process and not
    yet taken, else None."""
    held = Preread.registered(path)
    if held is None or held.nbytes == 0:
        return None
    try:
        return held if FileIdentity.at(path) == held.identity else None
    except OSError:
        return None
