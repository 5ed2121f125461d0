"""Staging folders and the one rename that publishes a ``checkpoint-N`` folder whole.

A staging name is a lazyckpt temporary name (``storage/fs.py``): unique per save, matched by no stock glob,
and removable by ``fs.cleanup_temporaries`` once its process is dead.
"""

from __future__ import annotations

from lazyckpt.distributed._commit import swap_in
from lazyckpt.storage import fs as _fs


def staging_name(final: str) -> str:
    """A fresh staging folder name for ``final``, unique to this save."""
    return _fs.temporary_path(final)


def publish(staging: str, final: str, *, fsync: bool) -> None:
    """Make the complete ``staging`` folder visible as ``final`` in one rename (an existing ``final`` swapped
    out atomically); entries fsynced before, the parent after. ``fsync=False``: the renames only."""
    if fsync:
        _fs.fsync_dir(staging)
    swap_in(staging, final, _fs.temporary_path(final), fsync)
