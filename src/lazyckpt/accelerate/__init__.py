"""Lazy ``accelerator.save_state`` for Hugging Face Accelerate, with the stock file layout.

``install(accelerator)`` makes ``save_state`` return promptly (files written in the background, each folder
marked incomplete until durable) and ``load_state`` wait for pending saves and refuse incomplete folders; no
collective call is added to either. See docs/accelerate.md. A save flows ``_patch`` -> ``_handle`` ->
``_folder_save`` (+ ``_retention``, ``_sharded``, ``_url``, ``_load``; levels: ``_levels``, ``_nodes``, ``_restore``);
only ``_compat`` knows Accelerate's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lazyckpt import CheckpointerOptions, LazyCheckpointer, Level
from lazyckpt.accelerate._handle import AccelerateHandle
from lazyckpt.accelerate._patch import installed
from lazyckpt.accelerate._restore import load_latest
from lazyckpt.commit.folder import is_complete
from lazyckpt.commit.folder import pending_markers as pending_markers  # re-exported from the core
from lazyckpt.errors import IncompleteCheckpointError, IncompleteCheckpointWarning

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "install",
    "load_latest",
    "AccelerateHandle",
    "IncompleteCheckpointError",
    "IncompleteCheckpointWarning",
    "is_complete",
]


def install(
    accelerator: Accelerator,
    checkpointer: LazyCheckpointer | None = None,
    *,
    levels: Sequence[Level] | None = None,
    options: CheckpointerOptions | None = None,
    load_timeout: float = 600.0,
    **core_options: Any,
) -> AccelerateHandle:
    """Make ``accelerator.save_state`` lazy (same files as stock) and ``load_state`` wait for pending saves.

    ``checkpointer``: an existing :class:`lazyckpt.LazyCheckpointer` to use (not closed by ``uninstall()``);
    otherwise one is created from ``options`` (a :class:`lazyckpt.CheckpointerOptions`) and/or ``core_options``
    (the same fields as keywords, overriding ``options``) and closed by ``uninstall()``.
    ``levels``: ``[Level(path, every, keep), ...]``, fastest first: a bare ``accelerator.save_state()`` then
    saves the stock folder to ``<level>/step-<8 digits>`` of every level due at ``handle.step``, and
    :func:`load_latest` restores the newest complete one. Not allowed with ``ProjectConfiguration``'s
    automatic checkpoint naming. ``save_state(output_dir)`` still saves to that folder.
    ``load_timeout``: seconds ``load_state`` waits for other processes' pending saves into the folder it reads
    before treating it as incomplete (with levels, also the main process's wait for the other processes' parts).
    Returns the :class:`AccelerateHandle`. Raises ``TypeError`` for conflicting arguments (``checkpointer``
    with options, levels given to the checkpointer) and ``RuntimeError`` if already installed.
    """
    if checkpointer is not None and (core_options or options is not None):
        raise TypeError("pass either checkpointer= or core options, not both")
    given = core_options.get("levels", options.levels if options is not None else None)
    if given is not None or getattr(checkpointer, "levels", None):  # (a checkpointer double may have none)
        raise TypeError(
            "lazyckpt.accelerate: pass the levels to install(accelerator, levels=[...]), not to the checkpointer "
            "(it would save single files by level; install saves save_state folders by level)"
        )
    if installed(accelerator) is not None:
        raise RuntimeError("lazyckpt.accelerate is already installed on this Accelerator; call uninstall() first")
    owns = checkpointer is None
    if checkpointer is None:
        checkpointer = LazyCheckpointer(options, **core_options)
    try:
        return AccelerateHandle(accelerator, checkpointer, owns, load_timeout=load_timeout, levels=levels)
    except BaseException:
        if owns:
            checkpointer.close()
        raise
