"""Lazy ``accelerator.save_state`` for Hugging Face Accelerate, with the stock file layout.

Usage::

    import lazyckpt.accelerate

    accelerator = Accelerator(...)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    handle = lazyckpt.accelerate.install(accelerator)      # once, before or after prepare()
    for batch in loader:
        ...
        accelerator.backward(loss)
        optimizer.step()                                    # waits here only if copies are still running
        accelerator.save_state(...)                         # returns promptly
    handle.wait()                                           # every pending save durable; raises the first error
    handle.uninstall()                                         # back to stock behaviour (after draining)

How it works (checked against accelerate 1.15):

* ``Accelerator.save_state`` writes models, optimizers, schedulers, samplers and registered custom objects
  through ``accelerate.checkpointing.save``, a name that module imports from ``accelerate.utils.other``.
  ``install`` replaces that module attribute with a dispatcher. Outside a lazy ``save_state`` call (another
  Accelerator, direct calls, other threads) the dispatcher calls the original function, so nothing else
  changes. Inside one it hands the object to ``LazyCheckpointer.save`` with the same format choice as stock
  (safetensors after accelerate's own ``clean_state_dict_for_safetensors``, or torch.save) and the same
  "which process writes" rule (global main process, or each node's main with ``save_on_each_node``).
* RNG states, the GradScaler state and stateful-dataloader states are small per-process files written with
  plain ``torch.save`` inside accelerate; they stay synchronous and are fsynced in the background.
* The optimizers prepared by the accelerator are ``track``-ed, so model parameters and optimizer state are
  copied in the background; the core's global optimizer step pre-hook waits for those copies right before
  the next real ``optimizer.step()`` (steps skipped for gradient accumulation never reach it).
* Every process marks a folder it is saving into with a hidden ``.lazyckpt-pending-*`` file, created and
  made durable before any checkpoint file, and removed (then the folder fsynced) only once all of that
  process's files of that save are durable: the core's folder protocol (``lazyckpt.commit.folder.FolderSave``,
  ``lazyckpt.is_complete``), with the process index as the marker's tag. A folder without such a marker
  holds exactly the files stock Accelerate writes. ``load_state`` waits for pending saves (this process's
  through their handles, other processes' by watching their markers), refuses an incomplete folder with
  :class:`IncompleteCheckpointError` or, with automatic checkpoint naming, falls back to the newest
  complete folder with an :class:`IncompleteCheckpointWarning`. No collective call is added to ``save_state`` or
  ``load_state``: calling them on some processes only works as it does with stock.
* With ``automatic_checkpoint_naming`` and ``total_limit``, the folders stock ``save_state`` is about to delete
  are drained first, so deletion never races a pending write; the kept folders are the stock ones. They are
  then renamed out of ``checkpoints/`` (to a hidden temporary name in the project folder) and deleted in the
  background: freeing 1 GB of fsynced files took 0.2 s inside stock's ``rmtree`` here.
* FSDP ``SHARDED_STATE_DICT``: the ``torch.distributed.checkpoint.save`` calls of accelerate's ``save_fsdp_model``
  / ``save_fsdp_optimizer`` (collective, every process) are routed to a ``lazyckpt.distributed.DistributedCheckpointer``
  owned by the handle: the same ``pytorch_model_fsdp_<i>`` / ``optimizer_<i>`` folders, committed whole once every
  process's part is durable; the save_state folder's marker waits for them; ``wait()`` raises their errors.
* The pending marker is fsynced in the background, and no lazily written file of that save is renamed to its
  final name before the marker is durable. The small files stock writes itself (RNG states, scaler, custom
  objects) are not ordered against it: after a crash right at the start of a save, a folder may hold some of
  those and no marker; it then lacks the model and optimizer files, so loading it fails loudly.

Modules, in the order a save flows through them: ``_patch`` (what install() puts on the Accelerator and
uninstall() takes off), ``_handle`` (:class:`AccelerateHandle`: one ``save_state`` / ``load_state`` call from
start to end, its threads, its drain at exit), ``_folder_save`` (one ``save_state`` call of this process:
files, marker, end, upload), ``_retention`` (``total_limit``), ``_sharded`` (the FSDP / DCP route),
``_url`` (folders at URLs), ``_load`` (which folder ``load_state`` may read), ``_compat`` (everything that
knows Accelerate's internals; it imports nothing else of this package). They use the core through its
public and public-internal API (``LazyCheckpointer``, ``SaveHandle``, ``lazyckpt.commit.folder``,
``lazyckpt.commit.remote_folder``, ``core.workers.Worker``, ``core.exit``); the core never imports accelerate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lazyckpt import CheckpointerOptions, LazyCheckpointer, Level
from lazyckpt.accelerate._handle import AccelerateHandle
from lazyckpt.accelerate._patch import installed
from lazyckpt.accelerate._restore import load_latest
from lazyckpt.commit.folder import is_complete
from lazyckpt.commit.folder import pending_markers as pending_markers  # the core's, as documented below
from lazyckpt.errors import IncompleteCheckpointError, IncompleteCheckpointWarning

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "install",
    "load_latest",
    "AccelerateHandle",
    "IncompleteCheckpointError",
    "IncompleteCheckpointWarning",
    "is_complete",
]


def install(
    accelerator: Accelerator,
    checkpointer: LazyCheckpointer | None = None,
    *,
    levels: Sequence[Level] | None = None,
    options: CheckpointerOptions | None = None,
    load_timeout: float = 600.0,
    **core_options: Any,
) -> AccelerateHandle:
    """Make ``accelerator.save_state`` lazy (same files as stock) and ``load_state`` wait for pending saves.

    ``checkpointer``: an existing :class:`lazyckpt.LazyCheckpointer` to use (not closed by ``uninstall()``);
    otherwise one is created from ``options`` (a :class:`lazyckpt.CheckpointerOptions`) and/or ``core_options``
    (the same fields as keywords, overriding ``options``: ``host_memory_budget``, ``writer_threads``, ``fsync``,
    ``on_backpressure``, ``crc``, ``chunk_bytes`` ...) and closed by ``uninstall()``.
    ``levels``: ``[Level(path, every, keep), ...]``, fastest first: a bare ``accelerator.save_state()`` then
    saves the stock folder to ``<level>/step-<8 digits>`` of every level due at the step (``handle.step``:
    the first prepared optimizer's real steps), and :func:`load_latest` restores the newest complete one
    (docs/accelerate.md, "Multi-level checkpoints"). Refused with ``ProjectConfiguration``'s automatic
    checkpoint naming, which levels replace. ``save_state(output_dir)`` keeps saving to that folder.
    ``load_timeout``: with several processes, how long ``load_state`` waits for other processes' pending
    saves into the folder it reads before treating the folder as incomplete (with levels, also how long
    the main process waits for the other processes' parts of a step's folder).
    """
    if checkpointer is not None and (core_options or options is not None):
        raise TypeError("pass either checkpointer= or core options, not both")
    given = core_options.get("levels", options.levels if options is not None else None)
    if given is not None or getattr(checkpointer, "levels", None):  # (a checkpointer double may have none)
        raise TypeError(
            "lazyckpt.accelerate: pass the levels to install(accelerator, levels=[...]), not to the checkpointer "
            "(it would save single files by level; install saves save_state folders by level)"
        )
    if installed(accelerator) is not None:
        raise RuntimeError("lazyckpt.accelerate is already installed on this Accelerator; call uninstall() first")
    owns = checkpointer is None
    if checkpointer is None:
        checkpointer = LazyCheckpointer(options, **core_options)
    try:
        return AccelerateHandle(accelerator, checkpointer, owns, load_timeout=load_timeout, levels=levels)
    except BaseException:
        if owns:
            checkpointer.close()
        raise
