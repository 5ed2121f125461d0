"""Which ranks share each level's folder, found by probe files at construction (never assumed from
paths: ``/dev/shm/run1`` is a folder per node). Checks use exact names (a listing may be cached); a
URL level is shared; views that are not a partition are refused on every rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lazyckpt.levels import Level

PROBE_PREFIX = ".lazyckpt-probe-"


@dataclass(frozen=True)
class Scope:
    """Who shares one level's folders: ``groups`` (a sorted partition of the ranks) and this rank's
    ``group``, whose ``leader`` (lowest rank) owns the folder (metadata, publishing, retention)."""

    groups: tuple[tuple[int, ...], ...]
    group: tuple[int, ...]

    @property
    def node_local(self) -> bool:
        return len(self.groups) > 1

    @property
    def leader(self) -> int:
        return self.group[0]


def probe(
    levels: Sequence[Level], token: str, rank: int, world: int, all_gather: Callable[[Any], list[Any]]
) -> list[Scope]:
    """Collective (``all_gather``): every level's scope. A rank that cannot probe makes every rank
    raise ``ValueError``; so do inconsistent views."""
    everyone = tuple(range(world))
    mine: list[str] = []
    error = ""
    try:
        for level in levels:
            if level.is_url:
                continue
            os.makedirs(level.path, exist_ok=True)
            path = os.path.join(level.path, f"{PROBE_PREFIX}{token[:16]}-{rank}")
            with open(path, "w"):
                pass
            mine.append(path)
    except OSError as exc:
        error = f"rank {rank}: {exc}"
    errors = [e for e in all_gather(error) if e]
    try:
        views: list[tuple[int, ...] | None] = []
        if not errors:
            for level in levels:
                if level.is_url:
                    views.append(None)
                    continue
                names = (os.path.join(level.path, f"{PROBE_PREFIX}{token[:16]}-{r}") for r in range(world))
                views.append(tuple(r for r, name in enumerate(names) if os.path.exists(name)))
        gathered: list[list[tuple[int, ...] | None]] = all_gather(views)  # every rank has looked once this returns
    finally:
        for path in mine:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if errors:
        raise ValueError("lazyckpt: cannot use the levels' folders: " + "; ".join(errors))
    scopes = []
    for i, level in enumerate(levels):
        if level.is_url:
            scopes.append(Scope((everyone,), everyone))
            continue
        seen = [
            None if v is None else tuple(v) for v in (views_of_rank[i] for views_of_rank in gathered)
        ]  # JSON: lists
        scopes.append(_scope(level, i, seen, rank))
    return scopes


def _scope(level: Level, index: int, seen: list[tuple[int, ...] | None], rank: int) -> Scope:
    groups = sorted({view for view in seen if view is not None})
    consistent = all(
        view is not None and r in view and all(seen[s] == view for s in view) for r, view in enumerate(seen)
    )
    if not consistent:
        raise ValueError(
            f"lazyckpt: level {index} ({level.path}): the ranks see each other's files inconsistently "
            f"({dict(enumerate(seen))}): give every rank either one shared folder or its node's own folder"
        )
    view = seen[rank]
    assert view is not None
    return Scope(tuple(groups), view)


def dedup_groups(scopes: Sequence[Scope], world: int) -> list[list[int]]:
    """The groups within which replicated items are deduplicated: the ranks sharing every node-local
    level's folder (one group of all ranks when no level is node-local)."""
    node = [s for s in scopes if s.node_local]
    by_key: dict[tuple[int, ...], list[int]] = {}
    for r in range(world):
        key = tuple(next(i for i, g in enumerate(s.groups) if r in g) for s in node)
        by_key.setdefault(key, []).append(r)
    return sorted(by_key.values())
