"""One ``save_state`` call of this process: active while stock runs (training thread), files through a
``commit.folder.FolderSave``, ended on the handle's finisher thread, uploaded on its uploader thread. Errors are
the checkpointer's to report, once; a call keeps its own only to explain a later ``load_state`` refusal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.utils.constants import RNG_STATE_NAME, SCALER_NAME
from accelerate.utils.other import clean_state_dict_for_safetensors

from lazyckpt.accelerate import _compat
from lazyckpt.checkpointer import producer_of
from lazyckpt.commit import remote_folder as _remote_folder
from lazyckpt.commit.folder import FolderSave
from lazyckpt.core.handle import Completion
from lazyckpt.threads import reentry

if TYPE_CHECKING:
    from lazyckpt import LazyCheckpointer, SaveHandle
    from lazyckpt.core.report import Report

logger = logging.getLogger("lazyckpt.accelerate")

#: Runs a job on the handle's finisher / uploader thread (inline when none is left).
Submit = Callable[[Callable[[], None]], None]


class SaveStateCall:
    """The lazy part of one ``save_state`` call in this process: core handles, marker, files stock wrote.

    ``owner``: its handle (compared by identity only). ``finisher`` runs the marker's fsync and the
    folder's end, in order; ``uploader`` the upload of a folder saved for ``url``.
    """

    def __init__(
        self,
        owner: object,
        checkpointer: LazyCheckpointer,
        *,
        tag: int,
        finisher: Submit,
        uploader: Submit,
        url: str | None = None,
        publish: Callable[[Report], None] | None = None,
    ) -> None:
        self.owner = owner
        self.checkpointer = checkpointer
        self.url = url  # the local folder is uploaded there once complete
        self.folder: str | None = None
        self.core: FolderSave | None = None  # the marker and this process's lazy files of the save
        self.sharded: list[SaveHandle] = []  # FSDP sharded folders (DistributedCheckpointer saves)
        self.error: BaseException | None = None  # for load_state's message; reported by the checkpointer
        self.failed: SaveHandle | None = None  # a finished handle whose report is that error's (see _fail)
        self.rng_only = False  # another node's process saving by level: only its RNG file (``_nodes.py``)
        #: Called on the finisher thread once the call has ended, unless stock raised (``_levels``).
        self.on_end: Callable[[SaveStateCall], None] | None = None
        self.ended = False  # this process's part of the folder is complete (marker removed)
        self.done = threading.Event()
        self.started = time.perf_counter()
        self.durable_at: float | None = None
        self._tag = tag
        self._finisher = finisher
        self._uploader = uploader
        self._publish = publish
        self._sync_files: list[str] = []
        self._scan_folder = False
        self._aborted = False
        self._remaining = 0
        self._lock = reentry.Lock()

    @property
    def handles(self) -> list[SaveHandle]:
        return (self.core.handles if self.core is not None else []) + self.sharded

    # -- on the training thread, inside stock save_state ---------------------------------------------
    def begin(self, output_dir: str | os.PathLike[str]) -> FolderSave:
        """The folder save (its pending marker), made at the first need; the same one after."""
        if self.core is not None:
            return self.core
        # The marker's fsync runs on the finisher thread, so _complete (queued there later) finds it settled.
        self.core = FolderSave(_compat.real_path(output_dir), tag=self._tag, submit=self._finisher)
        self.folder = self.core.folder
        return self.core

    def save(self, obj: Any, f: str | os.PathLike[str], *, save_on_each_node: bool, safe_serialization: bool) -> None:
        """What stock ``accelerate.checkpointing.save(obj, f, ...)`` would write, lazily (same format and writer)."""
        if self.rng_only or not _compat.is_writer(save_on_each_node):
            return
        path = os.fspath(f)
        core = self.begin(os.path.dirname(os.path.abspath(path)))
        if safe_serialization and isinstance(obj, OrderedDict):
            obj = clean_state_dict_for_safetensors(obj)  # as stock
        if safe_serialization:  # committed only once the marker is durable (FolderSave.save)
            core.save(self.checkpointer, obj, path, format="safetensors", metadata={"format": "pt"})
        else:
            core.save(self.checkpointer, obj, path, format="torch")

    def add_sharded(self, handle: SaveHandle) -> None:
        """A sharded folder saved inside this call: the marker waits for it too."""
        self.sharded.append(handle)

    # -- after stock save_state returned (or raised) -------------------------------------------------
    def finish(self, sync_files: list[str], scan_folder: bool, aborted: bool) -> None:
        """Stock returned: end the folder save once every handle is done (``aborted``: stock raised; only settle)."""
        self._sync_files = sync_files
        self._scan_folder = scan_folder
        self._aborted = aborted
        self._remaining = len(self.handles) + 1
        for h in self.handles:
            h.add_done_callback(self._one_done)
        self._one_done(None)

    def _one_done(self, _h: SaveHandle | None) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finisher(self._complete)

    def _complete(self) -> None:
        upload = False
        try:
            for h in self.handles:
                exc = h.exception()
                if exc is not None and self.error is None:
                    self.error, self.failed = exc, h
            if self.error is None and not self._aborted and self.folder is not None:
                self._make_durable()
                upload = self.url is not None
            elif self.error is not None:
                logger.error(
                    "lazyckpt: save into %s failed; the folder stays marked incomplete: %r", self.folder, self.error
                )
        except BaseException as exc:  # noqa: BLE001 - reported once by the checkpointer
            self._fail(exc)
        finally:
            if upload and self.error is None:  # uploads are slow: on their own thread
                self._uploader(self._upload)
            else:
                self._end()

    def _upload(self) -> None:
        """Upload the complete local folder, manifest last (``commit/remote_folder.py``)."""
        try:
            assert self.folder is not None and self.url is not None
            _remote_folder.upload(producer_of(self.checkpointer), self.folder, self.url)
        except BaseException as exc:  # noqa: BLE001 - an UploadError, reported once by the checkpointer
            self._fail(exc)
        finally:
            self._end()

    def _fail(self, exc: BaseException) -> None:
        failed = None
        if self._publish is None:
            self.checkpointer.add_error(exc)  # before done: a wait() that sees done finds it
        else:  # a handle holding the published report, so a multi-level handle can share it
            completion = Completion(self.folder or "", None)
            completion.finish(None, exc, publish=self._publish)
            failed = completion.handle
        if self.error is None:
            self.error, self.failed = exc, failed

    def _end(self) -> None:
        self.durable_at = time.perf_counter()
        self.done.set()
        if self.on_end is not None and not self._aborted:
            self.on_end(self)

    def _make_durable(self) -> None:
        """Every lazy file committed: fsync what stock wrote itself, then end the core's folder save."""
        core = self.core
        if core is None:
            return
        files = list(self._sync_files)
        if self._scan_folder:  # writer process: custom objects, samplers ... written by stock
            try:
                with os.scandir(core.folder) as it:
                    files += [e.path for e in it if not e.name.startswith(".") and e.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                return  # deleted meanwhile (e.g. by total_limit): nothing to mark
        self.ended = core.end(files)

    def wait(self, timeout: float | None = None) -> BaseException | None:
        """Block until every file and the marker are settled; return the error (still the checkpointer's
        to report). Raises ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self.handles):
            h.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.done.wait(left):
            raise TimeoutError(f"lazyckpt: save into {self.folder} not durable after {timeout} s")
        return self.error


def stock_written_files(accelerator: Any, folder: str) -> tuple[list[str], bool]:
    """The small files stock ``save_state`` writes itself in this process (fsynced before the marker goes),
    and whether this process writes the rest (found by scanning the folder)."""
    out = Path(folder)
    files = [str(out / f"{RNG_STATE_NAME}_{accelerator.state.process_index}.pkl")]
    if accelerator.scaler is not None:
        files.append(str(out / SCALER_NAME))
    for i, dl in enumerate(accelerator._dataloaders):
        if getattr(dl, "use_stateful_dataloader", False):
            files.append(str(out / ("dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin")))
    return files, _compat.is_writer(accelerator.project_configuration.save_on_each_node)


class SaveStateCalls:
    """One handle's ``save_state`` calls still pending, or failed (kept for ``load_state``'s messages). Thread-safe."""

    def __init__(self) -> None:
        self._lock = reentry.Lock()
        self._calls: list[SaveStateCall] = []

    def add(self, call: SaveStateCall) -> None:
        with self._lock:
            self._calls.append(call)

    def all(self) -> list[SaveStateCall]:
        with self._lock:
            return list(self._calls)

    def into(self, pred: Callable[[str], bool]) -> list[SaveStateCall]:
        return [c for c in self.all() if c.folder is not None and pred(c.folder)]

    def wait_into(self, pred: Callable[[str], bool]) -> None:
        """Wait for this process's saves into the folders ``pred`` accepts (errors stay unreported)."""
        for call in self.into(pred):
            call.wait()

    def to_url(self, url: str) -> list[SaveStateCall]:
        return [c for c in self.all() if c.url == url]

    def uploads_pending(self) -> list[SaveStateCall]:
        return [c for c in self.all() if c.url is not None and not c.done.is_set()]

    def error_for(self, folder: str) -> BaseException | None:
        return next((c.error for c in self.into(lambda f: f == folder) if c.error is not None), None)

    def pending(self) -> int:
        return sum(1 for c in self.all() if not c.done.is_set())

    def prune(self) -> None:
        """Forget durable calls (failed ones stay)."""
        with self._lock:
            self._calls = [c for c in self._calls if not c.done.is_set() or c.error is not None]
