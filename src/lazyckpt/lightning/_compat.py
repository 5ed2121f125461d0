"""Everything that knows Lightning's internals rather than its ``CheckpointIO`` contract.

Which package provides ``CheckpointIO``, strategies that bypass it, finding a plugin's Trainer from the
calling frames, the process-wide optimizer-step hook, and the patches of callbacks and loggers that assume a
synchronous plugin (holding the plugin's runtime by weak reference).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
import sys
import types
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lazyckpt.core.remote import remove_prefix
from lazyckpt.threads import reentry


class Plugin(Protocol):
    """What this module needs of ``_runtime.PluginRuntime`` (not imported: no cycle)."""

    def drain(self, raise_errors: bool, timeout: float | None = None, *, loggers_open: bool = False) -> None: ...
    def on_optimizer_step(self) -> None: ...
    def pending_paths(self) -> set[str]: ...
    def wait(self, timeout: float | None = None) -> None: ...
    def wait_path(self, key: str) -> None: ...
    def wait_staged(self) -> None: ...


# -- which Lightning -------------------------------------------------------------------------------

BASE_MODULES = ("lightning.fabric.plugins.io.checkpoint_io", "lightning_fabric.plugins.io.checkpoint_io")


def checkpoint_io_base() -> type:
    for name in BASE_MODULES:
        try:
            module = __import__(name, fromlist=["CheckpointIO"])
        except ImportError:
            continue
        return module.CheckpointIO
    raise ImportError("lazyckpt.lightning needs Lightning: `pip install lightning` (or pytorch_lightning).")


CALLBACK_MODULES = ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks")


def callback_base() -> type:
    for name in CALLBACK_MODULES:
        try:
            return __import__(name, fromlist=["Callback"]).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise ImportError("lazyckpt.lightning needs Lightning: `pip install lightning` (or pytorch_lightning).")


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` would write, without its save and barrier (private API, Lightning >= 2.0)."""
    return _connector(trainer).dump_checkpoint(weights_only=False)  # type: ignore[no-any-return]


def load_before_restore(trainer: Any, path: str) -> None:
    """Have ``trainer`` restore from ``path`` although ``fit`` got no ``ckpt_path``. Call from a callback's
    ``setup`` in fit, before the Trainer restores (Lightning 2.1-2.6 run setup hooks first); a
    ``ckpt_path`` given to ``fit`` is loaded after this one and wins."""
    _connector(trainer).resume_start(path)


def forget_loaded(trainer: Any, path: str) -> None:
    """Forget what ``load_before_restore(trainer, path)`` loaded, as ``resume_end`` does but without its
    barrier (called on an exception path). No-op once a restore ended or when the connector holds another path."""
    connector = _connector(trainer)
    if not connector._loaded_checkpoint or trainer.ckpt_path not in (None, path):
        return
    if getattr(connector, "_user_managed", False):
        return
    connector._ckpt_path = None
    connector._loaded_checkpoint = {}


def _connector(trainer: Any) -> Any:
    return trainer._checkpoint_connector


def register_with_loaded_packages(plugin_class: type) -> None:
    """Register ``plugin_class`` as a virtual subclass of every imported Lightning package's ``CheckpointIO``
    (``lightning`` and ``pytorch_lightning`` ship separate copies)."""
    for name in BASE_MODULES:
        module = sys.modules.get(name)
        if module is not None and not issubclass(plugin_class, module.CheckpointIO):
            module.CheckpointIO.register(plugin_class)


def stock_torch_io(base: type) -> Any:
    package = base.__module__.split(".plugins.")[0]
    module = __import__(f"{package}.plugins.io.torch_io", fromlist=["TorchCheckpointIO"])
    return module.TorchCheckpointIO()


def stock_load(stock: Any, path: Any, map_location: Any | None, weights_only: bool | None) -> dict[str, Any]:
    """``stock.load_checkpoint`` with only the arguments its signature has (Lightning < 2.6 takes no
    ``weights_only``)."""
    kwargs: dict[str, Any] = {}
    if map_location is not None:
        kwargs["map_location"] = map_location
    if _takes_weights_only(type(stock).load_checkpoint):
        kwargs["weights_only"] = weights_only
    return stock.load_checkpoint(path, **kwargs)


@functools.cache
def _takes_weights_only(load_checkpoint: Callable[..., Any]) -> bool:
    params = inspect.signature(load_checkpoint).parameters
    return "weights_only" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def mro_names(obj: object) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


# Strategies that save without calling CheckpointIO.save_checkpoint.
def bypass_reason(strategy: object) -> str | None:
    names = mro_names(strategy)
    if "DeepSpeedStrategy" in names:
        return "DeepSpeedStrategy saves through DeepSpeed's engine"
    if "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", "full") == "sharded":
        return "FSDPStrategy(state_dict_type='sharded') saves with torch.distributed.checkpoint"
    if "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        return "ModelParallelStrategy(save_distributed_checkpoint=True) saves with torch.distributed.checkpoint"
    return None


def split_path(path: Any) -> tuple[str, bool]:
    """(key, is_url): local paths become absolute; other fsspec protocols stay URLs."""
    text = os.fspath(path)
    if "://" in text:
        protocol = text.split("://", 1)[0]
        if protocol not in ("file", "local"):
            return text, True
        text = text.split("://", 1)[1]
    return os.path.abspath(text), False


# -- helpers bound to the plugin by weak reference -------------------------------------------------


def find_strategy(plugin: object, max_depth: int = 40) -> Any:
    """The strategy whose ``_checkpoint_io`` is ``plugin``, found in the frames above our caller, or None."""
    here = inspect.currentframe()  # find_strategy's; 2: the caller of our caller
    frame: FrameType | None = here.f_back.f_back if here is not None and here.f_back is not None else None
    for _ in range(max_depth):
        if frame is None:
            return None
        for name in ("self", "strategy", "trainer"):
            obj = frame.f_locals.get(name)
            if obj is None or obj is plugin:
                continue
            try:
                if getattr(obj, "_checkpoint_io", None) is plugin:
                    return obj
                owner = getattr(obj, "_strategy", None) if name != "trainer" else getattr(obj, "strategy", None)
                if owner is not None and getattr(owner, "_checkpoint_io", None) is plugin:
                    return owner
            except Exception:  # arbitrary user objects: properties may raise
                continue
        frame = frame.f_back
    return None


_log = logging.getLogger(__name__)

# every live LazyCheckpointIO -> its runtime (the plugin holds the runtime; the runtime holds the plugin weakly)
runtimes: weakref.WeakKeyDictionary[Any, Plugin] = weakref.WeakKeyDictionary()


def runtime_of(plugin: object) -> Plugin | None:
    """The runtime of ``plugin`` if it is a ``LazyCheckpointIO``, else None."""
    try:
        return runtimes.get(plugin)
    except TypeError:  # not weakly referenceable: no LazyCheckpointIO
        return None


step_hook_installed = False


def install_step_hook() -> None:
    """One process-wide hook for all plugins, never removed: removal from a finalizer could run while
    torch iterates its hook dict (inside someone's ``optimizer.step()``)."""
    global step_hook_installed
    if not step_hook_installed:
        step_hook_installed = True
        register_optimizer_step_pre_hook(on_optimizer_step)


def on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Finds the Trainer before any checkpoint, so bypassing strategies are reported at setup.
    for runtime in list(runtimes.values()):
        runtime.on_optimizer_step()
    return None


class PendingAwareCheckpoint:
    """``ModelCheckpoint.file_exists`` (bound onto the callback; rank 0 decides) counting a pending save
    as existing, so version suffixes (-v1) match the stock plugin."""

    def file_exists(self: Any, filepath: Any, trainer: Any, *, plugin_ref: weakref.ref) -> bool:
        plugin = plugin_ref()
        local = False
        if trainer.is_global_zero:
            local = bool(self._fs.exists(filepath))
            if not local and plugin is not None:
                local = split_path(filepath)[0] in plugin.pending_paths()
        return bool(trainer.strategy.reduce_boolean_decision(local, all=False))


def pending_aware_file_exists(cb: Any, plugin_ref: weakref.ref) -> Callable[..., bool]:
    return types.MethodType(functools.partial(PendingAwareCheckpoint.file_exists, plugin_ref=plugin_ref), cb)


def link_after_pending(method: Callable[..., Any], plugin_ref: weakref.ref) -> Callable[..., Any]:
    """``save_last="link"``: let a pending save to the link path land before the link replaces it."""

    def link(trainer: Any, filepath: Any, linkpath: Any) -> Any:
        plugin = plugin_ref()
        if plugin is not None:
            plugin.wait_path(split_path(linkpath)[0])
        return method(trainer, filepath, linkpath)

    return link


def staged_first(method: Callable[..., Any], plugin_ref: weakref.ref) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        plugin = plugin_ref()
        if plugin is not None:
            plugin.wait_staged()  # these swaps write through `.data`, which `_version` does not see
        return method(*args, **kwargs)

    return wrapper


def durable_first(method: Callable[..., Any], plugin_ref: weakref.ref) -> Callable[..., Any]:
    def after_save_checkpoint(checkpoint_callback: Any) -> Any:
        plugin = plugin_ref()
        if plugin is not None:
            plugin.wait()  # this logger reads or uploads checkpoint files
        return method(checkpoint_callback)

    return after_save_checkpoint


def preempted(trainer: Any, key: str) -> bool:
    """This save is a preemption's (SLURM requeue ``hpc_ckpt_<n>.ckpt``, or any save after SIGTERM): the
    job may end as soon as it returns."""
    return os.path.basename(key).startswith("hpc_ckpt_") or bool(getattr(trainer, "received_sigterm", False))


def drained_before_finalize(method: Callable[..., Any], plugin_ref: weakref.ref) -> Callable[..., Any]:
    """Drain at a logger's ``finalize``, which Lightning calls before the strategy's teardown when ``fit``
    fails or a tuner ends it: saves are durable and their stats logged while loggers are open. Errors are
    logged, never raised (raising would skip the rest of Lightning's teardown)."""

    def finalize(status: str) -> Any:
        plugin = plugin_ref()
        if plugin is not None and not reentry.reentered():  # SLURM's requeue handler finalizes the loggers
            plugin.drain(raise_errors=False, loggers_open=True)
        return method(status)

    return finalize


def adaptations(trainer: Any, plugin: weakref.ref) -> list[tuple[object, str, Callable[..., Any]]]:
    """(object, attribute, replacement) for the Trainer's callbacks and loggers that assume a synchronous plugin."""
    out: list[tuple[object, str, Callable[..., Any]]] = []
    for cb in getattr(trainer, "checkpoint_callbacks", ()):
        if hasattr(cb, "file_exists") and hasattr(cb, "_fs"):
            out.append((cb, "file_exists", pending_aware_file_exists(cb, plugin)))
        if callable(getattr(cb, "_link_checkpoint", None)):
            out.append((cb, "_link_checkpoint", link_after_pending(cb._link_checkpoint, plugin)))
    for cb in getattr(trainer, "callbacks", ()):
        names = mro_names(cb)
        if "WeightAveraging" in names:
            out.extend((cb, attr, staged_first(getattr(cb, attr), plugin)) for attr in
                       ("_swap_models", "_copy_average_to_current"))  # fmt: skip
        if "StochasticWeightAveraging" in names:
            out.append((cb, "transfer_weights", staged_first(cb.transfer_weights, plugin)))
    for logger in getattr(trainer, "loggers", ()):
        out.append((logger, "finalize", drained_before_finalize(logger.finalize, plugin)))
        if logger_reads_checkpoint_files(logger):
            out.append((logger, "after_save_checkpoint", durable_first(logger.after_save_checkpoint, plugin)))
    return out


def logger_reads_checkpoint_files(logger: Any) -> bool:
    if getattr(logger, "_log_model", False) or getattr(logger, "_log_model_checkpoints", False):
        return True
    impl = type(logger).after_save_checkpoint
    module = getattr(impl, "__module__", "") or ""
    # Lightning's own loggers read files only when logging models (above); a third-party hook may.
    return not module.startswith(("lightning.", "pytorch_lightning."))


def is_trainer_strategy(strategy: object) -> bool:
    """A Trainer's strategy (Fabric's strategies have no ``lightning_module``)."""
    return hasattr(type(strategy), "lightning_module")


def trainer_of(strategy: object) -> Any:
    if not is_trainer_strategy(strategy):
        return None
    try:
        module = strategy.lightning_module  # type: ignore[attr-defined]
    except Exception:  # a property of a half-set-up strategy
        return None
    return getattr(module, "_trainer", None)


def in_fit(trainer: Any) -> bool:
    """The Trainer is inside ``fit`` (its validation loop included), not validate/test/predict."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is not None and fn == "fit"


def is_running(trainer: Any) -> bool:
    status = getattr(getattr(trainer, "state", None), "status", None)
    return status is None or status == "running"


def is_interrupted(trainer: Any) -> bool:
    """Lightning's failure path runs (exception hooks, loggers' ``finalize``, then teardown)."""
    status = getattr(getattr(trainer, "state", None), "status", None)
    return status is not None and status == "interrupted"


def log_save_stats(trainer: Any, stats: Any, saved_at_step: int | None) -> None:
    """One finished save's timings (a ``SaveStats``) to the Trainer's loggers; never raises."""
    step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", trainer.global_step)
    metrics = {
        "lazyckpt/stall_s": stats.blocked_s + stats.guard_wait_s,
        "lazyckpt/blocked_s": stats.blocked_s,
        "lazyckpt/guard_wait_s": stats.guard_wait_s,
        "lazyckpt/staged_s": stats.staged_s,
        "lazyckpt/write_s": stats.write_s,
        "lazyckpt/durable_s": stats.durable_s,
        "lazyckpt/write_gbps": stats.write_gbps,
        "lazyckpt/gbytes": stats.bytes / 1e9,
        "lazyckpt/saved_at_step": float(saved_at_step if saved_at_step is not None else -1),
    }
    for logger in trainer.loggers:
        try:
            logger.log_metrics(metrics, step=step)
        except Exception as exc:  # telemetry must never break training
            _log.warning("lazyckpt: logging checkpoint stats to %s failed: %s", type(logger).__name__, exc)


def delete_checkpoint(key: str, is_url: bool) -> None:
    """Delete a file, a sharded folder or a URL prefix (no checkpointer open)."""
    if is_url:
        from fsspec.core import url_to_fs

        fs, remote = url_to_fs(key)
        remove_prefix(fs, remote)  # a distributed checkpoint's .metadata first
        return
    if os.path.islink(key) or os.path.isfile(key):
        os.remove(key)
    elif os.path.isdir(key):  # sharded checkpoints are directories
        shutil.rmtree(key)
    _log.debug("lazyckpt: removed checkpoint %s", key)
