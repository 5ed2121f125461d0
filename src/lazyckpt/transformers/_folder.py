"""Staging folders and the one rename that publishes a ``checkpoint-N`` folder whole."""

from __future__ import annotations

import os
import shutil

from lazyckpt.storage import fs as _fs

STAGING_PREFIX = ".lazyckpt-"  # staging folders: <run_dir>/.lazyckpt-checkpoint-N.tmp (no stock glob matches)
STAGING_SUFFIX = ".tmp"


def staging_name(final: str) -> str:
    """The staging folder of ``final`` (deterministic: every process of a job computes the same)."""
    head, name = os.path.split(final)
    return os.path.join(head, f"{STAGING_PREFIX}{name}{STAGING_SUFFIX}")


def replace_folder(staging: str, final: str) -> None:
    """Rename ``staging`` to ``final`` and make it durable; an existing ``final`` (a step saved again,
    e.g. after a resume) is renamed away first and deleted after."""
    old = None
    if os.path.lexists(final):
        old = f"{staging}.old"
        shutil.rmtree(old, ignore_errors=True)
        _fs.rename(final, old)
    _fs.rename(staging, final)
    _fs.fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
