"""Which folder ``load_state`` may read: pending saves waited for, incomplete folders refused.

Waits for this process's saves (their calls) and other processes' (their markers, bounded by
``load_timeout``; no collective call). Called on the thread that calls ``load_state``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from lazyckpt.accelerate import _compat
from lazyckpt.commit.folder import is_complete, live_markers, pending_markers
from lazyckpt.errors import IncompleteCheckpointError, IncompleteCheckpointWarning

if TYPE_CHECKING:
    from lazyckpt.accelerate._folder_save import SaveStateCalls

logger = logging.getLogger("lazyckpt.accelerate")


def folder_to_load(accelerator: Any, saves: SaveStateCalls, input_dir: Any, load_timeout: float) -> Any:
    """What stock ``load_state`` should read for ``load_state(input_dir)``: ``input_dir`` once complete,
    the newest complete folder with automatic naming (warning with ``IncompleteCheckpointWarning`` about
    newer ones skipped), or ``input_dir`` unchanged. Raises ``IncompleteCheckpointError``, chained to this
    process's failure when there was one."""
    if input_dir is not None:
        target = _compat.real_path(input_dir)
        saves.wait_into(lambda folder: folder == target)
        wait_other_processes(accelerator, [target], load_timeout)
        markers = pending_markers(target)
        if os.path.isdir(target) and markers:
            failed = saves.error_for(target)
            raise IncompleteCheckpointError(
                f"lazyckpt: checkpoint folder {input_dir!r} is incomplete: {_why_incomplete(failed, markers)}. "
                "Load an earlier checkpoint folder instead."
            ) from failed
        return input_dir
    if accelerator.project_configuration.automatic_checkpoint_naming:
        return _newest_complete(accelerator, saves, load_timeout)
    return input_dir


def _newest_complete(accelerator: Any, saves: SaveStateCalls, load_timeout: float) -> str:
    base = _compat.real_path(os.path.join(accelerator.project_dir, "checkpoints"))
    saves.wait_into(lambda folder: os.path.dirname(folder) == base)
    folders = [os.path.join(base, f) for f in os.listdir(base)]
    wait_other_processes(accelerator, folders, load_timeout)
    folders = [os.path.join(base, f) for f in os.listdir(base)]
    folders.sort(key=_compat.folder_number)
    complete = [f for f in folders if is_complete(f)]
    if not complete:
        failed = next((e for e in map(saves.error_for, reversed(folders)) if e is not None), None)
        why = "every save there was interrupted before it became durable"
        if failed is not None:
            why = f"every save there failed or was interrupted; the newest failure here: {_describe(failed)}"
        raise IncompleteCheckpointError(
            f"lazyckpt: no complete checkpoint folder in {base!r}: {why} ({[os.path.basename(f) for f in folders]})."
        ) from failed
    chosen = complete[-1]
    if folders and chosen != folders[-1]:
        skipped_folders = folders[folders.index(chosen) + 1 :]
        skipped = [os.path.basename(f) for f in skipped_folders]
        errors = [(f, saves.error_for(f)) for f in skipped_folders]
        causes = [f"{os.path.basename(f)}: {_describe(e)}" for f, e in errors if e is not None]
        why = "their save was interrupted before it became durable"
        if causes:
            why = "their save failed in this process: " + "; ".join(causes)
        msg = (
            f"lazyckpt: newest checkpoint folder(s) {skipped} in {base!r} are incomplete ({why}); "
            f"loading {os.path.basename(chosen)!r} instead."
        )
        logger.warning(msg)
        warnings.warn(msg, IncompleteCheckpointWarning, stacklevel=5)  # the caller of accelerator.load_state
    return chosen


def wait_other_processes(accelerator: Any, folders: list[str], load_timeout: float) -> None:
    """Wait until no other live process has a pending save into ``folders`` (bounded by ``load_timeout``;
    no collective call: ``load_state`` may run on some processes only)."""
    if accelerator.num_processes <= 1:
        return
    deadline = time.monotonic() + load_timeout
    delay = 0.005
    while True:
        busy = [f for f in folders if live_markers(f)]
        if not busy or time.monotonic() >= deadline:
            if busy:
                logger.warning(
                    "lazyckpt: gave up after %.0f s waiting for other processes' saves into %s", load_timeout, busy
                )
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _why_incomplete(failed: BaseException | None, markers: list[str]) -> str:
    """Why a folder is incomplete: this process's save error, else what a leftover marker means."""
    if failed is not None:
        return f"its save_state in this process failed, so no file of it was completed there ({_describe(failed)})"
    return (
        "a save into it never became durable (the process that saved it was killed, or its save failed "
        f"in another process; markers: {markers})"
    )
