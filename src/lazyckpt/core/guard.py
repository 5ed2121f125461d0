"""The guard: no optimizer step may change a tensor whose copy is still pending.

A process-wide ``torch.optim`` step pre-hook (installed at import) waits for pending saves before the step,
or after the step's closure when it has one (Lightning), so copies overlap forward and backward. A save
stays pending until confirmed on a thread that calls into lazyckpt (``Job.confirm``). The hook records the
optimizers: tensors they own change only in ``step()``, so ``save()`` may copy them lazily. The first
pending save also wraps the stock in-place mutators of saved state (``_MUTATORS``) to wait likewise.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lazyckpt.threads import reentry


class Pending(Protocol):
    wait_in_closure: bool

    def release_guard(self) -> None:
        """Return once the optimizer may change this save's tensors (or the save failed)."""

    def confirm(self) -> bool:
        """Without blocking: check versions on this thread if the copies are over; True if done."""


_lock = reentry.Lock()
_pending: list[Pending] = []
_tracked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# Tensors declared frozen (LazyCheckpointer.declare_frozen): copied lazily like an optimizer's. By id (a
# WeakSet compares tensors with ``==`` when one is added twice); an entry goes when its tensor does.
_frozen: dict[int, weakref.ref[torch.Tensor]] = {}


def track(optimizer: torch.optim.Optimizer) -> None:
    inner = getattr(optimizer, "optimizer", None)  # Lightning/Accelerate wrappers
    with _lock:
        _tracked.add(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)


def freeze(*tensors: torch.Tensor | torch.nn.Module) -> None:
    """Declare ``tensors`` frozen; a module stands for its parameters that do not require grad."""
    flat: list[torch.Tensor] = []
    for t in tensors:
        if isinstance(t, torch.nn.Module):
            flat.extend(p for p in t.parameters() if not p.requires_grad)
        elif isinstance(t, torch.Tensor):
            flat.append(t)
        else:
            raise TypeError(f"declare_frozen takes tensors or modules, got {type(t).__name__}")
    with _lock:
        for t in flat:
            old = _frozen.get(id(t))
            if old is None or old() is not t:
                _frozen[id(t)] = weakref.ref(t, functools.partial(_forget_frozen, id(t)))


def _forget_frozen(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if _frozen.get(key) is ref:  # GC callback: no lock (it may run inside a locked region); one dict op
        _frozen.pop(key, None)


def add(job: Pending) -> None:
    with _lock:
        _pending.append(job)
        if not _mutators_guarded:
            _install_mutator_guards()


def discard(job: Pending) -> None:
    with _lock:
        try:
            _pending.remove(job)
        except ValueError:
            pass


@reentry.region
def wait_all() -> None:
    """Release every pending save from the guard (wait for its copies)."""
    while _pending:
        with _lock:
            jobs = list(_pending)
        for job in jobs:
            job.release_guard()
            discard(job)


def has_pending() -> bool:
    return bool(_pending)


@reentry.region
def confirm_ready() -> None:
    """Confirm every pending save whose copies are over, on the calling thread (never blocks)."""
    if not _pending:
        return
    with _lock:
        jobs = list(_pending)
    for job in jobs:
        if job.confirm():
            discard(job)


def guarded_storages() -> set[int]:
    """data_ptrs of every storage a known optimizer owns (params, state) or declared frozen; a DTensor
    counts by its local shard's storage."""
    with _lock:
        optimizers = list(_tracked)
        ptrs = {_storage_ptr(t) for ref in list(_frozen.values()) if (t := ref()) is not None}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(_storage_ptr(p))
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(_storage_ptr(v))
    ptrs.discard(0)
    return ptrs


def _storage_ptr(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None)  # DTensor
    return (local if isinstance(local, torch.Tensor) else t).untyped_storage().data_ptr()


_steps = 0  # optimizer steps seen by this process (the integrations tell training from no training)


def steps() -> int:
    """How many optimizer steps this process has begun (every torch optimizer, since import)."""
    return _steps


def _pre_hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    global _steps
    _steps += 1
    if optimizer not in _tracked:
        with _lock:  # save() may be listing the set on another thread
            _tracked.add(optimizer)
    if not _pending:
        return None
    defer = all(job.wait_in_closure for job in list(_pending))
    if defer and callable(kwargs.get("closure")):
        kwargs = dict(kwargs, closure=_waiting(kwargs["closure"]))
        return args, kwargs
    # args include the optimizer itself: a positional closure is args[1].
    if defer and len(args) > 1 and callable(args[1]):
        return (args[0], _waiting(args[1]), *args[2:]), kwargs
    wait_all()
    return None


def _waiting(closure: Callable[[], Any]) -> Callable[[], Any]:
    def closure_then_wait() -> Any:
        result = closure()
        wait_all()  # cheap when repeated (LBFGS calls the closure many times)
        return result

    return closure_then_wait


# -- in-place mutators of saved state outside step() ------------------------------------------------

_mutators_guarded = False
# (owner, attribute) of stock callables that overwrite saved tensors in place; a function imported by
# name before the first save stays unwrapped (its change is still caught as stale).
_MUTATORS: tuple[tuple[Any, str], ...] = (
    (torch.nn.Module, "load_state_dict"),
    (torch.optim.Optimizer, "load_state_dict"),
    (torch.nn.utils, "vector_to_parameters"),
    (torch.nn.utils.convert_parameters, "vector_to_parameters"),
)


def _install_mutator_guards() -> None:
    """Wrap the mutators so that each waits for pending copies first (caller holds ``_lock``)."""
    global _mutators_guarded
    wrapped: dict[int, Callable[..., Any]] = {}  # one wrapper per function (two names, one function)
    for owner, name in _MUTATORS:
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if current is None or getattr(current, "__lazyckpt_waits__", False):
            continue
        if id(current) not in wrapped:
            wrapped[id(current)] = _waits_for_pending_copies(current)
        setattr(owner, name, wrapped[id(current)])
    _mutators_guarded = True


def _waits_for_pending_copies(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def waits_then_mutates(*args: Any, **kwargs: Any) -> Any:
        if _pending:  # copies still read (or not yet confirmed): they must see the state at save()
            wait_all()
        return fn(*args, **kwargs)

    waits_then_mutates.__lazyckpt_waits__ = True  # type: ignore[attr-defined]
    return waits_then_mutates


def _forget_pending_in_child() -> None:
    """A forked child has none of the threads that finish the parent's saves: its steps must not wait."""
    global _lock
    _lock = reentry.Lock()  # another thread may have held it at the fork
    _pending.clear()


register_optimizer_step_pre_hook(_pre_hook)
os.register_at_fork(after_in_child=_forget_pending_in_child)
