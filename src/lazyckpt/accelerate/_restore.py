"""``load_latest(accelerator)``: the newest complete folder of any level (``lazyckpt.latest``), loaded by
``accelerator.load_state``. Collective with several processes: every process loads the same step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import TYPE_CHECKING, Any

from lazyckpt import LazyCheckpointer
from lazyckpt.accelerate import _compat
from lazyckpt.accelerate._patch import installed
from lazyckpt.checkpointer import producer_of
from lazyckpt.commit import remote_folder as _remote_folder
from lazyckpt.core.remote import is_url
from lazyckpt.resume import Found, latest

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lazyckpt import Level


def load_latest(
    accelerator: Accelerator,
    levels: list[Level | str | os.PathLike[str]] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    **load_kwargs: Any,
) -> Found | None:
    """Restore the newest complete checkpoint folder of ``levels`` into ``accelerator``.

    Call it on every process: all load the same step (with ``replicas``, each from its own node's copy).
    ``levels``: the levels to look in, fastest first (default: those given to ``install(accelerator,
    levels=...)``). ``storage_options``: for URL levels (default: the installed checkpointer's).
    ``verify``: check CRCs, skipping corrupt copies. ``load_kwargs`` go to ``accelerator.load_state``.
    Returns the :class:`lazyckpt.Found` loaded (``path``, ``step``, ``level``: its index in ``levels``),
    or None when no level holds a complete folder (nothing loaded). With an installed handle, its pending
    saves are waited for first (errors stay for the next ``save_state`` / ``wait()``) and ``handle.step``
    is set to ``found.step``. Raises ``ValueError`` when no levels are given or installed.
    """
    handle = installed(accelerator)
    if levels is None:
        if handle is None or not handle.levels:
            raise ValueError(
                "lazyckpt.accelerate.load_latest: no levels given and none installed; pass levels=[...] "
                "or call install(accelerator, levels=[...]) first"
            )
        levels = list(handle.levels)
    if storage_options is None and handle is not None:
        storage_options = handle.checkpointer.options.storage_options
    if handle is not None:
        handle.settle()
    found: Found | None = None
    if accelerator.num_processes > 1 and any(getattr(entry, "replicas", 0) for entry in levels):
        # collective: the newest step is copied to every node lacking it; each process reads its node's copy
        found = latest(levels, storage_options, verify, preload=False, collective=True)
    elif accelerator.num_processes > 1:
        if accelerator.is_main_process:
            found = latest(levels, storage_options, verify, collective=False)
        found = _compat.broadcast(found)
    else:
        found = latest(levels, storage_options, verify, collective=False)
    if found is None:
        return None
    if handle is not None or not is_url(found.path):
        accelerator.load_state(found.path, **load_kwargs)
    else:
        with _downloaded(found.path, storage_options) as local:
            accelerator.load_state(local, **load_kwargs)
    if handle is not None:
        handle.step = found.step
    return found


@contextlib.contextmanager
def _downloaded(url: str, storage_options: dict[str, Any] | None) -> Any:
    """A folder at ``url`` downloaded (the files its manifest names) for an accelerator without lazyckpt."""
    with LazyCheckpointer(storage_options=storage_options) as ckpt:
        dest = _remote_folder.local_folder(producer_of(ckpt), url)
        try:
            _remote_folder.download(producer_of(ckpt), url, dest)
            yield dest
        finally:
            shutil.rmtree(os.path.dirname(dest), ignore_errors=True)
