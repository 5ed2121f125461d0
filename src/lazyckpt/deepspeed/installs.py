"""``EngineInstalls``: the DeepSpeed engines a framework integration saves through (Accelerate's
``save_state``, the transformers Trainer), each installed at its first save, their open tags handed to the
integration's own folder commit, all waited for and given back together. Training thread, but ``wait``."""

from __future__ import annotations

import dataclasses
from typing import Any

from lazyckpt.core.handle import SaveHandle
from lazyckpt.deepspeed._engine import LazyCheckpointEngine
from lazyckpt.options import CheckpointerOptions


class EngineInstalls:
    """``options``: the integration's core options (single-level: its own levels copy whole folders)."""

    def __init__(self, options: CheckpointerOptions) -> None:
        self.options = dataclasses.replace(options, levels=None)
        self._handles: dict[int, tuple[Any, Any]] = {}  # id(engine) -> (engine, DeepSpeedHandle)

    def ensure(self, engine: Any) -> LazyCheckpointEngine:
        """``engine`` saves lazily from now on (installed once)."""
        entry = self._handles.get(id(engine))
        if entry is None:
            from lazyckpt.deepspeed import install

            entry = self._handles[id(engine)] = (engine, install(engine, options=self.options))
        return entry[1].checkpoint_engine

    def tag_handle(self, engine: Any, save_dir: str, tag: str | None = None) -> SaveHandle | None:
        """The handle of the tag ``engine.save_checkpoint(save_dir, tag)`` left open (any tag for None)."""
        entry = self._handles.get(id(engine))
        return None if entry is None else entry[1].checkpoint_engine.handle_of(save_dir, tag)

    def wait(self, timeout: float | None = None) -> None:
        """Every engine's tags published (open ones handed over first); a failed tag's error raised once."""
        for _, handle in list(self._handles.values()):
            handle.wait(timeout)

    def close(self) -> None:
        """Wait, then give each engine back its previous checkpoint engine (the first error raised)."""
        error: BaseException | None = None
        handles, self._handles = self._handles, {}
        for _, handle in handles.values():
            try:
                handle.uninstall()
            except BaseException as exc:  # noqa: BLE001 - every engine is given back
                error = error or exc
        if error is not None:
            raise error
