"""The runtime of one ``LazyCheckpointIO``: its checkpointer, its pending saves, the Trainer it serves.

What the step hook, the patches, ``MultiLevelCheckpoint`` and the sharded strategies call on a plugin lives
here (found with ``_compat.runtime_of(plugin)``). Called from the training thread; completions arrive on
lazyckpt's threads and touch only the bookkeeping under ``_lock``. Loggers, callbacks and the Trainer are
touched from the training thread only.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lazyckpt import CheckpointerOptions, LazyCheckpointer, SaveHandle, SaveStats
from lazyckpt.core import exit as _exit
from lazyckpt.core import guard as _guard
from lazyckpt.errors import LazyCkptError, SaveRefusedError, StaleTensorError
from lazyckpt.levels import Level
from lazyckpt.lightning import _compat, _levels, _sharded
from lazyckpt.schedule import MultiLevel
from lazyckpt.threads import reentry

log = logging.getLogger("lazyckpt.lightning")


@dataclass
class _Save:
    """One save_checkpoint call: durable once ``done`` resolves (after the upload for a URL)."""

    key: str  # absolute local path, or the URL as given
    handle: SaveHandle
    step: int | None
    done: Future = field(default_factory=Future)  # finished (errors go to the core's ledger, not here)


_STALE_NOTE = (
    "lazyckpt.lightning: a tensor of this checkpoint was changed in place outside optimizer.step() "
    "before its host copy was done, so the save was abandoned instead of writing a mixed state. Code "
    "that edits parameters or optimizer state in place between a save and the next step (weight swaps, "
    "manual clamping, custom callbacks) must call `LazyCheckpointIO.wait_staged()` first."
)


class PluginRuntime:
    """One plugin's runtime (module docstring). Holds the plugin by weak reference: the plugin owns it."""

    def __init__(
        self,
        plugin: Any,
        options: CheckpointerOptions,
        log_stats: bool,
        user_checkpointer: LazyCheckpointer | None,
    ) -> None:
        self._plugin = weakref.ref(plugin)
        self._options = options
        self._log_stats = log_stats
        self._user_checkpointer = user_checkpointer
        self.ckpt: LazyCheckpointer | None = user_checkpointer
        self._lock = reentry.Lock()
        self._saves: list[_Save] = []  # not yet reported to the caller, in save order
        self._finished: list[tuple[_Save, SaveStats]] = []  # stats not yet sent to loggers
        self.stats: list[SaveStats] = []  # every completed save of this plugin, in completion order
        self._strategy_ref: weakref.ref | None = None
        self._trainer_ref: weakref.ref | None = None
        self._patched: list[tuple[object, str]] = []
        self._warned_bypass = False
        self.torn_down = False  # set by teardown, cleared by the next optimizer step
        self._attach_tries = 0
        self.sharded: _sharded.ShardedSaves | None = None  # ModelParallelStrategy / sharded FSDP saves
        self._sharded_seen: weakref.ref | None = None  # the last strategy the step hook looked at
        self._levels = _levels.PluginLevels()  # MultiLevelCheckpoint's savers
        _compat.runtimes[plugin] = self
        _compat.install_step_hook()
        _exit.register(self, _drain_at_exit, layer=_exit.INTEGRATION)

    # -- saves -------------------------------------------------------------------------------------

    def open_checkpointer(self) -> LazyCheckpointer:
        """The plugin's checkpointer, created at the first call (closed at teardown)."""
        if self.ckpt is None:
            self.ckpt = LazyCheckpointer(self._options)
        return self.ckpt

    def start_save(self, checkpoint: dict[str, Any], path: str) -> SaveHandle:
        """The source save of a ``MultiLevelCheckpoint`` step inside a running fit; returns its handle."""
        return self.start(checkpoint, path, self.attach()).handle

    def start(self, checkpoint: dict[str, Any], path: Any, trainer: Any) -> _Save:
        self._report_stats()
        key, is_url = _compat.split_path(path)
        if not is_url:
            os.makedirs(os.path.dirname(key), exist_ok=True)
        handle = self.open_checkpointer().save(checkpoint, key)  # a URL: local tier, then upload (core)
        record = _Save(key=key, handle=handle, step=getattr(trainer, "global_step", None))
        with self._lock:
            self._saves.append(record)
        handle.add_done_callback(lambda h: self._on_committed(record, h))
        return record

    def save_sharded(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any, key: str) -> None:
        """The sharded strategy's replaced ``save_checkpoint``: one collective save."""
        if self.sharded is None:
            self.sharded = _sharded.ShardedSaves(self._options)
        self.sharded.save(strategy, checkpoint, filepath, key)

    def _on_committed(self, record: _Save, handle: SaveHandle) -> None:
        """On a lazyckpt thread, once the file is committed (a URL: uploaded) or the save failed."""
        stats = handle.stats
        if handle.exception() is not None or stats is None:  # the core reports it, once
            record.done.set_result(None)
            return
        with self._lock:
            self._finished.append((record, stats))
            self.stats.append(stats)
        if stats.skipped:
            log.warning("lazyckpt: save to %s was skipped (on_backpressure='skip'): no file written", record.key)
        log.debug(
            "lazyckpt: %s committed: stall %.3fs (in save %.3fs, step waited %.3fs), staged %.3fs, "
            "write %.3fs at %.2f GB/s, %d bytes",
            stats.path,
            stats.blocked_s + stats.guard_wait_s,
            stats.blocked_s,
            stats.guard_wait_s,
            stats.staged_s,
            stats.write_s,
            stats.write_gbps,
            stats.bytes,
        )
        record.done.set_result(None)

    # -- levels ------------------------------------------------------------------------------------

    def levels_saver(self, levels: tuple[Level, ...], replicate: bool = False) -> MultiLevel:
        """The multi-level saver for ``levels`` over this plugin's saves; drained by ``wait``/teardown."""
        return self._levels.saver(self, levels, replicate)

    def save_sharded_levels(
        self, strategy: Any, levels: tuple[Level, ...], checkpoint: dict[str, Any], step: int, due: list[int]
    ) -> SaveHandle:
        """Collective (every rank): the step's shards to its ``due`` levels, for strategies that save with
        DCP; drained by ``wait``/teardown."""
        return self._levels.save_sharded(self._options, strategy, levels, checkpoint, step, due)

    def settle_levels(self, timeout: float | None = None) -> None:
        """Every multi-level save of this rank over; errors left for ``raise_errors``."""
        self._levels.drain(timeout)

    # -- waits -------------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        self.drain(raise_errors=True, timeout=timeout)

    def wait_staged(self, timeout: float | None = None) -> None:
        if self.ckpt is not None:
            self.ckpt.wait_staged(timeout)

    def pending_paths(self) -> set[str]:
        sharded = self.sharded.pending_paths() if self.sharded is not None else set()
        with self._lock:
            return {r.key for r in self._saves if not r.done.done()} | sharded

    def wait_path(self, key: str) -> None:
        """Block until pending saves to ``key`` (absolute path or URL) are durable; raise an unseen error."""
        pending = self._pending_for(key)
        if pending:
            self.wait_for(pending)

    def _pending_for(self, key: str) -> list[_Save]:
        with self._lock:
            return [r for r in self._saves if r.key == key and not r.done.done()]

    def wait_for(self, records: list[_Save], deadline: float | None = None) -> None:
        for record in records:
            # This thread must confirm its own copies (core/guard.py) or it waits for itself;
            # ``exception`` confirms without claiming the error (the ledger reports it).
            record.handle.exception(None if deadline is None else _left(deadline))
            record.done.result(None if deadline is None else _left(deadline))  # our callback ran
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise the oldest unseen background error (a save's, then a level copy's)."""
        try:
            if self.ckpt is not None:
                self.ckpt.raise_errors()
        except StaleTensorError as exc:
            _explain(exc)
            raise
        self._levels.raise_errors()

    def drain(self, raise_errors: bool, timeout: float | None = None, *, loggers_open: bool = False) -> None:
        """Make every pending save durable; its error raised (``raise_errors``) or logged.
        ``loggers_open``: the Trainer's loggers take stats although it no longer runs (their ``finalize``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        error: BaseException | None = None
        try:
            # levels first: their retention removes through the checkpointer below
            self._levels.drain(timeout)
            if self.sharded is not None:
                self.sharded.wait(timeout)
            if self.ckpt is not None:  # saves durable, deletes done; raises the first unseen error
                self.ckpt.wait(timeout)
            with self._lock:
                records = list(self._saves)
            self.wait_for(records, deadline)  # uploads, and their errors
        except TimeoutError:
            raise
        except BaseException as exc:
            error = exc
        self._report_stats(loggers_open)
        with self._lock:
            self._saves = [r for r in self._saves if not r.done.done()]
        if error is None:
            return
        if isinstance(error, StaleTensorError):
            _explain(error)
        if raise_errors:
            raise error
        log.error("lazyckpt: background save failed: %s", error, exc_info=error)

    # -- lifecycle ---------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Drain (errors raised unless an exception propagates), unpatch, release resources."""
        handling = sys.exc_info()[1]
        try:
            self.drain(raise_errors=handling is None)
        finally:
            self._unpatch()
            self._trainer_ref = self._strategy_ref = self._sharded_seen = None
            self.torn_down = True
            self._attach_tries = 0
            self.release_resources()

    def outside_fit(self, trainer: Any) -> bool:
        """True unless this save comes from a running ``fit`` of a Trainer, or from Fabric."""
        if self.torn_down:
            return True
        if trainer is not None:
            return not (_compat.in_fit(trainer) and _compat.is_running(trainer))
        # No Trainer: Fabric (saves stay lazy), or a Trainer's strategy before fit.
        strategy = self._strategy_ref() if self._strategy_ref is not None else None
        return strategy is not None and _compat.is_trainer_strategy(strategy)

    def release_resources(self) -> None:
        sharded, self.sharded = self.sharded, None
        if sharded is not None:
            try:
                sharded.close()  # drained by drain(): raises nothing new
            except LazyCkptError as exc:
                log.error("lazyckpt: closing the sharded checkpointer: %s", exc)
        self._levels.close()  # drained by drain(); its copies feed on the checkpointer below
        if self.ckpt is not None and self._user_checkpointer is None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()

    # -- telemetry ---------------------------------------------------------------------------------

    def _report_stats(self, loggers_open: bool = False) -> None:
        """Send finished saves' timings to the Trainer's loggers (training thread only), only while they
        are open: a logger written to after its ``finalize`` reopens. ``loggers_open``: called from their
        ``finalize``."""
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if not loggers_open and not self.torn_down and _compat.is_interrupted(trainer):
            return  # a failing fit: kept for the loggers' finalize, which Lightning calls next
        with self._lock:
            finished, self._finished = self._finished, []
        if not finished or not self._log_stats or trainer is None or not getattr(trainer, "is_global_zero", True):
            return
        if not (loggers_open or _compat.is_running(trainer)):
            return  # the stage is over: its loggers are finalized
        for record, stats in finished:
            _compat.log_save_stats(trainer, stats, record.step)

    # -- finding and adapting the Trainer ----------------------------------------------------------

    def on_optimizer_step(self) -> None:
        """The optimizer-step hook, every step: finds the Trainer early and routes sharded saves."""
        self.torn_down = False
        if self._strategy_ref is None and self._attach_tries < 3:
            self._attach_tries += 1
            self.attach()
        self._install_sharded()

    def attach(self) -> Any:
        """Find the strategy/Trainer calling the plugin; adapt them once. Returns the Trainer or None.
        Call it straight from the plugin's methods or the step hook (the warning's stacklevel)."""
        plugin = self._plugin()
        strategy = None if plugin is None else _compat.find_strategy(plugin)
        current = self._strategy_ref() if self._strategy_ref is not None else None
        known = self._trainer_ref() if self._trainer_ref is not None else None
        if strategy is None or (strategy is current and (known is not None or _compat.trainer_of(strategy) is None)):
            return known  # (a strategy seen before its module was attached is looked at again)
        self._strategy_ref = weakref.ref(strategy)
        reason = None if _sharded.sharded_state_key(strategy) else _compat.bypass_reason(strategy)
        if reason and "DeepSpeedStrategy" in _compat.mro_names(strategy):  # never silently stock
            raise SaveRefusedError(
                f"LazyCheckpointIO cannot make this strategy's saves lazy: {reason}. Remove the plugin and call "
                "lazyckpt.deepspeed.install(trainer.strategy.deepspeed_engine) on every rank (e.g. in a "
                "Callback's on_fit_start) instead"
            )
        if reason and not self._warned_bypass:
            self._warned_bypass = True
            warnings.warn(
                f"LazyCheckpointIO has no effect on saving with this strategy: {reason} and never calls "
                "CheckpointIO.save_checkpoint (checkpoints are written synchronously by that strategy). "
                "Use FSDPStrategy(state_dict_type='full') or a DDP/single-device strategy for lazy saves.",
                stacklevel=3,
            )
        trainer = _compat.trainer_of(strategy)
        if trainer is None:
            self._trainer_ref = None
            return None
        self._unpatch()
        self._trainer_ref = weakref.ref(trainer)
        self._adapt(trainer)
        return trainer

    def _adapt(self, trainer: Any) -> None:
        if trainer.is_global_zero:  # other ranks never save: no waiting
            for opt in getattr(trainer, "optimizers", ()):
                _guard.track(opt)  # not through a checkpointer: loading alone must start no thread
        for obj, attr, replacement in _compat.adaptations(trainer, weakref.ref(self)):
            self._patch(obj, attr, replacement)

    def _install_sharded(self) -> None:
        """Route a DCP-saving strategy's saves through ``_sharded.py``. Only from the step hook (every
        rank switches at the same step), never from a rank-0-only call."""
        seen = self._sharded_seen() if self._sharded_seen is not None else None
        if seen is not None and (_sharded.sharded_state_key(seen) is None or "save_checkpoint" in vars(seen)):
            return  # nothing to do, or already installed
        # the strategy attach() found: never search the frames at every step
        strategy = self._strategy_ref() if self._strategy_ref is not None else None
        if strategy is None:
            return
        self._sharded_seen = weakref.ref(strategy)
        key = _sharded.sharded_state_key(strategy)
        if key is not None:
            for name, method in _sharded.strategy_patches(strategy, weakref.ref(self), key).items():
                self._patch(strategy, name, method)

    def _patch(self, obj: object, attr: str, replacement: Callable[..., Any]) -> None:
        if attr in vars(obj):  # already adapted (by this or another plugin): leave it
            return
        setattr(obj, attr, replacement)
        self._patched.append((obj, attr))

    def _unpatch(self) -> None:
        for obj, attr in self._patched:
            vars(obj).pop(attr, None)
        self._patched = []


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _explain(exc: BaseException) -> None:
    if hasattr(exc, "add_note") and _STALE_NOTE not in getattr(exc, "__notes__", ()):  # Python >= 3.11
        exc.add_note(_STALE_NOTE)


def _drain_at_exit(runtime: PluginRuntime) -> None:
    try:
        runtime.drain(raise_errors=False)
    except BaseException as exc:  # never raise from an atexit handler
        log.error("lazyckpt: draining pending checkpoints at exit failed: %s", exc)
