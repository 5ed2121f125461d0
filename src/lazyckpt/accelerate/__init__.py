"""Lazy ``accelerator.save_state`` for Hugging Face Accelerate, with the stock file layout.

Usage::

    import lazyckpt.accelerate

    accelerator = Accelerator(...)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    handle = lazyckpt.accelerate.install(accelerator)      # once, before or after prepare()
    for batch in loader:
        ...
        accelerator.backward(loss)
        optimizer.step()                                    # waits here only if copies are still running
        accelerator.save_state(...)                         # returns promptly
    handle.wait()                                           # every pending save durable; raises the first error
    handle.remove()                                         # back to stock behaviour (after draining)

How it works (checked against accelerate 1.15):

* ``Accelerator.save_state`` writes models, optimizers, schedulers, samplers and registered custom objects
  through ``accelerate.checkpointing.save``, a name that module imports from ``accelerate.utils.other``.
  ``install`` replaces that module attribute with a dispatcher. Outside a lazy ``save_state`` call (another
  Accelerator, direct calls, other threads) the dispatcher calls the original function, so nothing else
  changes. Inside one it hands the object to ``LazyCheckpointer.save`` with the same format choice as stock
  (safetensors after accelerate's own ``clean_state_dict_for_safetensors``, or torch.save) and the same
  "which process writes" rule (global main process, or each node's main with ``save_on_each_node``).
* RNG states, the GradScaler state and stateful-dataloader states are small per-process files written with
  plain ``torch.save`` inside accelerate; they stay synchronous and are fsynced in the background.
* The optimizers prepared by the accelerator are ``track``-ed, so model parameters and optimizer state are
  copied in the background; the core's global optimizer step pre-hook waits for those copies right before
  the next real ``optimizer.step()`` (steps skipped for gradient accumulation never reach it).
* Every process marks a folder it is saving into with a hidden ``.lazyckpt-pending-*`` file, created and
  made durable before any checkpoint file, and removed (then the folder fsynced) only once all of that
  process's files of that save are durable: the core's folder protocol (``lazyckpt.commit.folder.FolderSave``,
  ``lazyckpt.is_complete``), with the process index as the marker's tag. A folder without such a marker
  holds exactly the files stock Accelerate writes. ``load_state`` waits for pending saves (this process's
  through their handles, other processes' by watching their markers), refuses an incomplete folder with
  :class:`IncompleteCheckpointError` or, with automatic checkpoint naming, falls back to the newest
  complete folder with an :class:`IncompleteCheckpointWarning`. No collective call is added to ``save_state`` or
  ``load_state``: calling them on some processes only works as it does with stock.
* With ``automatic_checkpoint_naming`` and ``total_limit``, the folders stock ``save_state`` is about to delete
  are drained first, so deletion never races a pending write; the kept folders are the stock ones. They are
  then renamed out of ``checkpoints/`` (to a hidden temporary name in the project folder) and deleted in the
  background: freeing 1 GB of fsynced files took 0.2 s inside stock's ``rmtree`` here.
* FSDP ``SHARDED_STATE_DICT``: the ``torch.distributed.checkpoint.save`` calls of accelerate's ``save_fsdp_model``
  / ``save_fsdp_optimizer`` (collective, every process) are routed to a ``lazyckpt.distributed.DistributedCheckpointer``
  owned by the handle: the same ``pytorch_model_fsdp_<i>`` / ``optimizer_<i>`` folders, committed whole once every
  process's part is durable; the save_state folder's marker waits for them; ``wait()`` raises their errors.
* The pending marker is fsynced in the background, and no lazily written file of that save is renamed to its
  final name before the marker is durable. The small files stock writes itself (RNG states, scaler, custom
  objects) are not ordered against it: after a crash right at the start of a save, a folder may hold some of
  those and no marker; it then lacks the model and optimizer files, so loading it fails loudly.

Only the public lazyckpt API and the core's folder protocol (``lazyckpt.commit.folder``) are used here; the core
never imports accelerate.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import queue
import shutil
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.utils.constants import RNG_STATE_NAME, SCALER_NAME
from accelerate.utils.other import clean_state_dict_for_safetensors

from lazyckpt import CheckpointerOptions, LazyCheckpointer, SaveHandle, cleanup_temporaries
from lazyckpt.accelerate import _compat
from lazyckpt.commit import remote_folder as _remote_folder
from lazyckpt.commit.folder import MARKER_PREFIX, FolderSave, is_complete, live_markers, pending_markers
from lazyckpt.core import guard as _guard
from lazyckpt.errors import (
    BackpressureWarning,
    IncompleteCheckpointError,
    IncompleteCheckpointWarning,
    SaveRefusedError,
)
from lazyckpt.storage.remote import before_interpreter_shutdown, is_url

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lazyckpt.distributed import DistributedCheckpointer

__all__ = [
    "install",
    "AccelerateHandle",
    "IncompleteCheckpointError",
    "IncompleteCheckpointWarning",
    "PENDING_MARKER_PREFIX",
    "is_complete",
]

logger = logging.getLogger("lazyckpt.accelerate")

#: Prefix of the hidden per-process marker files that flag a folder whose lazy save is not durable yet
#: (the core's ``lazyckpt.commit.folder.MARKER_PREFIX``; ``pending_markers`` and ``is_complete`` are the core's too).
PENDING_MARKER_PREFIX = MARKER_PREFIX

# --------------------------------------------------------------------------------------------------
# One save_state call of one process
# --------------------------------------------------------------------------------------------------


class _FolderSave:
    """The lazy part of one ``save_state`` call in this process: core handles + marker + sync files."""

    def __init__(self, owner: AccelerateHandle) -> None:
        self.owner = owner
        self.folder: str | None = None
        self.url: str | None = None  # save_state to a URL: the local folder is uploaded once complete
        self.core: FolderSave | None = None  # the marker and this process's lazy files of the save
        self.dist_handles: list[SaveHandle] = []  # FSDP sharded folders (DistributedCheckpointer saves)
        self.sync_files: list[str] = []
        self.scan_folder = False
        self.aborted = False
        self.error: BaseException | None = None  # for load_state's message; reported by the checkpointer
        self.done = threading.Event()
        self._remaining = 0
        self._lock = threading.Lock()
        self.started = time.perf_counter()
        self.durable_at: float | None = None

    @property
    def handles(self) -> list[SaveHandle]:
        return (self.core.handles if self.core is not None else []) + self.dist_handles

    # -- called on the training thread, inside stock save_state -------------------------------------
    def begin(self, output_dir: str | os.PathLike) -> FolderSave:
        if self.core is not None:
            return self.core
        # The marker's fsync runs on the finisher thread, so _complete (queued there later) finds it settled.
        self.core = FolderSave(_compat.real_path(output_dir), tag=self.owner.accelerator.process_index,
                               submit=self.owner._finisher_submit)  # fmt: skip
        self.folder = self.core.folder
        return self.core

    def save(self, obj: Any, f: str | os.PathLike[str], *, save_on_each_node: bool, safe_serialization: bool) -> None:
        if not _compat.is_writer(save_on_each_node):
            return
        path = os.fspath(f)
        core = self.begin(os.path.dirname(os.path.abspath(path)))
        ckpt = self.owner.checkpointer
        if safe_serialization and isinstance(obj, OrderedDict):
            obj = clean_state_dict_for_safetensors(obj)  # drops tied duplicates exactly like stock
        if safe_serialization:  # committed only once the marker is durable (FolderSave.save)
            core.save(ckpt, obj, path, format="safetensors", metadata={"format": "pt"})
        else:
            core.save(ckpt, obj, path, format="torch")

    # -- after stock save_state returned (or raised) -------------------------------------------------
    def finish(self, sync_files: list[str], scan_folder: bool, aborted: bool) -> None:
        self.sync_files = sync_files
        self.scan_folder = scan_folder
        self.aborted = aborted
        self._remaining = len(self.handles) + 1
        for h in self.handles:
            h.add_done_callback(self._one_done)
        self._one_done(None)

    def _one_done(self, _h: SaveHandle | None) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self.owner._finisher_submit(self._complete)

    def _complete(self) -> None:
        upload = False
        try:
            for h in self.handles:
                exc = h.exception()
                if exc is not None and self.error is None:
                    self.error = exc
            if self.error is None and not self.aborted and self.folder is not None:
                self._make_durable()
                upload = self.url is not None
            elif self.error is not None:
                logger.error(
                    "lazyckpt: save into %s failed; the folder stays marked incomplete: %r", self.folder, self.error
                )
        except BaseException as exc:  # noqa: BLE001 - reported once by the checkpointer (wait, next save)
            self._fail(exc)
        finally:
            if upload and self.error is None:  # the next stage, on its own thread (uploads are slow)
                self.owner._uploader.submit(self._upload)
            else:
                self._end()

    def _upload(self) -> None:
        """The local folder is complete: its files to the URL, the manifest last (``_remote_folder``)."""
        try:
            assert self.folder is not None and self.url is not None
            _remote_folder.upload(self.owner.checkpointer, self.folder, self.url)
        except BaseException as exc:  # noqa: BLE001 - an UploadError, reported once by the checkpointer
            self._fail(exc)
        finally:
            self._end()

    def _fail(self, exc: BaseException) -> None:
        self.owner.checkpointer.add_error(exc)  # before done: a wait() that sees done finds it
        if self.error is None:
            self.error = exc

    def _end(self) -> None:
        self.durable_at = time.perf_counter()
        self.done.set()

    def _make_durable(self) -> None:
        """Every lazy file committed: fsync what stock wrote itself, then end the core's folder save."""
        core = self.core
        if core is None:
            return
        files = list(self.sync_files)
        if self.scan_folder:  # the writer process: custom objects, samplers ... written by stock
            try:
                with os.scandir(core.folder) as it:
                    files += [e.path for e in it if not e.name.startswith(".") and e.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                return  # deleted meanwhile (e.g. by total_limit on the main process): nothing to mark
        core.end(files)

    def wait(self, timeout: float | None = None) -> BaseException | None:
        """Block until every file and the folder's marker are settled; the error stays the
        checkpointer's to report (``h.exception`` does not count as seen)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self.handles):
            h.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.done.wait(left):
            raise TimeoutError(f"lazyckpt: save into {self.folder} not durable after {timeout} s")
        return self.error


class _SerialWorker:
    """One named daemon thread running jobs in submission order; inline once stopped."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # noqa: BLE001
                logger.exception("lazyckpt.accelerate: %s job failed", self._thread.name)

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread.is_alive():
            self._q.put(job)
        else:  # after remove(): run inline
            job()

    def stop(self) -> None:
        self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


# --------------------------------------------------------------------------------------------------
# The handle returned by install()
# --------------------------------------------------------------------------------------------------

_installed: weakref.WeakKeyDictionary[Any, AccelerateHandle] = weakref.WeakKeyDictionary()


def _route_for(accelerator: Any) -> Callable[[dict[str, Any], str], None] | None:
    handle = _installed.get(accelerator) if accelerator is not None else None
    if handle is None or handle.removed:
        return None
    return handle._route_dcp_save


_compat.route_for = _route_for


class AccelerateHandle:
    """What :func:`install` returns: ``wait()`` drains pending saves, ``remove()`` restores stock behaviour."""

    def __init__(self, accelerator: Accelerator, checkpointer: LazyCheckpointer, owns_checkpointer: bool) -> None:
        self.accelerator = accelerator
        self.checkpointer = checkpointer
        self._owns = owns_checkpointer
        self._saves: list[_FolderSave] = []
        self._steps_seen = _guard.steps()  # optimizer steps at install / the last save_state
        self._deletions: list[Future[Any]] = []  # old folders being deleted (total_limit)
        self._lock = threading.Lock()
        self._tracked: set[int] = set()
        self._tracked_refs: list = []
        self._removed = False
        self._warned_stock = False
        self._finisher = _SerialWorker("lazyckpt-accelerate-finisher")  # marker fsyncs, folder completion
        self._uploader = _SerialWorker("lazyckpt-accelerate-upload")  # folders saved to URLs, in save order
        self._exit_hooked = False
        # What save_state/load_state resolve to now (normally the class methods), and whether the instance
        # already had its own attribute (restored as is by remove()).
        self._stock_save_state = accelerator.save_state
        self._stock_load_state = accelerator.load_state
        self._prev_attrs = {n: vars(accelerator)[n] for n in ("save_state", "load_state") if n in vars(accelerator)}
        self._hook_handle = None
        self._installed_attrs: dict[str, _compat.InstalledMethod] = {}  # what install() set on the instance
        self.load_timeout = 600.0  # seconds load_state waits for other processes' pending saves
        self.max_pending_uploads = 2  # folders saved to URLs waiting for upload before save_state waits
        self.last_save_state_s: float | None = None  # seconds the last save_state call blocked
        self._trash_cleaned: set[str] = set()
        self._dist: DistributedCheckpointer | None = None  # FSDP sharded saves: created at the first one

    # -- background finisher -------------------------------------------------------------------------
    def _finisher_submit(self, job: Callable[[], None]) -> None:
        self._finisher.submit(job)

    # -- patched methods -----------------------------------------------------------------------------
    def _lazy_supported(self) -> bool:
        acc = self.accelerator
        if acc.distributed_type in _compat.STOCK_ONLY_TYPES and not _compat.is_sharded_fsdp(acc):
            if not self._warned_stock:
                self._warned_stock = True
                logger.warning(
                    "lazyckpt.accelerate: distributed type %s is not supported; save_state stays synchronous (stock)",
                    acc.distributed_type,
                )
            return False
        return True

    def _track_new_optimizers(self) -> None:
        new = []
        for opt in self.accelerator._optimizers:
            inner = _compat.unwrap_optimizer(opt)
            if inner is not None and id(inner) not in self._tracked:
                self._tracked.add(id(inner))
                self._tracked_refs.append(inner)  # keep id() unique while tracked
                new.append(inner)
        if new:
            self.checkpointer.track(*new)

    def _doomed_folders(self) -> tuple[list[str], bool]:
        """The folders stock save_state is about to rmtree, as stock names them (same computation as
        accelerate 1.15), and whether that list is exact (False: stock's sort will fail on a stray name)."""
        acc = self.accelerator
        pc = acc.project_configuration
        if not (pc.automatic_checkpoint_naming and pc.total_limit is not None and acc.is_main_process):
            return [], True
        base = os.path.join(acc.project_dir, "checkpoints")
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

    def _delete_doomed(self, doomed: list[str]) -> None:
        """Take stock's rmtree of old folders off the training thread: each is renamed into the project
        folder under a hidden temporary name (so stock's count sees the room made and deletes nothing)
        and deleted in the background; ``wait()`` waits for that too. Anything unusual (a symlinked
        folder, which stock's rmtree refuses; a rename that fails) is left to stock, as it would be."""
        trash = os.fspath(self.accelerator.project_dir)
        mine = [f for f in doomed if os.path.isdir(f) and not os.path.islink(f)]
        if not mine:
            return
        logger.warning(f"Deleting {len(mine)} checkpoints to make room for new checkpoint.")
        if trash not in self._trash_cleaned:  # folders a killed process renamed there and never deleted
            self._trash_cleaned.add(trash)
            cleanup_temporaries(trash)
        for folder in mine:
            try:  # the checkpointer's wait() waits for the deletion and reports its error
                self._deletions = [f for f in self._deletions if not f.done()]
                self._deletions.append(self.checkpointer.remove(folder, trash_dir=trash))
            except OSError as exc:
                logger.debug("lazyckpt: leaving the deletion of %s to accelerate: %s", folder, exc)

    def _prune(self) -> None:
        # caller holds self._lock: forget durable saves (failed ones stay, for load_state's message)
        self._saves = [fs for fs in self._saves if not fs.done.is_set() or fs.error is not None]

    def _raise_unreported(self) -> None:
        """Errors are the checkpointer's to report, once (failed files, folders, deletions)."""
        with self._lock:
            self._prune()
        self.checkpointer.raise_errors()

    def _save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        url = self._url_target(output_dir)
        if self._removed or not self._lazy_supported():
            if url is not None:
                raise SaveRefusedError(f"lazyckpt.accelerate: save_state to a URL ({url}) needs the lazy path")
            return self._stock_save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        t0 = time.perf_counter()
        # No optimizer step since the last save_state (or install): no training runs to overlap with
        # (an evaluation, a save before training, a script about to delete or read the folder):
        # behave as stock and return with the folder durable.
        training, self._steps_seen = _guard.steps() != self._steps_seen, _guard.steps()
        if url is not None:  # saved into a fresh local folder, uploaded once complete (_FolderSave._upload)
            self._admit_upload(url)
            output_dir = _remote_folder.local_folder(self.checkpointer, url)
        # 1. never let stock's rmtree of old folders race their pending writes
        doomed, exact = self._doomed_folders()
        if doomed:
            real = [_compat.real_path(d) for d in doomed]
            self._wait_where(lambda folder: any(folder == d or folder.startswith(d + os.sep) for d in real))
            if exact:
                self._delete_doomed(doomed)
        # 2. a failed earlier save is reported here at the latest (stock save_state would have raised)
        self._raise_unreported()
        self._track_new_optimizers()
        fs = _FolderSave(self)
        fs.url = url
        token = _compat.active_save.set(fs)
        aborted = True
        try:
            location = self._stock_save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
            aborted = False
        finally:
            _compat.active_save.reset(token)
            if fs.folder is not None:
                sync, scan = self._sync_files(fs.folder)
                with self._lock:
                    self._saves.append(fs)
                fs.finish(sync, scan, aborted)
            self.last_save_state_s = time.perf_counter() - t0
        if not training and not aborted and fs.folder is not None and self.accelerator.num_processes == 1:
            # Durable on return, the old folders' deletions done; a failure is still reported as
            # every lazy save's is (the next save_state / load_state / wait()).
            fs.wait()  # confirms on this thread (the saving thread): never waits for itself
            futures_wait(self._deletions)
            self.last_save_state_s = time.perf_counter() - t0
        return url if url is not None else location

    def _url_target(self, output_dir: Any) -> str | None:
        """The URL ``save_state`` writes to, or None for a local folder; refuses what cannot work."""
        acc = self.accelerator
        if acc.project_configuration.automatic_checkpoint_naming:
            if is_url(str(acc.project_dir)):  # stock would makedirs a local folder named "s3:"
                raise SaveRefusedError(
                    f"lazyckpt.accelerate: automatic_checkpoint_naming with a URL project_dir ({acc.project_dir}) "
                    "is not supported; call save_state(output_dir='s3://...') with explicit names instead"
                )
            return None
        if not (isinstance(output_dir, str) and is_url(output_dir)):
            return None
        if acc.num_processes > 1:
            raise SaveRefusedError(
                f"lazyckpt.accelerate: save_state to a URL ({output_dir}) with {acc.num_processes} processes is not "
                "supported yet (one process only); save to a shared local folder and upload it"
            )
        if not self._exit_hooked:  # s3fs cannot upload from a plain atexit hook (see _remote)
            self._exit_hooked = True
            before_interpreter_shutdown(functools.partial(_drain_at_exit, weakref.ref(self)))
        return output_dir.rstrip("/")

    def _admit_upload(self, url: str) -> None:
        """Bound the local disk: at most ``max_pending_uploads`` folders saved to URLs wait for their
        upload; the next save_state to a URL waits for the oldest (and warns with the numbers)."""
        with self._lock:
            pending = [fs for fs in self._saves if fs.url is not None and not fs.done.is_set()]
        if len(pending) < self.max_pending_uploads:
            return
        t = time.monotonic()
        for fs in pending[: len(pending) - self.max_pending_uploads + 1]:
            fs.wait()
        warnings.warn(
            f"lazyckpt.accelerate: save_state to {url} waited {time.monotonic() - t:.2f} s for uploads: "
            f"{len(pending)} folder(s) were still waiting for upload, bound {self.max_pending_uploads} "
            "(max_pending_uploads). Save less often or give uploads more bandwidth.",
            BackpressureWarning,
            stacklevel=4,
        )

    def _route_dcp_save(self, state_dict: dict[str, Any], path: str) -> None:
        """What accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` would save with
        ``dcp.save(state_dict, storage_writer=FileSystemWriter(path))``, lazily, on every process
        (collective, as dcp.save is): the same folder through a ``DistributedCheckpointer``."""
        if self._removed:
            raise RuntimeError("lazyckpt.accelerate: routing a save after remove()")  # not reached: unrouted
        fs = _compat.active_save.get()
        if not isinstance(fs, _FolderSave) or fs.owner is not self:
            fs = None
        if fs is not None:  # inside an installed save_state: the output folder's marker waits for it too
            fs.begin(os.path.dirname(os.path.abspath(path)))
        ckpt = self._dist_checkpointer()
        handle = ckpt.save(state_dict, path)
        if fs is not None:
            fs.dist_handles.append(handle)

    def _dist_checkpointer(self) -> DistributedCheckpointer:
        if self._dist is None:
            from lazyckpt.distributed import DistributedCheckpointer

            opts = dataclasses.replace(self.checkpointer.options, on_backpressure="block")
            self._dist = DistributedCheckpointer(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)})
        return self._dist

    def _sync_files(self, folder: str) -> tuple[list[str], bool]:
        acc = self.accelerator
        out = Path(folder)
        files = [str(out / f"{RNG_STATE_NAME}_{acc.state.process_index}.pkl")]
        if acc.scaler is not None:
            files.append(str(out / SCALER_NAME))
        for i, dl in enumerate(acc._dataloaders):
            if getattr(dl, "use_stateful_dataloader", False):
                files.append(str(out / ("dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin")))
        scan = _compat.is_writer(acc.project_configuration.save_on_each_node)
        return files, scan

    def _load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        if self._removed:
            return self._stock_load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        acc = self.accelerator
        pc = acc.project_configuration
        if isinstance(input_dir, str) and is_url(input_dir):
            return self._load_url(input_dir.rstrip("/"), load_kwargs=load_kwargs, **kwargs)
        if input_dir is not None:
            target = _compat.real_path(input_dir)
            self._wait_where(lambda folder: folder == target)  # this process's pending saves into it
            self._wait_other_processes([target])  # and other processes' (shared files)
            markers = pending_markers(target)
            if os.path.isdir(target) and markers:
                failed = self._error_for(target)
                raise IncompleteCheckpointError(
                    f"lazyckpt: checkpoint folder {input_dir!r} is incomplete: {_why_incomplete(failed, markers)}. "
                    "Load an earlier checkpoint folder instead."
                ) from failed
            return self._stock_load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if pc.automatic_checkpoint_naming:
            base = _compat.real_path(os.path.join(acc.project_dir, "checkpoints"))
            self._wait_where(lambda folder: os.path.dirname(folder) == base)
            folders = [os.path.join(base, f) for f in os.listdir(base)]
            self._wait_other_processes(folders)
            folders = [os.path.join(base, f) for f in os.listdir(base)]
            folders.sort(key=_compat.folder_number)
            complete = [f for f in folders if is_complete(f)]
            if not complete:
                failed = next((e for e in map(self._error_for, reversed(folders)) if e is not None), None)
                why = "every save there was interrupted before it became durable"
                if failed is not None:
                    why = f"every save there failed or was interrupted; the newest failure here: {_describe(failed)}"
                raise IncompleteCheckpointError(
                    f"lazyckpt: no complete checkpoint folder in {base!r}: {why} "
                    f"({[os.path.basename(f) for f in folders]})."
                ) from failed
            chosen = complete[-1]
            if folders and chosen != folders[-1]:
                skipped_folders = folders[folders.index(chosen) + 1 :]
                skipped = [os.path.basename(f) for f in skipped_folders]
                errors = [(f, self._error_for(f)) for f in skipped_folders]
                causes = [f"{os.path.basename(f)}: {_describe(e)}" for f, e in errors if e is not None]
                why = "their save was interrupted before it became durable"
                if causes:
                    why = "their save failed in this process: " + "; ".join(causes)
                msg = (
                    f"lazyckpt: newest checkpoint folder(s) {skipped} in {base!r} are incomplete ({why}); "
                    f"loading {os.path.basename(chosen)!r} instead."
                )
                logger.warning(msg)
                warnings.warn(msg, IncompleteCheckpointWarning, stacklevel=2)
            return self._stock_load_state(chosen, load_kwargs=load_kwargs, **kwargs)
        return self._stock_load_state(input_dir, load_kwargs=load_kwargs, **kwargs)

    def _load_url(self, url: str, load_kwargs: dict[str, Any] | None, **kwargs: Any) -> Any:
        """Wait for this process's saves to ``url``, download the files its manifest names into the
        local tier (``IncompleteCheckpointError`` without a manifest), stock load_state from there."""
        with self._lock:
            mine = [fs for fs in self._saves if fs.url == url]
        for fs in mine:
            fs.wait()
        dest = _remote_folder.local_folder(self.checkpointer, url)
        try:
            try:
                _remote_folder.download(self.checkpointer, url, dest)
            except IncompleteCheckpointError as exc:
                failed = next((fs.error for fs in reversed(mine) if fs.error is not None), None)
                raise exc from failed
            return self._stock_load_state(dest, load_kwargs=load_kwargs, **kwargs)
        finally:
            shutil.rmtree(os.path.dirname(dest), ignore_errors=True)

    def _wait_other_processes(self, folders: list[str]) -> None:
        """Wait until no other live process has a pending save into ``folders`` (bounded by load_timeout).

        No collective call: load_state (and save_state) may be called on some processes only, as stock allows.
        """
        if self.accelerator.num_processes <= 1:
            return
        deadline = time.monotonic() + self.load_timeout
        delay = 0.005
        while True:
            busy = [f for f in folders if live_markers(f)]  # other processes' saves that may still end
            if not busy or time.monotonic() >= deadline:
                if busy:
                    logger.warning(
                        "lazyckpt: gave up after %.0f s waiting for other processes' saves into %s",
                        self.load_timeout,
                        busy,
                    )
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _error_for(self, folder: str) -> BaseException | None:
        with self._lock:
            for fs in self._saves:
                if fs.folder == folder and fs.error is not None:
                    return fs.error
        return None

    def _wait_where(self, pred: Callable[[str], bool]) -> None:
        with self._lock:
            todo = [fs for fs in self._saves if fs.folder is not None and pred(fs.folder)]
        for fs in todo:
            fs.wait()

    # -- public --------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending ``save_state`` of this accelerator is durable (and old folders deleted for
        ``total_limit`` are gone); raise the first error nobody has seen. ``timeout``: seconds (``None``: no
        limit), then ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            todo = list(self._saves)
        for fs in todo:
            fs.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.checkpointer.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._dist is not None:  # every FSDP sharded save committed on every process (or its error)
            self._dist.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._prune()

    def pending(self) -> int:
        """Number of save_state calls of this accelerator whose files are not all durable yet."""
        with self._lock:
            return sum(1 for fs in self._saves if not fs.done.is_set())

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Drain pending saves, then restore the stock ``save_state``/``load_state`` (raises a drained error)."""
        if self._removed:
            return
        error: BaseException | None = None
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            error = exc
        finally:
            self._removed = True
            acc = self.accelerator
            for name, ours in self._installed_attrs.items():
                if vars(acc).get(name) is ours:
                    if name in self._prev_attrs:
                        setattr(acc, name, self._prev_attrs[name])
                    else:
                        delattr(acc, name)
            if self._hook_handle is not None:
                self._hook_handle.remove()
            _compat.release_patch()
            self._finisher.stop()
            self._uploader.stop()
            self._tracked_refs.clear()
            try:
                atexit.unregister(self._atexit)
            except Exception:  # noqa: BLE001
                pass
            if _installed.get(acc) is self:
                del _installed[acc]
            try:
                if self._dist is not None:
                    dist_ckpt, self._dist = self._dist, None
                    dist_ckpt.close()
            except BaseException as exc:  # noqa: BLE001 - drained above; reported if nothing else was
                error = error or exc
            if self._owns:
                self.checkpointer.close()
        if error is not None:
            raise error

    def __enter__(self) -> AccelerateHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- internals -----------------------------------------------------------------------------------
    def _pre_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        fs = _compat.active_save.get()
        if isinstance(fs, _FolderSave) and fs.owner is self:
            fs.begin(output_dir)

    def _atexit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            logger.error("lazyckpt.accelerate: a checkpoint save failed: %r", exc)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _why_incomplete(failed: BaseException | None, markers: list[str]) -> str:
    """Why a folder is incomplete: the error of this process's save into it when there was one
    (e.g. a tensor changed in place right after save_state), else what a leftover marker means."""
    if failed is not None:
        return f"its save_state in this process failed, so no file of it was completed there ({_describe(failed)})"
    return (
        "a save into it never became durable (the process that saved it was killed, or its save failed "
        f"in another process; markers: {markers})"
    )


def _drain_at_exit(ref: weakref.ref[AccelerateHandle]) -> None:
    handle = ref()
    if handle is not None and not handle.removed:
        handle._atexit()


def install(
    accelerator: Accelerator,
    checkpointer: LazyCheckpointer | None = None,
    *,
    options: CheckpointerOptions | None = None,
    load_timeout: float = 600.0,
    **core_options: Any,
) -> AccelerateHandle:
    """Make ``accelerator.save_state`` lazy (same files as stock) and ``load_state`` wait for pending saves.

    ``checkpointer``: an existing :class:`lazyckpt.LazyCheckpointer` to use (not closed by ``remove()``);
    otherwise one is created from ``options`` (a :class:`lazyckpt.CheckpointerOptions`) and/or ``core_options``
    (the same fields as keywords, overriding ``options``: ``host_memory_budget``, ``writer_threads``, ``fsync``,
    ``on_backpressure``, ``crc``, ``chunk_bytes`` ...) and closed by ``remove()``.
    ``load_timeout``: with several processes, how long ``load_state`` waits for other processes' pending
    saves into the folder it reads before treating the folder as incomplete.
    """
    if checkpointer is not None and (core_options or options is not None):
        raise TypeError("pass either checkpointer= or core options, not both")
    existing = _installed.get(accelerator)
    if existing is not None and not existing.removed:
        raise RuntimeError("lazyckpt.accelerate is already installed on this Accelerator; call remove() first")
    owns = checkpointer is None
    if checkpointer is None:
        checkpointer = LazyCheckpointer(options, **core_options)
    handle = AccelerateHandle(accelerator, checkpointer, owns)
    handle.load_timeout = float(load_timeout)
    try:
        hook_handle = accelerator.register_save_state_pre_hook(_compat.InstalledPreHook(handle._pre_hook))
        # Run first, so the pending marker exists before any user hook or accelerate writes a file.
        accelerator._save_model_state_pre_hook.move_to_end(hook_handle.id, last=False)
        handle._hook_handle = hook_handle
        _compat.acquire_patch()
        for name, method in (("save_state", handle._save_state), ("load_state", handle._load_state)):
            attr = _compat.InstalledMethod(method, accelerator, name, handle._prev_attrs.get(name))
            handle._installed_attrs[name] = attr
            setattr(accelerator, name, attr)
    except BaseException:
        handle._finisher.stop()
        handle._uploader.stop()
        if owns:
            checkpointer.close()
        raise
    atexit.register(handle._atexit)
    _installed[accelerator] = handle
    return handle
