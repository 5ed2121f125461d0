"""Lightning integration: ``LazyCheckpointIO`` for ``Trainer`` and ``Fabric``.

    from lazyckpt.lightning import LazyCheckpointIO
    trainer = L.Trainer(plugins=[LazyCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    fabric = L.Fabric(plugins=[LazyCheckpointIO()])

``save_checkpoint`` hands the checkpoint to a :class:`~lazyckpt.LazyCheckpointer` and returns at
once. Tensors owned by an optimizer are copied to host memory in the background; the optimizer step
pre-hook waits for those copies after the next forward/backward (Lightning runs them inside the
optimizer closure) and right before the update. Every other tensor and every non-tensor value is
captured inside ``save_checkpoint``, so the file always holds what ``dump_checkpoint`` produced.

Concurrency contract: the plugin's methods are called from the training thread; completions arrive
on lazyckpt's background threads and only touch the plugin's own bookkeeping (``_runtime``) under its lock.
Loggers, callbacks and the Trainer are only ever touched from the training thread.

Works with ``lightning`` (``lightning.pytorch`` / ``lightning.fabric``) and with the standalone
``pytorch_lightning`` / ``lightning_fabric`` packages. The plugin finds the Trainer it serves from
the strategy that calls it (the strategy holds the plugin in ``_checkpoint_io``), then adapts a few
things that assume a synchronous plugin: ``ModelCheckpoint.file_exists`` counts pending saves, weight
averaging swaps wait for pending copies, checkpoint-uploading loggers wait for pending files.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from lazyckpt import CheckpointerOptions, LazyCheckpointer, SaveStats
from lazyckpt.core import reentry
from lazyckpt.errors import CheckpointerClosedError
from lazyckpt.levels import Preread
from lazyckpt.lightning import _compat, _runtime
from lazyckpt.lightning._levels import MultiLevelCheckpoint
from lazyckpt.options import merge as _merge_options

__all__ = ["LazyCheckpointIO", "MultiLevelCheckpoint"]

log = logging.getLogger(__name__)

_CheckpointIO: Any = _compat.checkpoint_io_base()


class LazyCheckpointIO(_CheckpointIO):
    """A ``CheckpointIO`` that writes stock ``torch.save`` files in the background.

    Args:
        checkpointer: an existing :class:`~lazyckpt.LazyCheckpointer` to use (never closed by the plugin).
        log_stats: report each checkpoint's stall, staging and write times to the Trainer's loggers.
        options: a :class:`~lazyckpt.CheckpointerOptions` for the ``LazyCheckpointer`` the plugin
            creates at the first save (and closes at teardown).
        **checkpointer_options: the same options as keywords (override fields of ``options``).

    The caller may keep training right after ``save_checkpoint`` returns; nothing is needed from it.
    Code that changes parameters or optimizer state in place outside ``optimizer.step()`` while a save
    may be pending must call :meth:`wait_staged` first. :meth:`wait` makes every save durable and
    raises the first background error; teardown, ``load_checkpoint`` and interpreter exit call it.
    """

    def __init__(
        self,
        checkpointer: LazyCheckpointer | None = None,
        *,
        options: CheckpointerOptions | None = None,
        log_stats: bool = True,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        if checkpointer is not None and (checkpointer_options or options is not None):
            raise TypeError("pass either an existing `checkpointer` or LazyCheckpointer options, not both")
        options = _merge_options(options, checkpointer_options)
        if options.on_backpressure == "skip":
            warnings.warn(
                "LazyCheckpointIO(on_backpressure='skip'): a skipped save writes no file, but ModelCheckpoint "
                "still records it (top-k, last, best_model_path may name a missing file).",
                stacklevel=2,
            )
        self._options = options
        self._log_stats = log_stats
        self._user_checkpointer = checkpointer
        self._init_runtime()
        _compat.register_with_loaded_packages(LazyCheckpointIO)

    def _init_runtime(self) -> None:
        """Its checkpointer, pending saves and the Trainer it serves: ``_runtime.PluginRuntime``, which the
        step hook, ``MultiLevelCheckpoint`` and the strategy patches use (registered at exit there)."""
        self._runtime = _runtime.PluginRuntime(self, self._options, self._log_stats, self._user_checkpointer)
        self.stats: list[SaveStats] = self._runtime.stats  # every completed save, in completion order

    # Spawn-based launchers (ddp_spawn) pickle the Trainer, plugins included: send the options only.
    def __getstate__(self) -> dict[str, Any]:
        return {"_options": self._options, "_log_stats": self._log_stats}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._user_checkpointer = None
        self._init_runtime()

    # -- CheckpointIO ------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start a background save of ``checkpoint`` to ``path``; returns once the state is captured."""
        if storage_options is not None:
            raise TypeError(f"`storage_options` is not supported by {type(self).__name__}.")
        if reentry.reentered():  # a signal handler interrupted lazyckpt (docs/preemption.md)
            self._save_now(checkpoint, path)
            return
        rt = self._runtime
        rt.raise_errors()
        trainer = rt.attach()
        record = rt.start(checkpoint, path, trainer)
        if rt.outside_fit(trainer) or _compat.preempted(trainer, record.key):
            # Outside a running fit (before it, after teardown, validate/test/predict, an exception
            # checkpoint, ddp_spawn's result collection) no optimizer step or teardown may come to
            # finish it: behave like the stock plugin and return with the file in place. So does a
            # preemption's save (SLURM's requeue signal, after SIGTERM): the job may end right after.
            rt.wait_for([record])
            if rt.torn_down or not _compat.in_fit(trainer):
                rt.release_resources()  # no thread outlives a save made outside any fit

    def _save_now(self, checkpoint: dict[str, Any], path: Any) -> None:
        """``save_checkpoint`` from a signal handler that interrupted lazyckpt on this thread: written at
        once, durable when this returns, touching none of the plugin's state (``core/reentry.py``)."""
        key, is_url = _compat.split_path(path)
        ckpt = self._runtime.ckpt
        if is_url or ckpt is None or ckpt.closed:
            reentry.count_synchronous()
            _compat.stock_torch_io(_CheckpointIO).save_checkpoint(checkpoint, path)
            return
        os.makedirs(os.path.dirname(key), exist_ok=True)
        ckpt.save(checkpoint, key)  # re-entered: the core writes it here and supersedes a pending save of key

    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path`` without waiting: the core orders a delete after a pending save to it
        (and before a later one); for a URL, after its upload."""
        rt = self._runtime
        rt.attach()
        key, is_url = _compat.split_path(path)
        if rt.sharded is not None and rt.sharded.defer_removal(key):
            return  # a sharded save to this folder is pending: deleted once it commits
        ckpt = rt.ckpt
        if ckpt is None or ckpt.closed:
            _compat.delete_checkpoint(key, is_url=is_url)
            return
        try:
            ckpt.remove(key)
        except FileNotFoundError:
            pass  # as the stock plugin: nothing to delete
        except CheckpointerClosedError:  # closed meanwhile (a user checkpointer, closed by its owner)
            _compat.delete_checkpoint(key, is_url=is_url)
        log.debug("lazyckpt: removed checkpoint %s", key)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Drain pending saves (their errors are raised here), then load like ``TorchCheckpointIO``
        (what ``lazyckpt.latest()`` read ahead for this file is freed first: stock reads it)."""
        self._runtime.attach()
        self.wait()
        if isinstance(path, (str, os.PathLike)):
            Preread.release(os.fspath(path))
        stock = _compat.stock_torch_io(_CheckpointIO)
        return _compat.stock_load(stock, path, map_location, weights_only)

    def teardown(self) -> None:
        """Make every pending save durable; raise the first background error.

        When teardown runs because training raised, saves are still drained but their errors are
        logged instead of raised, so the training exception is the one that propagates. (On that path
        Lightning finalizes the loggers before teardown; the plugin has drained at their ``finalize``
        already, see ``_compat.drained_before_finalize``.)
        """
        self._runtime.teardown()

    # -- public extras -----------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is durable (uploaded for URLs) and every delete done; raise
        the first unseen error. ``timeout``: seconds (``None``: no limit), then ``TimeoutError``."""
        if reentry.wait_refused("LazyCheckpointIO.wait()"):
            return
        self._runtime.wait(timeout)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until every pending host copy is done: live tensors may then change in place.
        ``timeout``: seconds (``None``: no limit), then ``TimeoutError``."""
        self._runtime.wait_staged(timeout)

    def pending_paths(self) -> set[str]:
        """Paths (absolute, or URLs) whose saves are not yet durable."""
        return self._runtime.pending_paths()

    @property
    def checkpointer(self) -> LazyCheckpointer | None:
        """The underlying checkpointer (None until the first save)."""
        return self._runtime.ckpt
