"""``MultiLevelCheckpoint``: the Trainer's full state by level, through ``LazyCheckpointIO``.

Rank 0 saves ``<level>/step-<8 digits>.pt`` through a ``schedule.MultiLevel``; with a strategy that saves with
DCP, every rank saves ``<level>/step-<8 digits>/`` folders through a ``DistributedCheckpointer``. The callback
holds the levels and runs on the training thread; the plugin's ``PluginLevels`` owns the savers, whose threads
never touch the Trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lazyckpt.checkpointer import LazyCheckpointer, producer_of
from lazyckpt.core.handle import SaveHandle
from lazyckpt.core.report import raise_first
from lazyckpt.errors import LazyCkptError, LevelError, SaveRefusedError
from lazyckpt.levels import Level
from lazyckpt.lightning import _compat, _sharded
from lazyckpt.options import CheckpointerOptions
from lazyckpt.resume import Found, latest
from lazyckpt.schedule import MultiLevel, check_levels
from lazyckpt.threads import reentry

if TYPE_CHECKING:
    from lazyckpt.distributed import DistributedCheckpointer

__all__ = ["MultiLevelCheckpoint"]

log = logging.getLogger(__name__)


@runtime_checkable
class LevelsPlugin(Protocol):
    """What the callback needs of ``_runtime.PluginRuntime`` (not imported: no cycle)."""

    def start_save(self, checkpoint: dict[str, Any], path: str) -> SaveHandle: ...
    def open_checkpointer(self) -> LazyCheckpointer: ...
    def levels_saver(self, levels: tuple[Level, ...], replicate: bool = False) -> MultiLevel: ...
    def save_sharded_levels(
        self, strategy: Any, levels: tuple[Level, ...], checkpoint: dict[str, Any], step: int, due: list[int]
    ) -> SaveHandle: ...
    def settle_levels(self, timeout: float | None = None) -> None: ...
    def raise_errors(self) -> None: ...
    def wait(self, timeout: float | None = None) -> None: ...


class _PluginSaver:
    """The ``Saver`` of a plugin's ``MultiLevel``: source saves through the plugin's bookkeeping, the rest
    through its checkpointer."""

    def __init__(self, plugin: LevelsPlugin) -> None:
        self._plugin = plugin

    def save(self, obj: Any, path: str) -> SaveHandle:
        return self._plugin.start_save(obj, path)

    def raise_errors(self) -> None:
        self._plugin.open_checkpointer().raise_errors()

    def remove(self, path: str) -> Any:
        return self._plugin.open_checkpointer().remove(path)

    def reuse(self, path: str) -> bool:
        return producer_of(self._plugin.open_checkpointer()).reuse(path)

    def wait_staged(self, timeout: float | None = None) -> None:
        self._plugin.open_checkpointer().wait_staged(timeout)


class PluginLevels:
    """One plugin's multi-level savers, one per tuple of levels, made at first use: ``MultiLevel``s (rank 0's
    files) and, for DCP-saving strategies, ``DistributedCheckpointer``s (every rank's shards)."""

    def __init__(self) -> None:
        self._lock = reentry.Lock()
        self._savers: dict[tuple[Level, ...], MultiLevel] = {}
        self._sharded: dict[tuple[Level, ...], DistributedCheckpointer] = {}
        self._handles: list[SaveHandle] = []  # sharded saves, until seen done

    def _refuse_taken(self, levels: tuple[Level, ...]) -> None:
        taken = {lv.path for known in (*self._savers, *self._sharded) for lv in known}
        shared = sorted(taken & {lv.path for lv in levels})
        if shared:  # two savers' retention would delete each other's files
            raise ValueError(f"another MultiLevelCheckpoint of this Trainer already uses {', '.join(shared)}")

    def saver(self, plugin: LevelsPlugin, levels: tuple[Level, ...], replicate: bool = False) -> MultiLevel:
        """The saver of ``levels``, made at first use. ``replicate``: a level has ``replicas``; every rank
        calls this (collective)."""
        with self._lock:
            found = self._savers.get(levels)
            if found is not None:
                return found
            self._refuse_taken(levels)
        saver = _PluginSaver(plugin)
        options = plugin.open_checkpointer().options
        made = MultiLevel(saver, levels, options, reuse=saver.reuse, replicate=replicate)  # not under the lock
        with self._lock:
            self._savers[levels] = made
        return made

    def save_sharded(
        self, options: CheckpointerOptions, strategy: Any, levels: tuple[Level, ...], checkpoint: dict[str, Any],
        step: int, due: list[int],
    ) -> SaveHandle:  # fmt: skip
        """Collective (every rank): the checkpoint laid out as the strategy's ``save_checkpoint`` does
        (``_sharded.convert``), saved to the ``due`` levels."""
        key = _sharded.sharded_state_key(strategy)
        assert key is not None
        converted, extra = _sharded.convert(checkpoint, key, strategy.global_rank == 0)
        handle = self._distributed(options, levels).save(converted, step=step, due=due, extra_files=extra)
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]
        return handle

    def _distributed(self, options: CheckpointerOptions, levels: tuple[Level, ...]) -> DistributedCheckpointer:
        with self._lock:
            found = self._sharded.get(levels)
            if found is not None:
                return found
            self._refuse_taken(levels)  # alike on every rank: the same callbacks
        from lazyckpt.distributed import DistributedCheckpointer

        made = DistributedCheckpointer(options, levels=levels)  # collective: not under the lock
        with self._lock:
            self._sharded[levels] = made
        return made

    def drain(self, timeout: float | None = None) -> None:
        """Every multi-level save done at every level (its source saves confirmed on this thread).
        Sharded saves commit once every rank confirmed its files: call it on every rank."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            savers, handles = list(self._savers.values()), list(self._handles)
        for saver in savers:
            saver.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for handle in handles:  # confirms this rank's files, then waits; the errors stay in the ledger
            if not handle.wait_done(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the multi-level save of {handle.path} not done after {timeout} s")

    def raise_errors(self) -> None:
        """Raise the oldest unseen level error (``LevelError`` naming the level), once; then a
        sharded saver's (``DistributedLevelError``), without waiting."""
        with self._lock:
            savers, sharded = list(self._savers.values()), list(self._sharded.values())
        raise_first([err for saver in savers for err in saver.take_errors()])
        for ckpt in sharded:
            ckpt.raise_errors()

    def close(self) -> None:
        with self._lock:
            savers, self._savers = list(self._savers.values()), {}
            sharded, self._sharded, self._handles = list(self._sharded.values()), {}, []
        for saver in savers:
            saver.close()
        for ckpt in sharded:
            try:
                ckpt.close()  # drained by drain(); an error seen only now is logged (close must not fail)
            except LazyCkptError as exc:
                log.error("lazyckpt: closing a multi-level sharded checkpointer: %s", exc)


_Callback: Any = _compat.callback_base()


class MultiLevelCheckpoint(_Callback):
    """Checkpoint the Trainer's full state by level, at the end of each batch whose optimizer steps reach
    a multiple of a level's ``every``.

    Args:
        levels: ``lazyckpt.Level``s, fastest first. A level's ``every`` counts optimizer steps
            (``trainer.global_step``); each multiple passed counts once.
        resume: ``True``: ``fit`` (given no ``ckpt_path``) resumes from the newest step the ranks agree on,
            found at ``setup`` by ``lazyckpt.latest(levels)`` (collective); ``resumed_from`` is that
            ``Found``, or None (a fresh start). A ``ckpt_path`` given to ``fit`` wins. Strategies that
            restore after their setup (ModelParallel, FSDP) raise ``ValueError`` at ``setup``: pass
            ``ckpt_path=lazyckpt.latest(levels).path`` there.

    Needs ``Trainer(plugins=[LazyCheckpointIO()])``; ``fit`` raises ``TypeError`` otherwise and
    ``SaveRefusedError`` with DeepSpeed. Saves only inside ``fit``, each step at most once. Errors
    (``LevelError``; ``DistributedLevelError`` with a sharded strategy) are raised once from ``fit``, at
    a later due step or at its end, on every rank together. ``last_handle`` (rank 0; every rank when
    sharded): the newest save's handle. A level with ``replicas`` under DDP: every rank builds the
    saver at ``setup`` (collective; rank 0 still saves alone).
    """

    def __init__(self, levels: Sequence[Level], resume: bool = False) -> None:
        super().__init__()
        self.levels = tuple(levels)
        check_levels(self.levels)
        if len({lv.path for lv in self.levels}) != len(self.levels):
            raise ValueError("two levels share a path; give each level its own folder")
        self.resume = bool(resume)
        self.resumed_from: Found | None = None
        self.last_handle: SaveHandle | None = None
        self._io: LevelsPlugin | None = None
        self._seen: int | None = None  # the global step of the last batch end looked at
        self._sharded = False  # the strategy saves with DCP: every rank saves its shards
        self._loading: str | None = None  # the path this fit loaded at setup, until the Trainer restored it

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the Trainer: the levels only
        return {"levels": self.levels, "resume": self.resume, "resumed_from": None, "last_handle": None,
                "_io": None, "_seen": None, "_sharded": False, "_loading": None}  # fmt: skip

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._io = _runtime_of(trainer) if stage == "fit" else None
        self._sharded = self._io is not None and _sharded.sharded_state_key(trainer.strategy) is not None
        if self._io is not None and self.resume:
            self._resume(trainer)
        if self._io is not None and not self._sharded and any(lv.replicas for lv in self.levels):
            # replicas: every rank builds the saver now (collective; the process group is up)
            self._io.levels_saver(self.levels, replicate=True)

    def _resume(self, trainer: Any) -> None:
        """``resume=True``: the ranks agree on the newest loadable step; the Trainer then restores it."""
        if self._sharded or getattr(trainer.strategy, "restore_checkpoint_after_setup", False):
            raise ValueError(
                f"MultiLevelCheckpoint(resume=True) with {type(trainer.strategy).__name__}: its restore loads "
                "into the set-up model, after this callback's setup; pass "
                "fit(ckpt_path=lazyckpt.latest(levels).path) instead (called on every rank)"
            )
        collective = int(getattr(trainer, "world_size", 1)) > 1  # every rank runs setup: all agree on one step
        found = latest(list(self.levels), preload=False, collective=collective)
        self.resumed_from = found
        if found is not None:
            log.info("lazyckpt: resuming from step %d of level %d (%s)", found.step, found.level, found.path)
            _compat.load_before_restore(trainer, found.path)
            self._loading = found.path

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        given = getattr(trainer, "ckpt_path", None)
        if self.resumed_from is not None and given is not None and str(given) != self.resumed_from.path:
            log.warning(
                "lazyckpt: fit(ckpt_path=%s) was restored, not step %d of the levels that resume=True found",
                given, self.resumed_from.step,
            )  # fmt: skip

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Forget this fit's own load if it raised before the Trainer restored it, so a later ``fit`` or
        ``validate`` on this Trainer does not restore it (no collective)."""
        loading, self._loading = self._loading, None
        if loading is not None:
            _compat.forget_loaded(trainer, loading)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._loading = None  # the Trainer restored it and ended the resume (resume_end) before this hook
        self._seen = trainer.global_step  # a resumed fit does not save the step it resumed from again

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        io, step, prev = self._io, trainer.global_step, self._seen
        self._seen = step
        if io is None or prev is None or step <= prev:
            return  # no optimizer step since the last batch end (accumulating), or not in fit
        due = [i for i, lv in enumerate(self.levels) if step // lv.every > prev // lv.every]
        if not due:
            return
        checkpoint = _compat.dump_checkpoint(trainer)  # every rank, as trainer.save_checkpoint does
        error = None
        if self._sharded or trainer.is_global_zero:  # else only rank 0 saves (full state, as the strategy)
            try:
                if self._sharded:  # every rank its shards: one collective save
                    self.last_handle = io.save_sharded_levels(trainer.strategy, self.levels, checkpoint, step, due)
                else:
                    self.last_handle = io.levels_saver(self.levels).save(checkpoint, step, due=due)
                log.debug("lazyckpt: step %d handed to levels %s", step, due)
                io.raise_errors()  # an earlier save's level error, once; this step is already on its way
            except Exception as exc:
                error = exc
        _raise_together(trainer, error, io if self._sharded else None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0 (every rank when sharded) makes every save durable; the ranks leave together and raise
        an error together."""
        error = None
        if self._io is not None and (trainer.is_global_zero or self._sharded):
            try:
                self._io.wait()  # every save of the plugin durable, its errors raised
            except Exception as exc:
                error = exc
        _raise_together(trainer, error)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._io = None  # the plugin's teardown (strategy teardown, just before) drained the saves


def _raise_together(trainer: Any, error: Exception | None, sharded: LevelsPlugin | None = None) -> None:
    """Raise an error on every rank at this point, or on none (a rank raising alone would hang the others).
    Collective in a distributed run. With ``sharded``, every rank settles its level saves first; a rank
    without an error of its own raises a copy of the lowest failing rank's."""
    if getattr(trainer, "world_size", 1) > 1 and trainer.strategy.reduce_boolean_decision(error is not None, all=False):
        if sharded is not None:
            sharded.settle_levels()
            if error is None:
                try:
                    sharded.raise_errors()
                except Exception as exc:
                    error = exc
        lowest = _from_other_rank(None if error is None else _describe(error))  # every rank: a collective
        error = error or lowest
    if error is not None:
        raise error


def _from_other_rank(mine: dict[str, Any] | None) -> Exception:
    """Collective: the lowest failing rank's error, rebuilt on this rank."""
    import torch.distributed as dist

    described: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(described, mine)
    rank, info = next(((r, d) for r, d in enumerate(described) if d is not None), (0, None))
    return _rebuild(rank, info)


def _describe(error: Exception) -> dict[str, Any]:
    fields = {k: getattr(error, k, None) for k in ("level", "level_path", "step", "path", "errno")}
    return {"message": str(error), "is_level_error": isinstance(error, LevelError), **fields}


def _rebuild(rank: int, described: dict[str, Any] | None) -> Exception:
    """Another rank's view of ``rank``'s error: a ``LevelError`` with the same fields, or a ``LazyCkptError``."""
    info = described or {"message": "unknown error", "is_level_error": False}
    message = f"lazyckpt: global rank {rank}'s multi-level checkpoint failed: {info['message']}"
    if not info["is_level_error"]:
        return LazyCkptError(message)
    return LevelError(message, info["level"], info["level_path"], info["step"], info["path"], errno=info["errno"])


def _runtime_of(trainer: Any) -> LevelsPlugin:
    """The runtime of the Trainer's ``LazyCheckpointIO``; ``TypeError`` without one, ``SaveRefusedError``
    for a strategy it cannot serve."""
    strategy = trainer.strategy
    io = getattr(strategy, "checkpoint_io", None)
    runtime = _compat.runtime_of(io)
    if not isinstance(runtime, LevelsPlugin):
        raise TypeError(
            "MultiLevelCheckpoint saves through lazyckpt.lightning.LazyCheckpointIO, but this Trainer's "
            f"checkpoint_io is {type(io).__name__}. Give the Trainer the plugin too: "
            "Trainer(plugins=[LazyCheckpointIO()], callbacks=[MultiLevelCheckpoint(levels)])."
        )
    reason = _compat.bypass_reason(strategy)
    if reason is not None and _sharded.sharded_state_key(strategy) is None:
        raise SaveRefusedError(
            f"MultiLevelCheckpoint cannot save with {type(strategy).__name__}: {reason}. Use "
            "ModelParallelStrategy, FSDPStrategy(state_dict_type='sharded'), a DDP or a single-device strategy."
        )
    return runtime
