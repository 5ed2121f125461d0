"""``total_limit``: the old folders stock ``save_state`` would delete, drained first, then renamed out of
``checkpoints/`` (so stock deletes nothing) and deleted on the checkpointer's remover thread.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

from lazyckpt import cleanup_temporaries
from lazyckpt.accelerate import _compat

if TYPE_CHECKING:
    from lazyckpt import LazyCheckpointer
    from lazyckpt.accelerate._folder_save import SaveStateCalls

logger = logging.getLogger("lazyckpt.accelerate")


class OldFolders:
    """The deletions of one handle's old folders. Used from the thread that calls ``save_state``."""

    def __init__(self, checkpointer: LazyCheckpointer) -> None:
        self.checkpointer = checkpointer
        self._deletions: list[Future[Any]] = []  # the checkpointer's wait() waits for them too
        self._trash_cleaned: set[str] = set()

    def make_room(self, accelerator: Any, saves: SaveStateCalls) -> None:
        """Before stock ``save_state``: drain the saves into the folders it is about to delete, then delete them."""
        doomed, exact = doomed_folders(accelerator)
        if not doomed:
            return
        real = [_compat.real_path(d) for d in doomed]
        saves.wait_into(lambda folder: any(folder == d or folder.startswith(d + os.sep) for d in real))
        if exact:
            self._delete(os.fspath(accelerator.project_dir), doomed)

    def wait(self) -> None:
        """Block until every deletion started so far has ended (its error is the checkpointer's to report)."""
        futures_wait(self._deletions)

    def _delete(self, trash: str, doomed: list[str]) -> None:
        # Anything unusual (a symlinked folder, a failed rename) is left to stock.
        mine = [f for f in doomed if os.path.isdir(f) and not os.path.islink(f)]
        if not mine:
            return
        logger.warning(f"Deleting {len(mine)} checkpoints to make room for new checkpoint.")
        if trash not in self._trash_cleaned:  # folders a killed process renamed there and never deleted
            self._trash_cleaned.add(trash)
            cleanup_temporaries(trash)
        for folder in mine:
            try:
                self._deletions = [f for f in self._deletions if not f.done()]
                self._deletions.append(self.checkpointer.remove(folder, trash_dir=trash))
            except OSError as exc:
                logger.debug("lazyckpt: leaving the deletion of %s to accelerate: %s", folder, exc)


def doomed_folders(accelerator: Any) -> tuple[list[str], bool]:
    """The folders stock save_state is about to rmtree (stock's computation), and whether that list is
    exact (False: stock's sort will fail on a stray name)."""
    pc = accelerator.project_configuration
    if not (pc.automatic_checkpoint_naming and pc.total_limit is not None and accelerator.is_main_process):
        return [], True
    base = os.path.join(accelerator.project_dir, "checkpoints")
    try:
        folders = [os.path.join(base, f) for f in os.listdir(base)]
    except FileNotFoundError:
        return [], True
    if len(folders) + 1 <= pc.total_limit:
        return [], True
    try:
        folders.sort(key=_compat.folder_number)
    except (IndexError, ValueError):
        return folders, False  # stock will fail on its own; drain conservatively
    return folders[: len(folders) + 1 - pc.total_limit], True
