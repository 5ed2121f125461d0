"""DeepSpeed engines under Accelerate: each prepared ``DeepSpeedEngine`` saves through ``lazyckpt.deepspeed``
(installed at the first ``save_state``), and the output folder's marker waits for the engine's tag folder
(``pytorch_model``, ``pytorch_model_<i>``) and its ``latest``, so the folder is complete only with them. The
tag is committed at the next ``engine.step()``, or when a wait hands it over.
"""

from __future__ import annotations

from typing import Any

from deepspeed import DeepSpeedEngine

from lazyckpt.accelerate import _compat
from lazyckpt.accelerate._folder_save import SaveStateCall
from lazyckpt.deepspeed.installs import EngineInstalls
from lazyckpt.options import CheckpointerOptions


def install(engines: EngineInstalls | None, options: CheckpointerOptions, accelerator: Any) -> EngineInstalls:
    """Every prepared DeepSpeed engine saves lazily (training thread, before stock ``save_state``); ``engines``
    made at the first call (this module is imported only for DeepSpeed accelerators)."""
    engines = engines if engines is not None else EngineInstalls(options, before_save=_mark_folder)
    for model in _compat.prepared_models(accelerator):
        if isinstance(model, DeepSpeedEngine):
            engines.ensure(model)
    return engines


def _mark_folder(save_dir: str) -> None:
    """An engine's save starts inside an installed ``save_state``: the folder's marker first, so a save that
    raises before Accelerate's own files leaves it marked incomplete."""
    call = _compat.active_save.get()
    if isinstance(call, SaveStateCall):
        call.begin(save_dir)


def attach(engines: EngineInstalls, accelerator: Any, call: SaveStateCall, output_dir: str) -> None:
    """Stock ``save_state`` returned: the call's marker also waits for each engine's tag in ``output_dir``."""
    for i, model in enumerate(_compat.prepared_models(accelerator)):
        handle = engines.tag_handle(model, output_dir, _compat.deepspeed_tag(i))
        if handle is not None:
            call.begin(output_dir)
            call.add_sharded(handle)
