"""Lazy checkpoints for DeepSpeed engines (ZeRO 0-3), in DeepSpeed's own tag folders.

``install(engine)`` puts a :class:`LazyCheckpointEngine` on the engine: ``save_checkpoint`` returns once the
non-tensor state is pickled, the tensors are copied in the background, the next ``step()`` waits only for
those copies, and the tag folder appears whole (every rank's files durable) before ``latest`` names it.
Modules: ``_engine`` (the engine and its commit thread), ``_levels`` (levels: routing, copies to slower levels,
retention, ``latest``), ``installs`` (``EngineInstalls``: the engines Accelerate's
and the transformers integrations install). The core never imports DeepSpeed.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

from lazyckpt.cluster import StoreExchange
from lazyckpt.core.installed import InstalledHandle
from lazyckpt.deepspeed import _levels
from lazyckpt.deepspeed._engine import LazyCheckpointEngine, publish_pending
from lazyckpt.deepspeed._levels import SCRIPTS, DeepSpeedLevels
from lazyckpt.errors import SaveRefusedError
from lazyckpt.levels import Level
from lazyckpt.options import CheckpointerOptions
from lazyckpt.recovery import Found
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

logger = logging.getLogger("lazyckpt.deepspeed")

__all__ = ["DeepSpeedHandle", "LazyCheckpointEngine", "install", "latest"]

_RECOVERY_SCRIPT = "_copy_recovery_script"  # DeepSpeedEngine's method copying zero_to_fp32.py into save_dir


class DeepSpeedHandle(InstalledHandle):
    """What :func:`install` returns: ``wait()`` publishes every pending tag (raising a failed one's error once),
    ``uninstall()`` waits, then gives the engine back its previous checkpoint engine. A context manager."""

    def __init__(self, engine: Any, lazy: LazyCheckpointEngine, previous: Any) -> None:
        self.engine = engine
        self.checkpoint_engine = lazy
        #: Called with ``save_dir`` as each ``save_checkpoint`` starts (integrations mark their folder first).
        self.before_save: list[Callable[[str], None]] = []
        self._previous = previous
        stock_load, stock_save = type(engine).load_checkpoint, type(engine).save_checkpoint

        def load_checkpoint(this: Any, *args: Any, **kwargs: Any) -> Any:
            if reentry.reentered():  # a signal handler that interrupted lazyckpt: stock's, waiting for nothing
                return stock_load(this, *args, **kwargs)
            lazy.wait()  # DeepSpeed reads ``latest`` before it reads any file: publish pending tags first
            load_dir = args[0] if args else kwargs.get("load_dir")
            if load_dir is not None:  # and those another engine of this process saves there
                publish_pending(os.fspath(load_dir))
            return stock_load(this, *args, **kwargs)

        def save_checkpoint(this: Any, *args: Any, **kwargs: Any) -> Any:
            save_dir = args[0] if args else kwargs.get("save_dir")
            if not save_dir:  # stock's ValueError
                return stock_save(this, *args, **kwargs)
            save_dir = os.fspath(save_dir)
            due: list[int] = []
            if lazy.levels is not None:  # into the fastest level due (from a signal handler: the fastest level)
                due = [0] if reentry.reentered() else lazy.levels.due(int(this.global_steps))
                if not due:  # as a bare save_state with levels: nothing is saved at this step
                    lazy.raise_errors()
                    logger.debug("lazyckpt.deepspeed: no level is due at step %d: nothing saved", this.global_steps)
                    return True
                save_dir = os.path.abspath(lazy.levels.levels[due[0]].path)
                if args:
                    args = (save_dir, *args[1:])
                else:
                    kwargs = {**kwargs, "save_dir": save_dir}
            if reentry.reentered():  # from a signal handler that interrupted lazyckpt: stock's engine, at once
                tag = args[1] if len(args) > 1 else kwargs.get("tag")
                lazy.supersede(os.path.join(os.path.abspath(save_dir), str(tag or _levels.tag_name(this.global_steps))))
                if lazy.levels is not None:  # this run's step there: retention never takes it for an earlier run's
                    lazy.levels.saved_synchronously(int(this.global_steps))
                reentry.count_synchronous()
                this.checkpoint_engine = previous
                try:
                    return stock_save(this, *args, **kwargs)
                finally:
                    this.checkpoint_engine = lazy
            for hook in list(self.before_save):
                hook(save_dir)
            with lazy.saving():  # a save that raises fails its tag on every rank, never published later
                if due and lazy.levels is not None:  # (places in the slower levels' backlogs first: may wait)
                    lazy.route(due[0], int(this.global_steps), lazy.levels.admit(int(this.global_steps), due[1:]))
                saved = stock_save(this, *args, **kwargs)
            if not lazy.stepped:  # no step() yet would commit it (an export, a conversion): written now, as stock
                lazy.wait()
            return saved

        engine.load_checkpoint = types.MethodType(load_checkpoint, engine)
        engine.save_checkpoint = types.MethodType(save_checkpoint, engine)
        # DeepSpeed copies zero_to_fp32.py into save_dir inside every save (rank 0): on the commit thread instead,
        # once this rank's files are durable (a truncating copy would wait there for the journal behind them).
        copy_script = getattr(type(engine), _RECOVERY_SCRIPT, None)  # a private method: absent, stock copies
        if copy_script is not None:

            def copy_recovery_script(this: Any, save_path: str) -> None:
                lazy.defer(functools.partial(_copy_durably, copy_script, this, save_path, lazy.checkpointer.fsync))

            setattr(engine, _RECOVERY_SCRIPT, types.MethodType(copy_recovery_script, engine))
        engine.checkpoint_engine = lazy  # the engine drains itself at exit (``_engine._drain_at_exit``)

    def wait(self, timeout: float | None = None) -> None:
        if reentry.wait_refused("DeepSpeedHandle.wait()"):
            return
        self.checkpoint_engine.wait(timeout)
        levels = self.checkpoint_engine.levels
        replicator = None if levels is None else levels.replicator
        if replicator is not None and not replicator.drain(timeout):  # each transfer bounded by its group's timeout
            raise TimeoutError(f"lazyckpt.deepspeed: the replicas are still being sent after {timeout} s")

    def uninstall(self) -> None:
        if self._removed:
            return
        try:
            self.checkpoint_engine.close()
        finally:
            self._removed = True
            for name in ("load_checkpoint", "save_checkpoint", _RECOVERY_SCRIPT):
                vars(self.engine).pop(name, None)
            self.engine.checkpoint_engine = self._previous

    def __enter__(self) -> DeepSpeedHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(
    engine: Any,
    levels: Sequence[Level] | None = None,
    options: CheckpointerOptions | None = None,
    *,
    commit_timeout: float = 600.0,
    **core_options: Any,
) -> DeepSpeedHandle:
    """Make ``engine.save_checkpoint`` lazy on this rank; call it on every rank, after ``deepspeed.initialize``.

    Same tag folders, file names and tensors as stock; ``latest`` is written by lazyckpt once the tag folder
    is in place on every rank's behalf. ``options`` / ``core_options``: the core's; ``commit_timeout``: as for
    :class:`LazyCheckpointEngine`. A config-made decoupled engine in place is flushed first. A save before the
    engine's first ``step()`` since install (an export, a conversion) is published before it returns, as stock.

    ``levels``: each a DeepSpeed ``save_dir``, one folder every rank shares or node-local (each node its own
    folder: the engine needs ``"checkpoint": {"use_node_local_storage": true}``); a ``save_checkpoint`` at step
    ``engine.global_steps`` goes to the fastest level due (its ``save_dir`` argument is then not used; none
    due: nothing is saved), each slower level due gets a copy of the tag once it is published there, then its
    own ``latest``; each level keeps its newest ``keep`` tags. A slower level's failure raises
    ``DistributedLevelError`` once on every rank, the faster levels unaffected. ``install`` is then a
    collective (it probes the folders).

    ``replicas`` on a node-local level: each tag published there is sent to the next nodes' memory, and
    ``latest(levels)`` brings a replaced node's tags back (see ``latest``).

    Raises ``SaveRefusedError`` for a second install on the same engine, and (on every rank) for a URL
    level, a node-local level without node-local storage, or replicas the ring cannot serve.
    """
    previous = engine.checkpoint_engine
    if isinstance(previous, LazyCheckpointEngine):
        raise SaveRefusedError("lazyckpt.deepspeed is already installed on this engine; call handle.uninstall() first")
    if previous.is_decoupled():  # its pending checkpoint written before it goes
        previous.cleanup()
    lazy = LazyCheckpointEngine(options=options, commit_timeout=commit_timeout, **core_options)
    if levels is not None:
        try:
            exchange = StoreExchange(
                StoreExchange.default_store(), f"lazyckpt/deepspeed-levels/{lazy.token}", lazy.rank, lazy.world_size,
                commit_timeout,
            )  # fmt: skip
            lazy.levels = DeepSpeedLevels.check(
                levels, lazy.rank, lazy.world_size, lazy.token, exchange.all_gather, engine.use_node_local_storage(),
                lazy.checkpointer.fsync, commit_timeout,
            )  # fmt: skip
            lazy.levels.attach(lazy)
        except BaseException:
            lazy.close()
            raise
    _publish_before_conversion()
    return DeepSpeedHandle(engine, lazy, previous)


def _copy_durably(copy: Callable[[Any, str], None], engine: Any, save_path: str, fsync: bool) -> None:
    """DeepSpeed's copy of its recovery scripts into ``save_path``, each fsynced (a folder renamed into place
    after it must not hold an empty one)."""
    copy(engine, save_path)
    for name in SCRIPTS if fsync else ():
        path = os.path.join(save_path, name)
        if os.path.exists(path):
            _fs.fsync_file(path)


def _publish_before_conversion() -> None:
    """DeepSpeed's ``zero_to_fp32`` readers (``get_fp32_state_dict_from_zero_checkpoint``, which its converters
    call) publish this process's pending tags of the folder first, as a load does (process-wide, once; code that
    imported the function before the first ``install()`` keeps the unwrapped one)."""
    from deepspeed.utils import zero_to_fp32

    read = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint
    if getattr(read, "lazyckpt_publishes", False):
        return

    @functools.wraps(read)
    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        publish_pending(os.fspath(checkpoint_dir))
        return read(checkpoint_dir, *args, **kwargs)

    get_fp32_state_dict_from_zero_checkpoint.lazyckpt_publishes = True  # type: ignore[attr-defined]
    zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint


def latest(
    where: str | os.PathLike[str] | Sequence[Level], *, collective: bool | None = None, timeout: float = 600.0
) -> Found | None:
    """The tag a ``latest`` file names, if its folder is there: a ``Found`` whose ``path`` is the ``save_dir``
    (what ``engine.load_checkpoint`` takes), ``step`` the N of ``global_stepN`` (-1 for another tag) and
    ``level`` the index of its level. ``where``: one ``save_dir``, or the levels given to ``install`` (the
    newest tag of any level; the fastest level on a tie).

    ``collective`` (default: True exactly when a level has ``replicas``): call it on every rank; each node's
    folder first gets back from its peers' replicas the tags newer than its own (after a node was replaced),
    its ``latest`` then naming the newest restored, and every rank must find the same tag (``RuntimeError``
    otherwise; ``timeout``: seconds to wait for the other ranks). Not collective: reads this rank's files only."""
    if isinstance(where, (str, os.PathLike)):
        return _levels.latest_in(os.fspath(where))
    levels = (where,) if isinstance(where, Level) else tuple(where)
    if collective if collective is not None else any(level.replicas for level in levels):
        return _levels.latest_restored(levels, timeout)
    return _levels.latest(levels)
