"""Staging folders and the one rename that publishes a ``checkpoint-N`` folder whole.

A staging folder's name is a lazyckpt temporary name of its final folder
(``<run_dir>/.checkpoint-N.lazyckpt-<host>-<pid>-<n>.tmp``, ``storage/fs.temporary_path``): each save has
its own, so two saves of one name never share one, and a killed run's leftover (its pid dead on this host)
is told apart from a live save and removed by ``storage/fs.cleanup_temporaries``. No stock glob
(``checkpoint-*``) matches it.
"""

from __future__ import annotations

from lazyckpt.distributed._commit import swap_in
from lazyckpt.storage import fs as _fs


def staging_name(final: str) -> str:
    """A fresh staging folder name for ``final`` (unique to this save; the main process makes it and, in a
    distributed run, gives it to the others)."""
    return _fs.temporary_path(final)


def publish(staging: str, final: str, *, fsync: bool) -> None:
    """Make the complete ``staging`` folder visible as ``final`` in one rename: its entries made durable
    first, an existing ``final`` (the same step saved again) swapped out atomically and deleted, the parent
    made durable after. ``fsync=False``: the renames only."""
    if fsync:
        _fs.fsync_dir(staging)
    swap_in(staging, final, _fs.temporary_path(final), fsync)
