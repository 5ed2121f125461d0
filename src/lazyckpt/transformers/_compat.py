"""Everything that knows the transformers Trainer's internals; imports nothing else of this package.

``check_save_path``: refuse ``install()`` unless ``Trainer._save_checkpoint`` is the method the handle mirrors.
The gate: process-wide stand-ins for ``torch.save`` and the safetensors writers route a file directly in the
active :class:`Router`'s staging folder (a context variable, set while an installed ``_save_checkpoint`` runs
on this thread) to it; any other call goes to the original. Reference counted by installs.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import inspect
import logging
import os
import textwrap
import threading
from collections.abc import Callable
from typing import Any, Protocol

import safetensors.torch
import torch
import transformers
import transformers.modeling_utils as _modeling_utils
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lazyckpt.errors import UnsupportedTrainerError

logger = logging.getLogger("lazyckpt.transformers")

OPTIMIZER_NAME = "optimizer.pt"
TRAINER_STATE_NAME = "trainer_state.json"

#: The calls of stock ``Trainer._save_checkpoint`` (source order) that the replacement mirrors
#: (the XLA / SageMaker ones: install() refuses those setups).
EXPECTED_SAVE_CHECKPOINT_CALLS = (
    "self.store_flos",
    "self._get_output_dir",
    "os.path.join",
    "self.save_model",
    "is_torch_xla_available",
    "xm.rendezvous",
    "dist.barrier",
    "is_sagemaker_mp_enabled",
    "smp.barrier",
    "os.path.join",
    "os.path.exists",
    "self._save_optimizer_and_scheduler",
    "self._save_scaler",
    "self._save_rng_state",
    "isinstance",
    "cb.state",
    "isinstance",
    "self.state.stateful_callbacks[cb_name].append",
    "self.state.save_to_json",
    "os.path.join",
    "self._push_from_checkpoint",
    "rotate_checkpoints",
)

#: Source fragments (whitespace ignored) that write the files the stand-ins take over.
EXPECTED_FRAGMENTS = (
    (_modeling_utils.PreTrainedModel.save_pretrained, "safe_save_file(shard_state_dict,filename,metadata=metadata)"),
    (
        Trainer._save_optimizer_and_scheduler,
        "torch.save(self.optimizer.state_dict(),os.path.join(output_dir,OPTIMIZER_NAME))",
    ),
    (Trainer._save, "safetensors.torch.save_file("),
)


def stock_save_checkpoint() -> Callable[..., Any]:
    """``Trainer._save_checkpoint`` as this transformers defines it (read at each check, never cached)."""
    return Trainer._save_checkpoint


def call_sequence(fn: Callable[..., Any]) -> list[str]:
    """The functions called in ``fn``'s body, in source order (``a.b.c`` as written)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = sorted((n.lineno, n.col_offset, ast.unparse(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call))
    return [c[2] for c in calls]


def _squash(text: str) -> str:
    return "".join(text.split())


_checked: dict[str, str | None] = {}  # transformers version -> why refused (None: fine)


def check_save_path() -> None:
    """Raise :class:`UnsupportedTrainerError` unless this transformers saves as the replacement expects."""
    version = transformers.__version__
    if version not in _checked:
        _checked[version] = _why_unsupported()
    why = _checked[version]
    if why is not None:
        raise UnsupportedTrainerError(
            f"lazyckpt.transformers: transformers {version} saves checkpoints differently from the versions "
            f"lazyckpt.transformers supports (5.x, checked on 5.25): {why}. Nothing was installed; run stock, "
            "or use a supported transformers version."
        )


def _why_unsupported() -> str | None:
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        return f"major version {major}"
    try:
        calls = call_sequence(stock_save_checkpoint())
    except (OSError, TypeError, SyntaxError) as exc:
        return f"the source of Trainer._save_checkpoint cannot be read ({exc})"
    if tuple(calls) != EXPECTED_SAVE_CHECKPOINT_CALLS:
        return f"Trainer._save_checkpoint calls {calls}, expected {list(EXPECTED_SAVE_CHECKPOINT_CALLS)}"
    if not hasattr(_modeling_utils, "safe_save_file"):
        return "transformers.modeling_utils has no safe_save_file"
    import transformers.trainer as _trainer_module

    for owner, name in (
        (Trainer, "_finalize_training"),
        (Trainer, "_load_best_model"),
        (_trainer_module, "rotate_checkpoints"),
    ):
        if not callable(getattr(owner, name, None)):
            return f"{getattr(owner, '__name__', owner)}.{name} does not exist"
    for fn, fragment in EXPECTED_FRAGMENTS:
        try:
            src = _squash(inspect.getsource(fn))
        except (OSError, TypeError) as exc:
            return f"the source of {fn.__qualname__} cannot be read ({exc})"
        if fragment not in src:
            return f"{fn.__qualname__} no longer calls {fragment!r}"
    return None


def check_trainer(trainer: Any) -> None:
    """Refuse trainers whose checkpoints do not go through the path the replacement takes."""
    if not isinstance(trainer, Trainer):
        raise UnsupportedTrainerError(
            f"lazyckpt.transformers.install takes a transformers.Trainer, got {type(trainer).__name__}"
        )
    if type(trainer)._save_checkpoint is not stock_save_checkpoint():
        raise UnsupportedTrainerError(
            f"lazyckpt.transformers: {type(trainer).__qualname__} overrides _save_checkpoint; install() replaces "
            "that method and would drop your override. Override save_model / _save / _save_rng_state instead "
            "(they still run, into the checkpoint folder), or keep stock saving."
        )
    refused = {
        "FSDP": getattr(trainer, "is_fsdp_enabled", False),
        "torch_xla": _xla(),
        "SageMaker model parallel": _smp(),
    }
    for name, on in refused.items():
        if on:
            raise UnsupportedTrainerError(
                f"lazyckpt.transformers: {name} saves checkpoints through its own engine; lazy checkpoints are "
                "not supported there (stock saving stays available: do not call install())"
            )


def _xla() -> bool:
    from transformers.utils import is_torch_xla_available

    return bool(is_torch_xla_available())


def _smp() -> bool:
    from transformers.utils import is_sagemaker_mp_enabled

    return bool(is_sagemaker_mp_enabled())


# --------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------


class Router(Protocol):
    """What the stand-ins hand a routed call to (the handle's save of one checkpoint)."""

    staging: str

    def save_torch(self, obj: Any, path: str) -> None: ...

    def save_safetensors(
        self, tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None
    ) -> None: ...


active: contextvars.ContextVar[Router | None] = contextvars.ContextVar("lazyckpt_transformers_active", default=None)

_lock = threading.RLock()
_refcount = 0
_originals: dict[str, Any] = {}  # what the stand-ins replaced (while installed)

# (module, attribute) pairs the gate replaces.
_TORCH_SAVE = (torch, "save")
_SAFE_SAVE_TRANSFORMERS = (_modeling_utils, "safe_save_file")
_SAFE_SAVE_SAFETENSORS = (safetensors.torch, "save_file")


def _routed_path(f: Any) -> tuple[Router, str] | None:
    """The active router and the path, when ``f`` is a file directly in its staging folder."""
    router = active.get()
    if router is None or not isinstance(f, (str, os.PathLike)):
        return None
    path = os.path.abspath(os.fspath(f))
    if os.path.dirname(path) != router.staging:
        return None
    return router, path


@functools.wraps(torch.save)
def _torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
    routed = None if args or kwargs else _routed_path(f)
    if routed is not None and os.path.basename(routed[1]) == OPTIMIZER_NAME:
        router, path = routed
        token = active.set(None)  # nothing inside routes again
        try:
            return router.save_torch(obj, path)
        finally:
            active.reset(token)
    return _original("torch.save")(obj, f, *args, **kwargs)


def _safe_save(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def stand_in(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None) -> Any:
        routed = _routed_path(filename)
        if routed is not None:
            router, path = routed
            token = active.set(None)
            try:
                return router.save_safetensors(tensors, path, metadata)
            finally:
                active.reset(token)
        return _original(name)(tensors, filename, metadata=metadata)

    stand_in.__lazyckpt_stand_in__ = True  # type: ignore[attr-defined]
    return stand_in


# What each replaced name held at import (None: refused by check_save_path, never installed).
_AT_IMPORT: dict[str, Callable[..., Any]] = {
    "torch.save": torch.save,
    "transformers.modeling_utils.safe_save_file": getattr(_modeling_utils, "safe_save_file", None),  # type: ignore[dict-item]
    "safetensors.torch.save_file": safetensors.torch.save_file,
}
_TARGETS = {
    "torch.save": _TORCH_SAVE,
    "transformers.modeling_utils.safe_save_file": _SAFE_SAVE_TRANSFORMERS,
    "safetensors.torch.save_file": _SAFE_SAVE_SAFETENSORS,
}
_STAND_INS: dict[str, tuple[tuple[Any, str], Callable[..., Any]]] = {
    name: (_TARGETS[name], _torch_save if name == "torch.save" else _safe_save(name, original))
    for name, original in _AT_IMPORT.items()
    if original is not None
}


def write_stock(obj: Any, path: str, format: str, metadata: dict[str, str] | None = None) -> None:
    """What a routed call would have written, written by the function the gate replaced."""
    if format == "torch":
        _original("torch.save")(obj, path)
    else:
        _original("safetensors.torch.save_file")(obj, path, metadata=metadata)


def _original(name: str) -> Callable[..., Any]:
    """The function a stand-in replaced (after the last uninstall(), what was there at import)."""
    return _originals.get(name) or _AT_IMPORT[name]


def acquire_gate() -> None:
    """Put the stand-ins in place (first install) and count this install."""
    global _refcount
    with _lock:
        if _refcount == 0:
            for name, ((mod, attr), stand_in) in _STAND_INS.items():
                _originals[name] = getattr(mod, attr)
                setattr(mod, attr, stand_in)
        _refcount += 1


def release_gate() -> None:
    """One install fewer; the last one restores the originals (unless replaced on top of ours)."""
    global _refcount
    with _lock:
        if _refcount <= 0:
            return
        _refcount -= 1
        if _refcount:
            return
        for name, ((mod, attr), stand_in) in _STAND_INS.items():
            if getattr(mod, attr) is stand_in:
                setattr(mod, attr, _originals[name])
            else:
                logger.warning("lazyckpt.transformers: %s was replaced after install(); leaving the replacement", name)
        _originals.clear()


def jit_manager(trainer: Any) -> Any | None:
    """The ``CheckpointManager`` of the trainer's JIT checkpoint (``enable_jit_checkpoint=True``: saves on
    SIGTERM, then the job dies), or None."""
    for callback in trainer.callback_handler.callbacks:
        manager = getattr(callback, "jit_manager", None)
        if manager is not None and callable(getattr(manager, "execute_jit_checkpoint", None)):
            return manager
    return None


def checkpoint_name(step: int) -> str:
    return f"{PREFIX_CHECKPOINT_DIR}-{step}"
