"""``latest(levels)``: the newest step complete at some level, verified; the fastest level holding it.

Works on names and files only (``_level.list_steps``, ``lazyckpt.verify`` for files,
``recovery.check.folder_problems`` for folder checkpoints), not on who wrote them: a restarted
process, another node, or a distributed saver's folders are read the same way.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lazyckpt.recovery._read import READ_THREADS, FileIdentity
from lazyckpt.recovery.check import folder_problems
from lazyckpt.recovery.verify import verify as verify_file

from ..errors import IncompleteCheckpointWarning
from ._level import Level, as_level, list_steps, step_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """What ``latest()`` found: the file or folder (or URL) ``path``, its ``step``, and ``level``,
    the index of its level in the list given to ``latest()``.

    ``verified``: the identity of the local file whose every CRC ``latest()`` checked (None when
    it checked none: a folder, a URL, ``verify=False``, or a ``Found`` made by hand). ``load()``
    skips its own CRC pass only for a file it opens with that same identity."""

    path: str
    step: int
    level: int
    verified: FileIdentity | None = field(default=None, repr=False, compare=False, kw_only=True)


def latest(
    levels: Iterable[Level | str | os.PathLike[str]],
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    *,
    threads: int = READ_THREADS,
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

    ``threads``: readers of a local file, whose CRCs are computed as it is read (see
    ``recovery/_read.py``); the ``Found`` names the file so checked (``Found.verified``), and
    ``load()`` does not check it again."""
    candidates: list[tuple[int, int, str]] = []
    for index, entry in enumerate(levels):
        level = as_level(entry)
        try:
            steps = list_steps(level, storage_options)
        except Exception as exc:  # an unreachable level must not hide the others
            warnings.warn(
                f"lazyckpt.latest: cannot list level {index} ({level.path}): {exc}",
                IncompleteCheckpointWarning,
                stacklevel=2,
            )
            continue
        candidates.extend((step, index, path) for step, path in steps.items())
    candidates.sort(key=lambda c: (-c[0], c[1]))
    for step, index, path in candidates:
        problem, identity = _problem(path, storage_options, verify, threads)
        if problem is None:
            return Found(path, step, index, verified=identity)
        warnings.warn(
            f"lazyckpt.latest: skipping {path} (level {index}, step {step}): {problem}",
            IncompleteCheckpointWarning,
            stacklevel=2,
        )
    return None


def _problem(
    path: str, storage_options: dict[str, Any] | None, verify: bool, threads: int
) -> tuple[str | None, FileIdentity | None]:
    """(why ``path`` is not a complete checkpoint, or None when it is; the identity of the file
    whose every CRC was checked, when one was)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    try:
        if step_of(name, folder=True) is not None:
            return "; ".join(folder_problems(path, storage_options, verify)) or None, None
        if not verify:
            return None, None
        report = verify_file(path, storage_options, threads=threads)
    except FileNotFoundError:  # removed by retention since the listing
        return "gone since it was listed", None
    except Exception as exc:  # unreadable: not a checkpoint to resume from
        return f"cannot be read: {exc}", None
    return (None, report.identity) if report.ok else ("; ".join(report.problems), None)
