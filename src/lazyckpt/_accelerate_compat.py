"""Accelerate compatibility, kept apart from the adapter (``lazyckpt.accelerate.install``).

Everything here knows Accelerate's internals rather than its public API: the distributed types
whose ``save_state`` bypasses ``accelerate.checkpointing.save``, the process-wide (reference
counted, reversible) patch of that function, accelerate's folder numbering and writer rule.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import accelerate.checkpointing as _acc_checkpointing
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

if TYPE_CHECKING:
    from .accelerate import _FolderSave

logger = logging.getLogger("lazyckpt.accelerate")

# Distributed types whose save_state does not go through ``accelerate.checkpointing.save`` for the big
# objects (or must convert tensors first); there install() keeps the stock, synchronous behaviour.
STOCK_ONLY_TYPES = frozenset(
    t
    for t in (
        getattr(DistributedType, "FSDP", None),
        getattr(DistributedType, "DEEPSPEED", None),
        getattr(DistributedType, "MEGATRON_LM", None),
        getattr(DistributedType, "XLA", None),
    )
    if t is not None
)


# --------------------------------------------------------------------------------------------------
# The process-wide patch of accelerate.checkpointing.save (reference counted, reversible)
# --------------------------------------------------------------------------------------------------

_patch_lock = threading.RLock()
_patch_refcount = 0
_original_save: Callable[..., Any] | None = None
active_save: contextvars.ContextVar[_FolderSave | None] = contextvars.ContextVar(
    "lazyckpt_accelerate_active_save", default=None
)


def _dispatch_save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> Any:
    """Stand-in for ``accelerate.checkpointing.save``: lazy inside a lazy save_state, stock otherwise."""
    fs = active_save.get()
    original = _original_save
    if fs is None or original is None or not isinstance(f, (str, os.PathLike)):
        fn = original if original is not None else _acc_checkpointing.save
        return fn(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
    return fs.save(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)


def acquire_patch() -> None:
    global _patch_refcount, _original_save
    with _patch_lock:
        if _patch_refcount == 0:
            current = _acc_checkpointing.save
            if current is not _dispatch_save:
                _original_save = current
            _acc_checkpointing.save = _dispatch_save
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


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return opt if isinstance(opt, torch.optim.Optimizer) else None
