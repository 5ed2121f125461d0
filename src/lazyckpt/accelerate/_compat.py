"""Everything that knows Accelerate's internals (checked against accelerate 1.15), not its public API.

Owns the process-wide, reference-counted, reversible patch of ``accelerate.checkpointing.save`` and of the
FSDP sharded route (``save_fsdp_*``, ``dcp.save``). Imports nothing else of ``lazyckpt.accelerate``.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import accelerate.checkpointing as _acc_checkpointing
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType


class FolderSaveLike(Protocol):
    """What the stand-in for ``accelerate.checkpointing.save`` needs of one lazy save_state call."""

    def save(self, obj: Any, f: Any, *, save_on_each_node: bool, safe_serialization: bool) -> None: ...


logger = logging.getLogger("lazyckpt.accelerate")

# Distributed types whose save_state bypasses ``accelerate.checkpointing.save``: they stay stock (synchronous),
# but for FSDP's sharded state dicts (``_sharded``). DeepSpeed saves through lazyckpt.deepspeed (``_deepspeed``).
STOCK_ONLY_TYPES = frozenset(
    t
    for t in (
        getattr(DistributedType, "FSDP", None),
        getattr(DistributedType, "MEGATRON_LM", None),
        getattr(DistributedType, "XLA", None),
    )
    if t is not None
)


# -- the process-wide patch of accelerate.checkpointing.save (reference counted, reversible) ----------

_patch_lock = threading.RLock()
_patch_refcount = 0
_original_save: Callable[..., Any] | None = None
active_save: contextvars.ContextVar[FolderSaveLike | None] = contextvars.ContextVar(
    "lazyckpt_accelerate_active_save", default=None
)
# Set while accelerate's save_fsdp_model / save_fsdp_optimizer run for an installed accelerator.
DcpRoute = Callable[[dict[str, Any], str], None]
active_dcp: contextvars.ContextVar[DcpRoute | None] = contextvars.ContextVar(
    "lazyckpt_accelerate_active_dcp", default=None
)
_routes: weakref.WeakKeyDictionary[Any, DcpRoute] = weakref.WeakKeyDictionary()


def set_route(accelerator: Any, route: DcpRoute) -> None:
    """Route the FSDP sharded saves of ``accelerator`` to ``route`` (while it is installed)."""
    with _patch_lock:
        _routes[accelerator] = route


def drop_route(accelerator: Any, route: DcpRoute) -> None:
    """``accelerator``'s sharded saves go stock again (if ``route`` is still its route)."""
    with _patch_lock:
        if _routes.get(accelerator) == route:
            del _routes[accelerator]


def route_for(accelerator: Any) -> DcpRoute | None:
    if accelerator is None:
        return None
    try:
        return _routes.get(accelerator)
    except TypeError:  # not weak-referenceable: never installed
        return None


def _dispatch_save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> Any:
    """Stand-in for ``accelerate.checkpointing.save``: lazy inside a lazy save_state, stock otherwise."""
    fs = active_save.get()
    original = _original_save
    if fs is None or original is None or not isinstance(f, (str, os.PathLike)):
        fn = original if original is not None else _acc_checkpointing.save
        return fn(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
    return fs.save(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)


# FSDP: save_fsdp_model / save_fsdp_optimizer are wrapped in every module that binds them by name; dcp.save
# routes only inside such a wrapped call, for the exact writer and planner accelerate builds.
_FSDP_FUNCS = ("save_fsdp_model", "save_fsdp_optimizer")
_FSDP_MODULES = ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator")
_fsdp_originals: dict[tuple[str, str], Any] = {}  # (module, name) -> what was there before
_original_dcp_save: Callable[..., Any] | None = None


def _wrap_fsdp_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(fsdp_plugin: Any, accelerator: Any, *args: Any, **kwargs: Any) -> Any:
        route = route_for(accelerator)
        if route is None:
            return original(fsdp_plugin, accelerator, *args, **kwargs)
        # FSDP2: without ``offload_to_cpu``, so the device-to-host copies are lazy too, not inside this call.
        config: Any = getattr(fsdp_plugin, "state_dict_config", None)
        offload = getattr(fsdp_plugin, "fsdp_version", 1) == 2 and getattr(config, "offload_to_cpu", False) is True
        token = active_dcp.set(route)
        if offload:
            config.offload_to_cpu = False
        try:
            return original(fsdp_plugin, accelerator, *args, **kwargs)
        finally:
            if offload:
                config.offload_to_cpu = True
            active_dcp.reset(token)

    wrapper.__lazyckpt_wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _dispatch_dcp_save(*args: Any, **kwargs: Any) -> Any:
    """Stand-in for ``torch.distributed.checkpoint.save``: routed only for the exact call accelerate's
    wrapped FSDP save functions make for an installed accelerator; stock otherwise."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    route = active_dcp.get()
    original = _original_dcp_save
    writer = kwargs.get("storage_writer")
    planner = kwargs.get("planner")
    state_dict = args[0] if len(args) == 1 else kwargs.get("state_dict")
    if (
        route is not None
        and original is not None
        and isinstance(state_dict, dict)
        and len(args) + ("state_dict" in kwargs) == 1
        and set(kwargs) <= {"state_dict", "storage_writer", "planner"}
        and type(writer) is FileSystemWriter
        and (planner is None or type(planner) is DefaultSavePlanner)
    ):
        token = active_dcp.set(None)  # one routing per call; nothing inside routes again
        try:
            route(state_dict, os.fspath(writer.path))
        finally:
            active_dcp.reset(token)
        return None  # accelerate ignores dcp.save's Metadata
    fn = original if original is not None else _dcp().save
    return fn(*args, **kwargs)


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _patch_fsdp() -> None:
    global _original_dcp_save
    dcp = _dcp()
    if dcp.save is not _dispatch_dcp_save:
        _original_dcp_save = dcp.save
        dcp.save = _dispatch_dcp_save
    for mod_name in _FSDP_MODULES:
        mod = importlib.import_module(mod_name)
        for name in _FSDP_FUNCS:
            current = getattr(mod, name, None)
            if current is None or hasattr(current, "__lazyckpt_wrapped__"):
                continue
            _fsdp_originals[(mod_name, name)] = current
            setattr(mod, name, _wrap_fsdp_save(current))


def _unpatch_fsdp() -> None:
    dcp = _dcp()
    if dcp.save is _dispatch_dcp_save and _original_dcp_save is not None:
        dcp.save = _original_dcp_save  # (kept: a replacement made on top of ours may still call ours)
    for (mod_name, name), original in list(_fsdp_originals.items()):
        mod = importlib.import_module(mod_name)
        if getattr(getattr(mod, name, None), "__lazyckpt_wrapped__", None) is original:
            setattr(mod, name, original)
    _fsdp_originals.clear()


def acquire_patch() -> None:
    global _patch_refcount, _original_save
    with _patch_lock:
        if _patch_refcount == 0:
            current = _acc_checkpointing.save
            if current is not _dispatch_save:
                _original_save = current
            _acc_checkpointing.save = _dispatch_save
            _patch_fsdp()
        _patch_refcount += 1


def release_patch() -> None:
    global _patch_refcount, _original_save
    with _patch_lock:
        if _patch_refcount <= 0:
            return
        _patch_refcount -= 1
        if _patch_refcount == 0:
            if _acc_checkpointing.save is _dispatch_save and _original_save is not None:
                _acc_checkpointing.save = _original_save
            else:  # somebody patched on top of us: leave theirs in place, but stop dispatching lazily
                logger.warning(
                    "accelerate.checkpointing.save was replaced after lazyckpt.accelerate.install(); "
                    "leaving the replacement in place"
                )
            _original_save = None
            _unpatch_fsdp()


def folder_number(folder: str) -> int:
    # Exactly accelerate's key for sorting automatically named checkpoint folders.
    return list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0]


def real_path(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))


def is_writer(save_on_each_node: bool) -> bool:
    # Same rule as accelerate.utils.other.save.
    state = PartialState()
    if save_on_each_node:
        return state.is_local_main_process
    return state.is_main_process


def is_deepspeed(accelerator: Any) -> bool:
    return accelerator.distributed_type == getattr(DistributedType, "DEEPSPEED", None)


def deepspeed_tag(index: int) -> str:
    """The tag stock ``save_state`` gives the ``index``-th DeepSpeed engine's ``save_checkpoint``."""
    from accelerate.utils.constants import MODEL_NAME

    return MODEL_NAME if index == 0 else f"{MODEL_NAME}_{index}"


def is_sharded_fsdp(accelerator: Any) -> bool:
    """An FSDP accelerator whose plugin saves ``SHARDED_STATE_DICT`` (through DCP)."""
    fsdp = getattr(DistributedType, "FSDP", None)
    if fsdp is None or accelerator.distributed_type != fsdp:
        return False
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return getattr(getattr(plugin, "state_dict_type", None), "name", None) == "SHARDED_STATE_DICT"


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None


# -- what install() puts on an Accelerator instance, and how it pickles -------------------------------


class InstalledMethod:
    """``accelerator.save_state`` / ``load_state`` while installed: calls the handle's method.

    Keeps the accelerator picklable without pickling the handle: a copy (pickle, deepcopy) gets what the
    attribute was before install() (``getattr(copy, name)`` runs while the copy's ``__dict__`` is still
    empty), so the copy is a plain stock Accelerator."""

    __slots__ = ("_call", "_accelerator", "_name", "_previous")

    def __init__(self, call: Callable[..., Any], accelerator: Any, name: str, previous: Any = None) -> None:
        self._call = call
        self._accelerator = accelerator
        self._name = name
        self._previous = previous  # the instance attribute install() replaced (None: the class's)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self._previous is not None:
            return _same, (self._previous,)
        return getattr, (self._accelerator, self._name)

    def __repr__(self) -> str:
        return f"<lazyckpt.accelerate {self._name} of {self._call!r}>"


class InstalledPreHook:
    """The save_state pre-hook install() registers; a pickled copy gets an inert one (see ``InstalledMethod``)."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[..., None]) -> None:
        self._call = call

    def __call__(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        self._call(models, weights, output_dir)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _same, (inert_pre_hook,)


def inert_pre_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
    """The pre-hook of an unpickled copy of an installed accelerator."""


def _same(obj: Any) -> Any:
    return obj


# -- multi-level saves: real optimizer steps, the state's size, agreement between processes ------------

# Real steps per inner torch optimizer (skipped steps never reach it), counted by one process-wide post-hook.
_real_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_step_hook: Any = None


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _real_steps[optimizer] = _real_steps.get(optimizer, 0) + 1


def count_real_steps() -> None:
    """From now on, count every optimizer's real steps (idempotent)."""
    global _step_hook
    with _patch_lock:
        if _step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _step_hook = register_optimizer_step_post_hook(_count_step)


def real_steps(optimizer: torch.optim.Optimizer) -> int:
    return _real_steps.get(optimizer, 0)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The optimizers ``accelerator.prepare`` wrapped, in order (Accelerate keeps them privately)."""
    return list(accelerator._optimizers)


def prepared_models(accelerator: Any) -> list[Any]:
    """The models ``accelerator.prepare`` wrapped, in order (Accelerate keeps them privately)."""
    return list(accelerator._models)


def first_optimizer(accelerator: Any) -> torch.optim.Optimizer | None:
    for opt in prepared_optimizers(accelerator):
        inner = unwrap_optimizer(opt)
        if inner is not None:
            return inner
    return None


def state_of(accelerator: Any) -> list[Any]:
    """The prepared models' and optimizers' state dicts (their tensors: the checkpoint's size)."""
    models, optimizers = prepared_models(accelerator), prepared_optimizers(accelerator)
    return [m.state_dict() for m in models] + [o.state_dict() for o in optimizers]


def all_gather(obj: Any) -> list[Any]:
    """``obj`` of every process, in process order (a collective on the default group)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """The main process's ``obj`` on every process (a collective)."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([obj], from_process=0)[0]
