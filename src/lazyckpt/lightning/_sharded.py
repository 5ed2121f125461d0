"""The sharded path of ``LazyCheckpointIO``: Lightning strategies that save with DCP themselves.

For ``ModelParallelStrategy`` and ``FSDPStrategy(state_dict_type="sharded")`` the plugin replaces the
instance's ``save_checkpoint`` (the same folder, ``meta.pt`` included, through a ``DistributedCheckpointer``),
``teardown`` (drains every rank first) and the state-dict methods (no ``cpu_offload``: lazy device copies).
``save``, ``defer_removal``, ``wait`` and ``close`` run on the training thread; commit callbacks run on
lazyckpt's callback thread and touch only ``_lock``-guarded state.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from typing import TYPE_CHECKING, Any

import torch

from lazyckpt.core import remote as _remote
from lazyckpt.errors import CheckpointerClosedError, LazyCkptError
from lazyckpt.lightning import _compat
from lazyckpt.options import CheckpointerOptions
from lazyckpt.threads import reentry

if TYPE_CHECKING:
    from lazyckpt.distributed import DistributedCheckpointer, DistributedSaveHandle

log = logging.getLogger(__name__)

META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


class ShardedSaves:
    """One plugin's sharded saves: a ``DistributedCheckpointer`` and the removals waiting for it."""

    def __init__(self, options: CheckpointerOptions) -> None:
        self._options = options
        self._ckpt: DistributedCheckpointer | None = None
        self._lock = reentry.Lock()
        self._pending: dict[DistributedSaveHandle, str] = {}  # handle -> folder, until committed
        self._removals: dict[str, bool] = {}  # folder -> still wanted (rank 0: deferred deletes)

    @property
    def checkpointer(self) -> DistributedCheckpointer | None:
        return self._ckpt

    def save(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any, state_key: str) -> None:
        """What the strategy's ``save_checkpoint`` does, lazily. Collective (every rank); a pending removal
        of the folder is cancelled."""
        path, is_url = _compat.split_path(strategy.broadcast(filepath))
        with self._lock:
            if path in self._removals:  # this save replaces the folder: the pending delete is moot
                self._removals[path] = False
        converted, extra = convert(checkpoint, state_key, strategy.global_rank == 0)
        if extra is not None and not is_url and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)  # as stock: a full-state file at this path gives way to the folder
        handle = self._checkpointer().save(converted, path, extra_files=extra)
        with self._lock:
            self._pending[handle] = path
        handle.add_done_callback(self._on_done)

    def pending_paths(self) -> set[str]:
        with self._lock:
            return set(self._pending.values())

    def defer_removal(self, path: str) -> bool:
        """If a save to ``path`` is pending, delete the folder once it commits; True if deferred."""
        with self._lock:
            if path not in self._pending.values():
                return False
            self._removals[path] = True
            return True

    def wait(self, timeout: float | None = None) -> None:
        """Every save committed, every deferred delete done; raise the first error. Call on every rank."""
        if self._ckpt is not None:
            self._ckpt.wait(timeout)

    def close(self) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            ckpt.close()

    def _checkpointer(self) -> DistributedCheckpointer:
        if self._ckpt is None:
            from lazyckpt.distributed import DistributedCheckpointer

            self._ckpt = DistributedCheckpointer(options=self._options)
        return self._ckpt

    def _on_done(self, handle: Any) -> None:
        """lazyckpt's callback thread, after the save committed (or failed) on this rank."""
        with self._lock:
            path = self._pending.pop(handle, None)
            if path is None or path in self._pending.values():  # the last pending save to it decides
                return
            wanted = self._removals.pop(path, False)
        if not wanted:
            return
        try:
            _remove_folder(path, self._options.storage_options)
        except OSError as exc:
            err = LazyCkptError(f"lazyckpt: deleting the old checkpoint {path} failed: {exc}")
            err.__cause__ = exc
            ckpt = self._ckpt
            if ckpt is not None:
                ckpt.add_error(err)
            else:
                log.error("%s", err)


def convert(checkpoint: dict[str, Any], state_key: str, rank0: bool) -> tuple[dict[str, Any], dict[str, bytes] | None]:
    """(DCP state: the model under ``state_key``, ``optimizer_<i>``; rank 0: ``{"meta.pt": bytes}`` of the rest,
    else None), as these strategies save it. Pops the model and optimizer states from ``checkpoint``."""
    converted = {state_key: checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return converted, ({META: _torch_save_bytes(checkpoint)} if rank0 else None)


def sharded_state_key(strategy: object) -> str | None:
    """The model-state key of a Trainer strategy that saves with DCP, or None (``CheckpointIO`` saves, Fabric)."""
    mro = type(strategy).__mro__
    if not any(c.__module__.startswith(("lightning.pytorch.", "pytorch_lightning.")) for c in mro):
        return None
    names = {c.__name__ for c in mro}
    if "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        return "state_dict"
    if "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", "full") == "sharded":
        return "model"
    return None


def strategy_patches(strategy: Any, plugin: weakref.ref, key: str) -> dict[str, Any]:
    """The methods set on a sharded strategy instance (``plugin`` held weakly): ``save_checkpoint``, a
    ``teardown`` that drains first, and ``lazy_state_methods``."""
    stock_teardown = strategy.teardown

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`storage_options` is not supported by {type(strategy).__name__} (it uses DCP).")
        io = plugin()
        if io is None:
            raise CheckpointerClosedError("the LazyCheckpointIO serving this strategy is gone")
        io.save_sharded(strategy, checkpoint, filepath, key)

    def teardown() -> None:
        try:
            io = plugin()
            if io is not None:
                io.teardown()
        finally:
            stock_teardown()

    return {"save_checkpoint": save_checkpoint, "teardown": teardown, **lazy_state_methods(strategy)}


def lazy_state_methods(strategy: Any) -> dict[str, Any]:
    """``ModelParallelStrategy``'s state-dict methods without ``cpu_offload`` (same values)."""
    if "ModelParallelStrategy" not in {c.__name__ for c in type(strategy).__mro__}:
        return {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    def lightning_module_state_dict() -> dict[str, Any]:
        return get_model_state_dict(strategy.model, options=StateDictOptions(cpu_offload=False))

    def optimizer_state(optimizer: Any) -> dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return get_optimizer_state_dict(strategy.model, inner, options=StateDictOptions(cpu_offload=False))

    return {"lightning_module_state_dict": lightning_module_state_dict, "optimizer_state": optimizer_state}


def _torch_save_bytes(obj: Any) -> bytes:
    # torch.save names the zip's inner archive after the file: keep it "meta/" as stock writes it.
    with tempfile.TemporaryDirectory(prefix="lazyckpt-meta-") as tmp:
        target = os.path.join(tmp, META)
        torch.save(obj, target)
        with open(target, "rb") as fh:
            return fh.read()


def _remove_folder(path: str, storage_options: dict[str, Any] | None = None) -> None:
    if _remote.is_url(path):
        fs, rpath = _remote.filesystem(path, storage_options)
        _remote.remove_prefix(fs, rpath)
        return
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
