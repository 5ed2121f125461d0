"""The guard: no optimizer step may change a tensor whose copy is still pending.

One process-wide ``torch.optim`` step pre-hook, installed when lazyckpt is imported (so optimizers
that step before the first checkpointer exists are known too). With nothing pending it costs a
set insertion and one list check. With saves pending it either waits right away
(plain loops, Accelerate: backward has already run) or, when the step was given a closure (Lightning
runs forward and backward inside it), wraps the closure so the wait happens after the closure
returns and just before the update: the copies then overlap forward and backward.

A save stays pending here until it is confirmed: its versions re-checked, after the copies, on a
thread that calls into lazyckpt (the step itself, or ``confirm_ready`` from ``save()``), because
torch moves a version only once an in-place kernel has finished (see ``Job.confirm``). A forked
child forgets pending saves: the threads that would finish them do not exist there.

The hook also learns which optimizers exist. Tensors they own (params, state) change only inside
``step()``, so ``save()`` may copy them lazily; every other tensor is captured inside ``save()``.

Besides ``step()``, a few stock calls overwrite saved state in place: ``Module.load_state_dict``
(``param.copy_``; what Lightning's Trainer restore, ``Fabric.load`` and Accelerate's ``load_state``
end up in), ``Optimizer.load_state_dict`` (and its post hooks) and
``torch.nn.utils.vector_to_parameters``. Called right after a save, they used to fail it with
``StaleTensorError``. torch has no global hook for them, so the first save that leaves copies
pending wraps them process-wide (``_install_mutator_guards``): with saves pending, the wrapper
first waits for every pending save's copies, on the calling thread (``wait_all``, what the step
does), then runs the stock call. The wrappers stay once installed: with nothing pending they cost
one list check, and these calls are rare (never on the hot path of forward or ``step()``).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lazyckpt.core import reentry


class Pending(Protocol):
    wait_in_closure: bool

    def release_guard(self) -> None:
        """Return once the optimizer may change this save's tensors (or the save failed)."""

    def confirm(self) -> bool:
        """Without blocking: check versions on this thread if the copies are over; True if done."""


_lock = reentry.Lock()
_pending: list[Pending] = []
_tracked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# Tensors declared frozen (LazyCheckpointer.declare_frozen): no step changes them, so, like an
# optimizer's, they are copied lazily; an in-place change while a save reads them is still caught.
_frozen: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()


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
            _frozen.add(t)


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
    """data_ptrs of every storage owned by a known optimizer (params and state tensors) or
    declared frozen. DTensors (FSDP2, tensor parallel) count by their local shard's storage: their
    own has no data pointer."""
    with _lock:
        optimizers = list(_tracked)
        ptrs = {_storage_ptr(t) for t in _frozen}
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
# (owner, attribute) of every stock callable that overwrites saved tensors in place. The module
# functions are wrapped where callers look them up at call time (``torch.nn.utils.X``); a name
# imported before the first save keeps the stock function (its change is still caught as stale).
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
    """A forked child has none of the threads that would finish the parent's saves: its steps must
    not wait for them (the child's copies of those saves are simply abandoned; the parent's go on)."""
    global _lock
    _lock = reentry.Lock()  # another thread may have held it at the fork
    _pending.clear()


register_optimizer_step_pre_hook(_pre_hook)
os.register_at_fork(after_in_child=_forget_pending_in_child)
