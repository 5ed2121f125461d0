"""``load_latest(accelerator)``: the newest complete folder of any level, loaded by stock ``load_state``.

``lazyckpt.latest(levels)`` picks it (every level listed; a folder counts once no pending marker is
left in it, Accelerate's expected files are there and every CRC checks out; torn or corrupt copies
are skipped with a warning); with several processes the main process picks and tells the others
(one broadcast), so every process loads the same step. With a level with ``replicas`` (several
nodes, node-local folders) ``latest()`` is collective instead: the newest step some node holds is
copied into every node's folder that lacks it, and each process loads its own node's copy. Then
``accelerator.load_state(found.path)``: the installed one (a URL: its files downloaded first,
``_url.downloaded``), or stock's for an accelerator without lazyckpt (a URL through a short-lived
checkpointer's remote tier). The handle's step counter is set to ``found.step``, so the next saves
continue the numbering.
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
from lazyckpt.levels import Found, latest
from lazyckpt.storage.remote import is_url

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

    ``levels``: the levels to look in, fastest first (default: the ones given to
    ``install(accelerator, levels=...)``). Returns the :class:`lazyckpt.Found` that was loaded
    (``path``, ``step``, ``level``: its index in ``levels``), or None when no level holds a
    complete folder (nothing is loaded; start from scratch). Call it on every process (with several,
    the main process picks the folder and the others load the same one; with a level with
    ``replicas``, every process picks, collectively, from its own node's folders, each given the
    newest step some node holds first, and they agree on the step). ``load_kwargs`` go to
    ``accelerator.load_state``. With an installed handle, its pending saves are waited for first
    (their errors stay to be reported by the next ``save_state`` / ``wait()``), and its step counter
    is set to ``found.step``: the next bare ``save_state()`` after one more optimizer step saves
    ``found.step + 1``.
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
        # collective: the newest step any node holds is first copied into every node's folder lacking
        # it; each process then finds it in its own node's folder (the same step everywhere, checked)
        found = latest(levels, storage_options, verify, preload=False)
    elif accelerator.num_processes > 1:
        if accelerator.is_main_process:
            found = latest(levels, storage_options, verify)
        found = _compat.broadcast(found)
    else:
        found = latest(levels, storage_options, verify)
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
