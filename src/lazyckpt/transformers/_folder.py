"""One ``checkpoint-N`` folder save (``CheckpointSave``): its staging folder, its files, and the one rename that
publishes it whole.

A staging name is a lazyckpt temporary name (``storage/fs.py``): unique per save, matched by no stock glob,
and removable by ``fs.cleanup_temporaries`` once its process is dead.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from lazyckpt.checkpointer import producer_of
from lazyckpt.core import plan as _plan
from lazyckpt.core.handle import Completion, SaveStats
from lazyckpt.core.job import sync_parent
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry
from lazyckpt.transformers import _compat

if TYPE_CHECKING:
    from lazyckpt import SaveHandle

logger = logging.getLogger("lazyckpt.transformers")


def staging_name(final: str) -> str:
    """A fresh staging folder name for ``final``, unique to this save."""
    return _fs.temporary_path(final)


class CheckpointSave:
    """One ``_save_checkpoint`` call of this process: the router of its gated files, then its commit.

    Only a ``writer`` (``args.should_save``) has lazy files, commits and rotates. Every process uses the
    main process's ``staging`` name. ``seq`` orders saves: a later save of the same ``final`` wins.
    ``after_commit`` runs on the commit thread after the rename.
    """

    def __init__(
        self, checkpointers: Any, final: str, staging: str, *, step: int, writer: bool, distributed: bool
    ) -> None:
        self.checkpoints = checkpointers
        self.checkpointer = checkpointers.checkpointer
        self.final = final
        self.run_dir = os.path.dirname(final)
        self.step = step
        self.distributed = distributed
        self.staging = os.path.abspath(staging)
        self.writer = writer
        self.seq = next(checkpointers.seq)
        self.handles: list[SaveHandle] = []
        # the commit's own handle (the level runner's source): done once published, failed or superseded
        self.completion = Completion(final)
        self.completion.bind(confirm=lambda timeout: self.checkpointer.wait_staged(timeout))
        self.routed = 0  # calls the gate routed here (lazy saves, and tiny files written by stock's writer)
        self.synced: list[Future] = []  # fsyncs of the files stock wrote into the staging folder
        self.after_commit: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self.superseded = False
        self.publishing = self.published = False
        self.done = threading.Event()
        self.t_call = time.perf_counter()
        self.t_committed: float | None = None
        self._aborted = False
        self._remaining = 0
        self._lock = reentry.Lock()

    # -- on the training thread ----------------------------------------------------------------------
    def prepare(self) -> None:
        """A writer: the staging folder, made before any process writes into it."""
        if self.writer:
            os.makedirs(self.staging)

    def save_torch(self, obj: Any, path: str) -> None:
        """``torch.save(obj, path)`` for a file of the staging folder, lazily."""
        self._save(obj, path, format="torch")

    def save_safetensors(self, tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None) -> None:
        """``safetensors.torch.save_file(tensors, path, metadata)`` for the staging folder, lazily."""
        self._save(tensors, path, format="safetensors", metadata=metadata)

    def _save(self, obj: Any, path: str, **options: Any) -> None:
        assert self.writer, "a routed save on a process that does not write"
        self.routed += 1
        if _plan.small_in_save(self.checkpointer.options, obj, self.staging):
            # a tiny file: stock's writer writes it; fsynced with stock's files (sync_stock_files)
            _compat.write_stock(obj, path, **options)
            return
        token = sync_parent.set(False)  # the staging folder is fsynced once, before its rename
        try:
            self.handles.append(self.checkpointer.save(obj, path, **options))
        finally:
            sync_parent.reset(token)

    def sync_stock_files(self) -> None:
        """Fsync each file stock wrote into the staging folder, on the writer pool (lazy files fsync
        themselves; ``fsync=False`` skips all)."""
        if not self.checkpointer.fsync:
            return
        lazy = {h.path for h in self.handles}
        engine = producer_of(self.checkpointer).engine
        for entry in os.scandir(self.staging):
            if entry.path in lazy or _fs.is_temporary(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            self.synced.append(engine.run(functools.partial(_fs.fsync_file, entry.path)))

    def finish(self, committer: Callable[[Callable[[], None]], None]) -> None:
        """Commit once every lazy file is done (on ``committer``'s thread)."""
        if not self.writer:  # (the main process owns the staging folder, even after a failure here)
            self.done.set()
            return
        handles = self.handles
        self._committer = committer
        with self._lock:
            self._remaining = len(handles) + 1
        for h in handles:
            h.add_done_callback(self._one_done)
        self._one_done(None)

    def abort(self, committer: Callable[[Callable[[], None]], None]) -> None:
        """Stock's statements raised: nothing is committed; the staging folder is removed once the lazy
        files already started are over."""
        self._aborted = True
        self.finish(committer)

    # -- on the commit thread ------------------------------------------------------------------------
    def _one_done(self, _h: SaveHandle | None) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._committer(self.commit)

    def commit(self) -> None:
        """On the commit thread, every lazy file done: publish the folder (unless a later save of the name
        did), then run ``after_commit``."""
        try:
            failed = next((h for h in self.handles if h.exception() is not None), None)
            if self._aborted:
                self.error = RuntimeError(f"the call that saved {self.final} raised")
                return
            if failed is not None:
                self.error = failed.exception()
                logger.error("lazyckpt: %s failed; %s was not written: %r", failed.path, self.final, self.error)
                return
            for fut in self.synced:
                fut.result()
            self.publishing = True  # (then superseded is read: see supersede())
            if self.superseded or self.checkpoints.published.get(self.final, -1) > self.seq:
                self.superseded = True  # a later save of this name is already there: the last write wins
                return
            _fs.publish_folder(self.staging, self.final, fsync=self.checkpointer.fsync)
            self.checkpoints.published[self.final] = self.seq
            self.t_committed = time.perf_counter()
            for step in self.after_commit:
                step()
        except BaseException as exc:  # noqa: BLE001 - reported once by the checkpointer (wait, next save)
            self.error = exc
            self.checkpointer.add_error(exc)
        finally:
            self.published = True
            if os.path.lexists(self.staging):  # failed, aborted or superseded: never published
                shutil.rmtree(self.staging, ignore_errors=True)
            self._resolve()
            self.done.set()

    def _resolve(self) -> None:
        """The commit's handle: its error (raised to the caller another way: claimed here), or its stats
        (skipped when nothing was published under ``final`` by this save)."""
        if self.error is not None:
            self.completion.caller_saw_error()
            self.completion.finish(None, self.error)
            return
        elapsed = time.perf_counter() - self.t_call
        stats = SaveStats(self.final, 0, 0, 0.0, elapsed, elapsed, 0.0, 0.0, 0.0, skipped=self.t_committed is None)
        self.completion.finish(stats, None)

    def supersede(self) -> None:
        """A re-entered save (``threads/reentry.py``) writes this name now: drop this save, or wait out its
        rename (bounded, no lock: ``commit`` sets ``publishing`` before reading ``superseded``, this the reverse)."""
        self.superseded = True
        deadline = time.monotonic() + 30.0
        while self.publishing and not self.published and time.monotonic() < deadline:
            time.sleep(0.001)
