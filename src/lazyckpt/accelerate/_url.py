"""Folders at URLs: ``save_state("s3://...")`` and ``load_state("s3://...")`` (one process).

Saves go to a fresh local folder of the remote tier, uploaded once complete on the handle's uploader thread
(``commit/remote_folder.py``); loads wait for this process's saves to the URL and download the manifest's files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lazyckpt.checkpointer import producer_of
from lazyckpt.commit import remote_folder as _remote_folder
from lazyckpt.core.remote import is_url
from lazyckpt.errors import BackpressureWarning, IncompleteCheckpointError, SaveRefusedError

if TYPE_CHECKING:
    from lazyckpt import LazyCheckpointer
    from lazyckpt.accelerate._folder_save import SaveStateCalls


def save_target(accelerator: Any, output_dir: Any) -> str | None:
    """The URL ``save_state(output_dir)`` writes to, or None for a local folder; raises ``SaveRefusedError``
    for what cannot work."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        if is_url(str(accelerator.project_dir)):  # stock would makedirs a local folder named "s3:"
            raise SaveRefusedError(
                "lazyckpt.accelerate: automatic_checkpoint_naming with a URL project_dir "
                f"({accelerator.project_dir}) is not supported; call save_state(output_dir='s3://...') "
                "with explicit names instead"
            )
        return None
    if not (isinstance(output_dir, str) and is_url(output_dir)):
        return None
    if accelerator.num_processes > 1:
        raise SaveRefusedError(
            f"lazyckpt.accelerate: save_state to a URL ({output_dir}) with {accelerator.num_processes} processes "
            "is not supported yet (one process only); save to a shared local folder and upload it"
        )
    return output_dir.rstrip("/")


def load_source(input_dir: Any) -> str | None:
    """The URL ``load_state(input_dir)`` reads from, or None for a local folder."""
    return input_dir.rstrip("/") if isinstance(input_dir, str) and is_url(input_dir) else None


def admit_upload(saves: SaveStateCalls, url: str, bound: int) -> None:
    """Bound the local disk: with ``bound`` URL folders awaiting upload, wait for the oldest (with a
    ``BackpressureWarning``)."""
    pending = saves.uploads_pending()
    if len(pending) < bound:
        return
    t = time.monotonic()
    for call in pending[: len(pending) - bound + 1]:
        call.wait()
    warnings.warn(
        f"lazyckpt.accelerate: save_state to {url} waited {time.monotonic() - t:.2f} s for uploads: "
        f"{len(pending)} folder(s) were still waiting for upload, bound {bound} "
        "(max_pending_uploads). Save less often or give uploads more bandwidth.",
        BackpressureWarning,
        stacklevel=4,  # the caller of accelerator.save_state
    )


def local_folder(checkpointer: LazyCheckpointer, url: str) -> str:
    """A fresh local folder of the remote tier for the save of ``url``."""
    return _remote_folder.local_folder(producer_of(checkpointer), url)


@contextlib.contextmanager
def downloaded(checkpointer: LazyCheckpointer, saves: SaveStateCalls, url: str) -> Iterator[str]:
    """Wait for this process's saves to ``url`` and download the files its manifest names; yields the local
    folder, removed after the block. Raises ``IncompleteCheckpointError`` without a manifest."""
    mine = saves.to_url(url)
    for call in mine:
        call.wait()
    dest = _remote_folder.local_folder(producer_of(checkpointer), url)
    try:
        try:
            _remote_folder.download(producer_of(checkpointer), url, dest)
        except IncompleteCheckpointError as exc:
            failed = next((c.error for c in reversed(mine) if c.error is not None), None)
            raise exc from failed
        yield dest
    finally:
        shutil.rmtree(os.path.dirname(dest), ignore_errors=True)
