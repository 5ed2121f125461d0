"""Lazy ``checkpoint-N`` folders for the Hugging Face ``transformers`` Trainer (5.x), with the stock files.

``install(trainer)`` makes each save return at once; a background thread renames the complete folder to
``checkpoint-N``, then pushes and rotates as stock does. ``_load_best_model`` and the end of ``train()`` wait
for it. Modules: ``_compat`` (the Trainer's internals), ``_handle`` (the handle, one checkpoint's save),
``_levels`` (``install(levels=)``). The core never imports transformers.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lazyckpt import CheckpointerOptions, Found, IncompleteCheckpointWarning, LazyCheckpointer, Level, verify
from lazyckpt.errors import UnsupportedTrainerError
from lazyckpt.transformers import _compat
from lazyckpt.transformers._handle import TransformersHandle
from lazyckpt.transformers._levels import TrainerLevels, checkpoints

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["TransformersHandle", "UnsupportedTrainerError", "install", "latest"]

logger = logging.getLogger("lazyckpt.transformers")

_REQUIRED = ("trainer_state.json",)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
_CHECKED_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def install(
    trainer: Trainer,
    checkpointer: LazyCheckpointer | None = None,
    *,
    levels: Sequence[Level] | None = None,
    options: CheckpointerOptions | None = None,
    **core_options: Any,
) -> TransformersHandle:
    """Make every ``checkpoint-N`` folder ``trainer`` saves lazy (same files as stock); returns the handle.

    Call once, before ``train()``. ``checkpointer``: an existing :class:`lazyckpt.LazyCheckpointer` (not
    closed by ``uninstall()``); otherwise one is made from ``options`` / ``core_options`` and closed by
    ``uninstall()`` (``TypeError`` if both are given). ``levels``: ``[Level(path, every, keep), ...]``,
    fastest first: each checkpoint goes to ``<level>/checkpoint-N`` of every level due at the step
    (``global_step % every == 0``) instead of ``args.output_dir``; ``keep`` replaces ``save_total_limit``.

    Raises :class:`UnsupportedTrainerError` (nothing changed) for a second install on the same trainer, a
    subclass that overrides ``_save_checkpoint``, FSDP, XLA, SageMaker MP, ``levels`` beside
    ``save_total_limit``, or a transformers version whose ``_save_checkpoint`` is not the one mirrored.
    """
    if checkpointer is not None and (core_options or options is not None):
        raise TypeError("pass either checkpointer= or core options, not both")
    if "_lazyckpt_handle" in vars(trainer):
        raise UnsupportedTrainerError(
            "lazyckpt.transformers is already installed on this Trainer; call handle.uninstall() first"
        )
    _compat.check_trainer(trainer)
    _compat.check_save_path()
    if levels is not None and trainer.args.save_total_limit:
        raise UnsupportedTrainerError(
            "lazyckpt.transformers: with levels, each Level's keep= replaces save_total_limit; unset one of them"
        )
    owns = checkpointer is None
    if checkpointer is None:
        checkpointer = LazyCheckpointer(options, **core_options)
    trainer_levels = None
    try:
        if levels is not None:
            trainer_levels = TrainerLevels(levels, checkpointer, writer=bool(trainer.args.should_save))
        return TransformersHandle(trainer, checkpointer, owns, trainer_levels)
    except BaseException:
        if trainer_levels is not None:
            trainer_levels.close()
        if owns:
            checkpointer.close()
        raise


def latest(where: str | os.PathLike[str] | Sequence[Level], *, verify_files: bool = True) -> Found | None:
    """The newest complete ``checkpoint-N`` folder in ``where`` (a run folder, or the levels given to
    ``install``; for the same N, the fastest level) as a :class:`lazyckpt.Found` (``path``, ``step`` = N,
    ``level``: the index in ``where``, 0 for a run folder), or None. This process's own view: it talks to
    no other rank.

    Pass ``found.path`` to ``trainer.train(resume_from_checkpoint=...)``. Complete: the folder holds
    ``trainer_state.json`` and the model weights, and (``verify_files``) every ``.safetensors`` /
    ``.pt`` / ``.pth`` / ``.bin`` file in it passes :func:`lazyckpt.verify`. A folder that fails is
    skipped with an :class:`lazyckpt.IncompleteCheckpointWarning` naming it.
    """
    if isinstance(where, (str, os.PathLike)):
        candidates = [(n, 0, p) for n, p in checkpoints(os.fspath(where))]
    else:
        candidates = [(n, i, p) for i, level in enumerate(where) for n, p in checkpoints(level.path)]
    for step, index, path in sorted(candidates, key=lambda c: (-c[0], c[1])):
        problem = _problem(path, verify_files)
        if problem is None:
            return Found(path, step, index)
        warnings.warn(f"lazyckpt.transformers: skipping {path}: {problem}", IncompleteCheckpointWarning, stacklevel=2)
    return None


def _problem(folder: str, verify_files: bool) -> str | None:
    names = set(os.listdir(folder))
    missing = [n for n in _REQUIRED if n not in names]
    if missing:
        return f"no {missing[0]}"
    if not any(w in names for w in _WEIGHTS):
        return "no model weights"
    if not verify_files:
        return None
    for name in sorted(names):
        if name.endswith(_CHECKED_SUFFIXES):
            report = verify(os.path.join(folder, name))
            if not report.ok:
                return f"{name}: " + "; ".join(report.problems)
    return None
