"""Lightning integration: ``LazyCheckpointIO`` for ``Trainer`` and ``Fabric``, and ``MultiLevelCheckpoint``.

Works with ``lightning`` and the standalone ``pytorch_lightning`` / ``lightning_fabric``. The plugin's methods
run on the training thread; completions arrive on lazyckpt's threads and touch only the runtime's bookkeeping
under its lock (``_runtime.py``). Lightning internals and the patches for a synchronous plugin: ``_compat.py``.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from lazyckpt import CheckpointerOptions, LazyCheckpointer, SaveStats
from lazyckpt.errors import CheckpointerClosedError
from lazyckpt.lightning import _compat, _runtime
from lazyckpt.lightning._levels import MultiLevelCheckpoint
from lazyckpt.options import merge as _merge_options
from lazyckpt.recovery import Preread
from lazyckpt.threads import reentry

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

    Raises ``TypeError`` when both ``checkpointer`` and options are given. ``save_checkpoint`` returns
    once the state is captured; optimizer-owned tensors are copied in the background and the next
    ``optimizer.step()`` waits for them. Code that changes parameters or optimizer state in place outside
    ``optimizer.step()`` while a save may be pending must call :meth:`wait_staged` first. :meth:`wait`
    makes every save durable and raises the first background error; teardown, ``load_checkpoint`` and
    interpreter exit call it.
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
        if reentry.reentered():  # a signal handler interrupted lazyckpt (threads/reentry.py)
            self._save_now(checkpoint, path)
            return
        rt = self._runtime
        rt.raise_errors()
        trainer = rt.attach()
        record = rt.start(checkpoint, path, trainer)
        if rt.outside_fit(trainer) or _compat.preempted(trainer, record.key):
            # No optimizer step or teardown may come to finish it (outside a running fit), or the job
            # may end right after (a preemption's save): return with the file in place, as stock does.
            rt.wait_for([record])
            if rt.torn_down or not _compat.in_fit(trainer):
                rt.release_resources()  # no thread outlives a save made outside any fit

    def _save_now(self, checkpoint: dict[str, Any], path: Any) -> None:
        """``save_checkpoint`` from a signal handler that interrupted lazyckpt on this thread: durable on
        return, touching none of the plugin's state (``threads/reentry.py``)."""
        key, is_url = _compat.split_path(path)
        ckpt = self._runtime.ckpt
        if is_url or ckpt is None or ckpt.closed:
            reentry.count_synchronous()
            _compat.stock_torch_io(_CheckpointIO).save_checkpoint(checkpoint, path)
            return
        os.makedirs(os.path.dirname(key), exist_ok=True)
        ckpt.save(checkpoint, key)  # re-entered: the core writes it here and supersedes a pending save of key

    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path`` without waiting; ordered after a pending save to it (a URL: after its upload)."""
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
        """Drain pending saves (raising their errors), then load like ``TorchCheckpointIO``."""
        self._runtime.attach()
        self.wait()
        if isinstance(path, (str, os.PathLike)):
            Preread.release(os.fspath(path))
        stock = _compat.stock_torch_io(_CheckpointIO)
        return _compat.stock_load(stock, path, map_location, weights_only)

    def teardown(self) -> None:
        """Make every pending save durable; raise the first background error (only logged while an
        exception propagates, so the training exception is the one raised)."""
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
