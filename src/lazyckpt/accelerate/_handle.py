"""The handle ``install()`` returns: lazy ``save_state`` / waiting ``load_state`` of one Accelerator.

Threads: the *finisher* (marker fsyncs, folder ends, in order) and the *uploader* (URL folders, in order),
started lazily, plus the checkpointer's own; all end with ``uninstall()``. At exit the handle is drained
(``core/installed.py``), before interpreter shutdown once it saved to a URL.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lazyckpt.accelerate import _compat, _load, _url
from lazyckpt.accelerate._folder_save import SaveStateCall, SaveStateCalls, stock_written_files
from lazyckpt.accelerate._levels import LevelSaves
from lazyckpt.accelerate._patch import InstancePatch
from lazyckpt.accelerate._retention import OldFolders
from lazyckpt.accelerate._sharded import ShardedRoute
from lazyckpt.checkpointer import producer_of
from lazyckpt.core import exit as _exit
from lazyckpt.core import guard as _guard
from lazyckpt.core import remote as _remote
from lazyckpt.core.installed import InstalledHandle, drain_at_exit
from lazyckpt.core.report import raise_first
from lazyckpt.errors import SaveRefusedError
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lazyckpt import LazyCheckpointer, Level, SaveHandle
    from lazyckpt.deepspeed.installs import EngineInstalls

logger = logging.getLogger("lazyckpt.accelerate")

Job = Callable[[], None]


class AccelerateHandle(InstalledHandle):
    """What :func:`install` returns: ``wait()`` drains pending saves, ``uninstall()`` restores stock behaviour.

    Made by ``install()``, which checks its arguments; constructing it installs it on ``accelerator``.
    Usable as a context manager (``uninstall()`` on exit).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        checkpointer: LazyCheckpointer,
        owns_checkpointer: bool,
        *,
        load_timeout: float = 600.0,
        levels: Sequence[Level] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.checkpointer = checkpointer
        self.load_timeout = float(load_timeout)  # seconds load_state waits for other processes' pending saves
        self.max_pending_uploads = 2  # URL folders awaiting upload before save_state waits
        self.last_save_state_s: float | None = None  # seconds the last save_state call blocked
        self._owns = owns_checkpointer
        self._saves = SaveStateCalls()
        self._old_folders = OldFolders(checkpointer)
        self._sharded = ShardedRoute(self, checkpointer)
        self._deepspeed: EngineInstalls | None = None  # DeepSpeed engines, at the first save of one
        self._steps_seen = _guard.steps()  # optimizer steps at install / the last save_state
        self._tracked: set[int] = set()
        self._tracked_refs: list[Any] = []
        self._removed = False
        self._warned_stock = False
        self._exit_early = False
        self._finisher: Worker[Job] = Worker("lazyckpt-accelerate-finisher", _run, lazy=True)  # markers, folder ends
        self._uploader: Worker[Job] = Worker("lazyckpt-accelerate-upload", _run, lazy=True)  # URL folders, in order
        self._levels = None if levels is None else LevelSaves(self, accelerator, checkpointer, levels)
        try:
            self._patch = InstancePatch(
                accelerator,
                self,
                save_state=self._save_state,
                load_state=self._load_state,
                pre_hook=self._pre_hook,
                route=self._sharded.route,
            )
        except BaseException:
            if self._levels is not None:
                self._levels.close()
            raise
        _exit.register(self, drain_at_exit, layer=_exit.INTEGRATION)
        if any(level.is_url for level in self.levels):
            self._drain_before_shutdown()

    # -- public --------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending ``save_state`` of this accelerator is durable (and old folders deleted for
        ``total_limit`` are gone), then raise the first error nobody has seen.

        ``timeout``: seconds (``None``: no limit); raises ``TimeoutError`` when it runs out.
        """
        if reentry.wait_refused("accelerate handle.wait()"):
            return
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self._levels is not None:  # first: level copies end with retention removals
            self._levels.drain(left())
        try:
            if self._deepspeed is not None:  # first: it hands over open tags (the calls' markers wait for them)
                self._deepspeed.wait(left())
        finally:
            for call in self._saves.all():
                call.wait(left())
            self.checkpointer.wait(left())
        self._raise_unreported()
        self._sharded.wait(left())
        self._saves.prune()

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels given to ``install(accelerator, levels=...)`` (``()`` without)."""
        return () if self._levels is None else self._levels.levels

    @property
    def step(self) -> int:
        """The step the next bare ``save_state()`` saves under (with levels).

        The real optimizer steps of the first prepared optimizer (steps skipped under gradient accumulation
        or by the GradScaler do not count), counted from the last value set. ``handle.step = n`` sets it;
        ``load_latest`` sets it to the step it restored. Raises ``RuntimeError`` without levels.
        """
        if self._levels is None:
            raise RuntimeError("lazyckpt.accelerate: handle.step needs install(accelerator, levels=[...])")
        return self._levels.counter.get()

    @step.setter
    def step(self, value: int) -> None:
        if self._levels is None:
            raise RuntimeError("lazyckpt.accelerate: handle.step needs install(accelerator, levels=[...])")
        self._levels.counter.set(value)

    @property
    def last_save(self) -> SaveHandle | None:
        """The handle of the last bare ``save_state()`` with levels (a ``LevelsHandle``: ``step``,
        ``levels_done``, ``levels_skipped``; done once every due level holds its copy), or None."""
        return None if self._levels is None else self._levels.last

    def settle(self, timeout: float | None = None) -> None:
        """Wait for every pending save of this handle (level copies included) without raising their
        errors: they stay to be reported by ``wait()`` or the next ``save_state``."""
        if self._levels is not None:
            self._levels.drain(timeout)
        for call in self._saves.all():
            call.wait(timeout)

    def pending(self) -> int:
        """Number of save_state calls of this accelerator whose files are not all durable yet."""
        return self._saves.pending()

    def uninstall(self) -> None:
        """Drain pending saves, then restore the stock ``save_state`` / ``load_state``; raise a drained error.

        Idempotent; also run by ``with install(...)``. (At interpreter exit the handle is only drained.)
        """
        if self._removed:
            return
        error: BaseException | None = None
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            error = exc
        finally:
            self._removed = True
            self._patch.undo()
            self._finisher.stop()
            self._uploader.stop()
            if self._levels is not None:
                self._levels.close()
            self._tracked_refs.clear()
            _exit.unregister(self)
            for route in (self._sharded, self._deepspeed):
                try:
                    if route is not None:
                        route.close()
                except BaseException as exc:  # noqa: BLE001 - drained above; reported if nothing else was
                    error = error or exc
            if self._owns:
                self.checkpointer.close()
        if error is not None:
            raise error

    def __enter__(self) -> AccelerateHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- what the installed save_state / load_state / pre-hook call ----------------------------------
    def _save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        if reentry.reentered():  # a signal handler interrupted lazyckpt on this thread (threads/reentry.py)
            return self._save_state_now(output_dir, safe_serialization, kwargs)
        if output_dir is None and self._levels is not None and not self._removed:
            return self._levels.save(safe_serialization, kwargs)  # by level: folders <level>/step-<n>
        url = _url.save_target(self.accelerator, output_dir)
        if url is not None:
            self._drain_before_shutdown()
            if _compat.is_deepspeed(self.accelerator) and not self._removed:
                raise SaveRefusedError(
                    f"lazyckpt.accelerate: save_state to a URL ({url}) is not supported with DeepSpeed; "
                    "save to a folder"
                )
        stock = self._patch.stock_save_state
        if self._removed or not self._lazy_supported():
            if url is not None:
                raise SaveRefusedError(f"lazyckpt.accelerate: save_state to a URL ({url}) needs the lazy path")
            return stock(output_dir, safe_serialization=safe_serialization, **kwargs)
        t0 = time.perf_counter()
        training = self.training_since_last_save()
        if url is not None:  # saved into a fresh local folder, uploaded once complete
            _url.admit_upload(self._saves, url, self.max_pending_uploads)
            output_dir = _url.local_folder(self.checkpointer, url)
        location, call = self.save_into(output_dir, safe_serialization, kwargs, url=url)
        if not training and call.folder is not None and self.accelerator.num_processes == 1:
            # No optimizer step since the last save: nothing to overlap with, so return durable, as stock.
            call.wait()
            self._old_folders.wait()
            self.last_save_state_s = time.perf_counter() - t0
        return url if url is not None else location

    def _save_state_now(self, output_dir: str | None, safe_serialization: bool, kwargs: dict[str, Any]) -> Any:
        """``save_state`` from a signal handler that interrupted lazyckpt: stock's, on this thread, taking
        no lazyckpt lock; pending lazy saves into ``output_dir`` are superseded first."""
        reentry.count_synchronous()
        if output_dir is not None and not _remote.is_url(os.fspath(output_dir)):
            self.checkpointer.supersede_into(os.path.abspath(os.fspath(output_dir)))
        save, dcp = _compat.active_save.set(None), _compat.active_dcp.set(None)
        try:
            return self._patch.stock_save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        finally:
            _compat.active_dcp.reset(dcp)
            _compat.active_save.reset(save)

    def training_since_last_save(self) -> bool:
        """Whether an optimizer step ran since the last call (or ``install``)."""
        training, self._steps_seen = _guard.steps() != self._steps_seen, _guard.steps()
        return training

    def save_into(
        self,
        output_dir: Any,
        safe_serialization: bool,
        kwargs: dict[str, Any],
        *,
        url: str | None = None,
        prepare: Callable[[SaveStateCall], None] | None = None,
    ) -> tuple[Any, SaveStateCall]:
        """Stock ``save_state(output_dir)`` run lazily: what it returned and the ``SaveStateCall``.
        ``prepare(call)`` runs before stock; with it, the call's errors are published as shareable reports."""
        stock = self._patch.stock_save_state
        t0 = time.perf_counter()
        if not self._lazy_supported():
            raise SaveRefusedError(
                "lazyckpt.accelerate: save_state by level needs the lazy path, which "
                f"{self.accelerator.distributed_type} does not take; save to explicit folders "
                "(save_state(output_dir)) instead"
            )
        deepspeed = _compat.is_deepspeed(self.accelerator)
        if deepspeed and prepare is not None:
            raise SaveRefusedError(
                "lazyckpt.accelerate: save_state by level is not supported with DeepSpeed yet; save to explicit "
                "folders (save_state(output_dir)) instead"
            )
        self._old_folders.make_room(self.accelerator, self._saves)  # before stock's rmtree of old folders
        self._raise_unreported()  # an earlier failure is reported here at the latest
        if deepspeed:  # the engines' optimizers are DeepSpeed's: each engine declares its tensors itself
            from lazyckpt.accelerate import _deepspeed

            self._deepspeed = _deepspeed.install(self._deepspeed, self.checkpointer.options, self.accelerator)
        else:
            self._track_new_optimizers()
        call = SaveStateCall(
            self,
            self.checkpointer,
            tag=self.accelerator.process_index,
            finisher=self._on_finisher,
            uploader=self._on_uploader,
            url=url,
            publish=None if prepare is None else producer_of(self.checkpointer).publish,
        )
        if prepare is not None:
            prepare(call)
        token = _compat.active_save.set(call)
        aborted = True
        try:
            location = stock(output_dir, safe_serialization=safe_serialization, **kwargs)
            aborted = False
        finally:
            _compat.active_save.reset(token)
            if self._deepspeed is not None and not aborted and call.folder is not None:
                from lazyckpt.accelerate import _deepspeed

                _deepspeed.attach(self._deepspeed, self.accelerator, call, call.folder)
            if call.folder is not None:
                sync, scan = stock_written_files(self.accelerator, call.folder)
                self._saves.add(call)
                call.finish(sync, scan, aborted)
            self.last_save_state_s = time.perf_counter() - t0
        return location, call

    def _load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        stock = self._patch.stock_load_state
        if self._removed:
            return stock(input_dir, load_kwargs=load_kwargs, **kwargs)
        url = _url.load_source(input_dir)
        if url is not None:
            with _url.downloaded(self.checkpointer, self._saves, url) as local:
                return stock(local, load_kwargs=load_kwargs, **kwargs)
        if self._levels is not None and input_dir is not None:
            self._levels.settle_folder(_compat.real_path(input_dir), self.load_timeout)
        folder = _load.folder_to_load(self.accelerator, self._saves, input_dir, self.load_timeout)
        return stock(folder, load_kwargs=load_kwargs, **kwargs)

    def _pre_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        call = _compat.active_save.get()
        if isinstance(call, SaveStateCall) and call.owner is self:
            call.begin(output_dir)

    # -- internals -----------------------------------------------------------------------------------
    def _on_finisher(self, job: Job) -> None:
        if not self._finisher.submit(job):  # after uninstall() (or no thread): inline
            job()

    def _on_uploader(self, job: Job) -> None:
        if not self._uploader.submit(job):
            job()

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
        for opt in _compat.prepared_optimizers(self.accelerator):
            inner = _compat.unwrap_optimizer(opt)
            if inner is not None and id(inner) not in self._tracked:
                self._tracked.add(id(inner))
                self._tracked_refs.append(inner)  # keep id() unique while tracked
                new.append(inner)
        if new:
            self.checkpointer.track(*new)

    def _raise_unreported(self) -> None:
        """Raise the first unreported error (the checkpointer's, then the levels')."""
        self._saves.prune()
        self.checkpointer.raise_errors()
        if self._levels is not None:
            raise_first(self._levels.take_errors())

    def _drain_before_shutdown(self) -> None:
        """Drain at the start of interpreter shutdown: uploads cannot run from an atexit hook (``core/exit.py``)."""
        if not self._exit_early:
            self._exit_early = True
            _exit.register(self, drain_at_exit, layer=_exit.INTEGRATION, early=True)


def _run(job: Job) -> None:
    job()
