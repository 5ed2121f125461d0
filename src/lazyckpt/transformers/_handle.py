"""The handle ``install()`` returns, and one checkpoint of the Trainer from its call to its commit.

The replaced ``_save_checkpoint`` runs stock's statements into a staging folder with the gate on
(``_compat.py``); once every lazy file is done, the commit thread renames it to ``checkpoint-N``, pushes and
rotates, in save order. ``_load_best_model`` and ``_finalize_training`` wait for all of it first.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lazyckpt.core import exit as _exit
from lazyckpt.core.installed import InstalledHandle, drain_at_exit
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker
from lazyckpt.transformers import _compat
from lazyckpt.transformers._folder import CheckpointSave, staging_name

if TYPE_CHECKING:
    from transformers import Trainer

    from lazyckpt import LazyCheckpointer
    from lazyckpt.deepspeed.installs import EngineInstalls
    from lazyckpt.transformers._levels import TrainerLevels

logger = logging.getLogger("lazyckpt.transformers")

_PATCHED = ("_save_checkpoint", "_load_best_model", "_finalize_training")


class Checkpoints:
    """lazyckpt's side of the trainer's checkpoints (called by :class:`SaveCheckpointMirror` in stock's order):
    staging folders, the saves not yet committed, and the commit thread."""

    def __init__(self, trainer: Trainer, checkpointer: LazyCheckpointer, levels: TrainerLevels | None) -> None:
        self.trainer = trainer
        self.checkpointer = checkpointer
        self.levels = levels
        self.last_save_s: float | None = None  # seconds the last _save_checkpoint call blocked training
        self.save_seconds: list[float] = []  # every call's
        self._saves: list[CheckpointSave] = []
        self._saved: set[str] = set()  # final names saved here (a best checkpoint may be one not committed yet)
        self.seq = itertools.count()  # save order (CheckpointSave.seq)
        self.published: dict[str, int] = {}  # final name -> seq of the save there (the commit thread's)
        self.durable = False  # saves are committed before _save_checkpoint returns (a preemption save)
        self._cleaned: set[str] = set()  # run folders whose dead processes' staging folders were removed
        self._warned_unrouted = False
        self._lock = reentry.Lock()
        self._committer: Worker[Callable[[], None]] = Worker("lazyckpt-transformers-commit", _run, lazy=True)
        self.deepspeed: EngineInstalls | None = None  # DeepSpeed's engine saves through lazyckpt.deepspeed

    # -- the mirror's calls, on the training thread --------------------------------------------------
    def before(self) -> None:
        """Raise an earlier checkpoint's failure; track the optimizer (its next ``step()`` waits for copies)."""
        self.prune()
        self.forward_level_errors()
        self.checkpointer.raise_errors()
        if getattr(self.trainer, "is_deepspeed_enabled", False):  # its engine declares what it saves itself
            from lazyckpt.deepspeed.installs import EngineInstalls

            self.deepspeed = self.deepspeed or EngineInstalls(self.checkpointer.options)
            self.deepspeed.ensure(self.trainer.model_wrapped)
            return
        opt = getattr(self.trainer, "optimizer", None)
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, torch.optim.Optimizer):
            self.checkpointer.track(inner)

    def start(self, run_dir: str, step: int) -> CheckpointSave | None:
        """The save of ``checkpoint-<step>`` (None when no level is due), its staging folder made. Collective
        in a distributed run."""
        from transformers.trainer import ParallelMode

        args = self.trainer.args
        final = os.path.join(run_dir, _compat.checkpoint_name(step))
        if self.levels is not None:
            at_level = self.levels.folder(step)
            if at_level is None:  # no level due at this step: nothing saved
                return None
            final, run_dir = at_level, os.path.dirname(at_level)
        distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
        writer = bool(args.should_save)
        staging = [staging_name(final) if args.process_index == 0 else None]
        if distributed:  # every process writes into the main process's staging folder
            torch.distributed.broadcast_object_list(staging, src=0)
        save = CheckpointSave(self, final, str(staging[0]), step=step, writer=writer, distributed=distributed)
        if writer and run_dir not in self._cleaned:  # a killed run's staging folders (dead pid, this host)
            self._cleaned.add(run_dir)
            _fs.cleanup_temporaries(run_dir)
        save.prepare()
        if distributed:
            torch.distributed.barrier()  # the staging folder exists before any process writes into it
        if writer and self.levels is not None:  # copied to the slower levels due once committed (from here on
            try:  # its commit must end, whatever happens: the level threads wait for it)
                self.levels.save(step, final, save.completion.handle)
            except BaseException:
                save.abort(self.commit)
                raise
        self._saved.add(final)
        return save

    def saved(self, final: str) -> bool:
        """Whether ``final`` was saved here (committed or not: stock's folder would exist by now)."""
        return final in self._saved

    def add_deepspeed_tag(self, save: CheckpointSave) -> None:
        """The folder's commit also waits for the tag DeepSpeed's engine saved into it (``global_stepN``): its
        files durable on every rank, then ``latest``. The tag is handed over at the next ``step()``, or by a wait."""
        if self.deepspeed is None or not save.writer:
            return
        handle = self.deepspeed.tag_handle(self.trainer.model_wrapped, save.staging)
        if handle is not None:
            save.handles.append(handle)

    def abort(self, save: CheckpointSave, error: BaseException) -> None:
        """Stock's statements raised ``error``: nothing is committed; DeepSpeed's open tag in the staging folder
        fails too (on every rank), and the folder is removed once it has ended."""
        try:
            if self.deepspeed is not None:
                self.deepspeed.abandon(self.trainer.model_wrapped, save.staging, error)
                self.add_deepspeed_tag(save)
        finally:  # (its commit must end whatever happens: a level thread may wait for it)
            save.abort(self.commit)

    def end(self, save: CheckpointSave, push: Callable[[], None] | None, best: str | None, t0: float) -> None:
        """Stock's statements ran: DeepSpeed's tag joins the folder; every process's files durable, then the
        commit, ``push`` and rotation queued on the commit thread (or the save aborted, if any of this raises)."""
        try:
            self.add_deepspeed_tag(save)
            if save.distributed:
                self._sync_own_files(save)
                torch.distributed.barrier()  # every process's files are durable in the staging folder
            if save.writer:
                self._check_routed(save)
                save.sync_stock_files()
                if push is not None:
                    save.after_commit.append(push)
                run_dir = save.run_dir
                if self.levels is not None:  # (the level runner copies and keeps, once the commit is done)
                    self.levels.best = best
                else:
                    limit = self.trainer.args.save_total_limit
                    save.after_commit.append(lambda: _rotate(run_dir, limit, best))
        except BaseException as exc:
            self.abort(save, exc)
            raise
        with self._lock:
            self._saves.append(save)
        save.finish(self.commit)
        self.last_save_s = time.perf_counter() - t0
        self.save_seconds.append(self.last_save_s)

    # -- the handle's calls --------------------------------------------------------------------------
    def commit(self, job: Callable[[], None]) -> None:
        if not self._committer.submit(job):  # after uninstall() (or no thread to be had): inline
            job()

    def pending(self) -> list[CheckpointSave]:
        """The saves not done yet. Takes no lock (``list()`` copies ``_saves`` in one step under the GIL, whatever
        the lock's holder is doing to it), so a signal handler that interrupted this thread may call it."""
        return [s for s in list(self._saves) if not s.done.is_set()]

    def prune(self) -> None:
        with self._lock:
            self._saves = [s for s in self._saves if not s.done.is_set()]

    def stop(self) -> None:
        self._committer.stop()

    def forward_level_errors(self) -> None:
        """The slower levels' failures, raised once by the checkpointer like the checkpoints' own."""
        for error in [] if self.levels is None else self.levels.take_errors():
            self.checkpointer.add_error(error)

    def _sync_own_files(self, save: CheckpointSave) -> None:
        """A non-writer: fsync its ``rng_state_<i>.pth`` before the barrier after which the folder is renamed."""
        if save.writer:
            return
        rank = self.trainer.args.process_index
        path = os.path.join(save.staging, f"rng_state_{rank}.pth")
        if self.checkpointer.fsync and os.path.exists(path):
            _fs.fsync_file(path)

    def _check_routed(self, save: CheckpointSave) -> None:
        if save.routed or self._warned_unrouted:
            return
        self._warned_unrouted = True
        logger.warning(
            "lazyckpt.transformers: %s was written without a single lazy file (the weights and optimizer state "
            "did not reach lazyckpt): this Trainer's save path differs from the one install() checked",
            save.final,
        )


class SaveCheckpointMirror:
    """Stock ``Trainer._save_checkpoint`` (``_compat.EXPECTED_SAVE_CHECKPOINT_CALLS``) writing a staging folder
    committed in the background. ``save_checkpoint`` is bound onto the trainer (``self`` is the trainer)."""

    def save_checkpoint(self: Any, model: Any, trial: Any, *, checkpoints: Checkpoints) -> None:
        if reentry.reentered():  # a signal handler interrupted lazyckpt on this thread: stock, at once
            reentry.count_synchronous()
            name = _compat.checkpoint_name(self.state.global_step)
            for pending in checkpoints.pending():
                if os.path.basename(pending.final) == name:
                    pending.supersede()
            token = _compat.active.set(None)
            try:
                return self._lazyckpt_handle.stock["_save_checkpoint"](model, trial)
            finally:
                _compat.active.reset(token)
        t0 = time.perf_counter()
        args = self.args  # (transformers' annotations of TrainerState are looser than its use: self is Any)
        checkpoints.before()
        from transformers.trainer import ExportableState, SaveStrategy

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        save = checkpoints.start(self._get_output_dir(trial=trial), self.state.global_step)
        if save is None:
            return
        token = _compat.active.set(save)
        try:
            self.save_model(save.staging, _internal_call=True)
            if args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and (
                self.state.best_global_step
            ):
                if save.distributed:
                    torch.distributed.barrier()
                best = os.path.join(save.run_dir, _compat.checkpoint_name(self.state.best_global_step))
                if os.path.exists(best) or checkpoints.saved(best):  # stock: saved, so its folder exists
                    self.state.best_model_checkpoint = best
            if not args.save_only_model:
                self._save_optimizer_and_scheduler(save.staging)
                self._save_scaler(save.staging)
                self._save_rng_state(save.staging)
            if args.should_save:
                for cb in [
                    c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)
                ]:
                    cb_name = cb.__class__.__name__
                    cb_state = cb.state()
                    if isinstance(self.state.stateful_callbacks[cb_name], list):
                        self.state.stateful_callbacks[cb_name].append(cb_state)
                    else:
                        self.state.stateful_callbacks[cb_name] = cb_state
                self.state.save_to_json(os.path.join(save.staging, _compat.TRAINER_STATE_NAME))
        except BaseException as exc:
            checkpoints.abort(save, exc)
            raise
        finally:
            _compat.active.reset(token)
        final = save.final
        push = (lambda: self._push_from_checkpoint(final)) if args.push_to_hub else None
        checkpoints.end(save, push, self.state.best_model_checkpoint, t0)
        if checkpoints.durable:  # a preemption save: committed under its name before this returns
            self._lazyckpt_handle.wait()


class TransformersHandle(InstalledHandle):
    """What :func:`lazyckpt.transformers.install` returns: ``wait()`` drains, ``uninstall()`` restores stock.
    Usable as a context manager (``uninstall()`` on exit).
    """

    def __init__(
        self, trainer: Trainer, checkpointer: LazyCheckpointer, owns: bool, levels: TrainerLevels | None = None
    ) -> None:
        self.trainer = trainer
        self.checkpointer = checkpointer
        self._owns = owns
        self._levels = levels
        self._checkpoints = Checkpoints(trainer, checkpointer, levels)
        self._removed = False
        self.stock = {name: getattr(trainer, name) for name in _PATCHED}
        self._previous = {name: vars(trainer)[name] for name in _PATCHED if name in vars(trainer)}
        _compat.acquire_gate()
        mirror = functools.partial(SaveCheckpointMirror.save_checkpoint, checkpoints=self._checkpoints)
        replacements = {"_save_checkpoint": types.MethodType(mirror, trainer), "_load_best_model": self._best_model}
        replacements["_finalize_training"] = self._finalize
        for name, method in replacements.items():
            setattr(trainer, name, method)
        trainer.__dict__["_lazyckpt_handle"] = self
        self._jit = _compat.jit_manager(trainer)
        if self._jit is not None:
            self._jit.execute_jit_checkpoint = functools.partial(
                _durable, self._checkpoints, self._jit.execute_jit_checkpoint
            )
        _exit.register(self, drain_at_exit, layer=_exit.INTEGRATION)

    @property
    def last_save_s(self) -> float | None:
        """Seconds the last ``_save_checkpoint`` call blocked training."""
        return self._checkpoints.last_save_s

    @property
    def save_seconds(self) -> list[float]:
        """Seconds each ``_save_checkpoint`` call blocked training."""
        return self._checkpoints.save_seconds

    # -- public --------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until every checkpoint saved so far is committed at its ``checkpoint-N`` name (and the
        rotation after it done); raise the first error nobody has seen. ``timeout``: seconds, then
        ``TimeoutError``."""
        if reentry.wait_refused("TransformersHandle.wait()"):
            return
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            if self._checkpoints.deepspeed is not None:  # open tags handed over, then published
                self._checkpoints.deepspeed.wait(left())
            self.checkpointer.wait(left())  # confirms this thread's copies, waits for the files
        finally:
            for save in self._checkpoints.pending():
                if not save.done.wait(left()):
                    raise TimeoutError(f"lazyckpt.transformers: {save.final} not committed after {timeout} s")
            if self._levels is not None:
                self._levels.drain(left())
        self._checkpoints.prune()
        self._checkpoints.forward_level_errors()
        self.checkpointer.raise_errors()

    def pending(self) -> int:
        """Checkpoints of this process saved but not committed yet."""
        return len(self._checkpoints.pending())

    def uninstall(self) -> None:
        """Drain pending checkpoints, then restore the trainer's stock methods (raises a drained error).
        Idempotent; also run on leaving ``with install(...)`` (interpreter exit only waits)."""
        if self._removed:
            return
        error: BaseException | None = None
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - raised after the undo
            error = exc
        finally:
            self._removed = True
            tr = self.trainer
            for name in _PATCHED:
                if name in self._previous:
                    setattr(tr, name, self._previous[name])
                else:
                    tr.__dict__.pop(name, None)
            tr.__dict__.pop("_lazyckpt_handle", None)
            if self._jit is not None:
                vars(self._jit).pop("execute_jit_checkpoint", None)
            _compat.release_gate()
            self._checkpoints.stop()
            if self._checkpoints.deepspeed is not None:
                try:
                    self._checkpoints.deepspeed.close()  # the engines get their previous checkpoint engine back
                except BaseException as exc:  # noqa: BLE001
                    error = error or exc
            if self._levels is not None:
                self._levels.close()
            _exit.unregister(self)
            if self._owns:
                try:
                    self.checkpointer.close()
                except BaseException as exc:  # noqa: BLE001
                    error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> TransformersHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- what the trainer calls ----------------------------------------------------------------------
    def _best_model(self) -> None:
        self.wait()  # the best checkpoint is committed before it is read
        self.stock["_load_best_model"]()

    def _finalize(self, *args: Any, **kwargs: Any) -> Any:
        # Stock reads and deletes checkpoint folders here: commit and rotate pending ones first.
        self.wait()
        from transformers.trainer import ParallelMode

        if self.trainer.args.parallel_mode == ParallelMode.DISTRIBUTED:
            torch.distributed.barrier()  # the main process's folders are committed before others read them
        return self.stock["_finalize_training"](*args, **kwargs)


def _durable(checkpoints: Checkpoints, call: Callable[[], Any]) -> Any:
    """``call()`` (the JIT checkpoint; the job dies next) with every checkpoint committed before
    ``_save_checkpoint`` returns."""
    checkpoints.durable = True
    try:
        return call()
    finally:
        checkpoints.durable = False


def _rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    import transformers.trainer as _trainer_module  # looked up at call time, as stock's own call is

    _trainer_module.rotate_checkpoints(
        output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True
    )


def _run(job: Callable[[], None]) -> None:
    job()
