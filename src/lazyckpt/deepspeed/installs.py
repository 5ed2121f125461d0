"""``EngineInstalls``: the DeepSpeed engines a framework integration saves through (Accelerate's
``save_state``, the transformers Trainer), each installed at its first save, their tags handed to the
integration's own folder commit, all waited for and given back together. Training thread, but ``wait``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from lazyckpt.core.handle import SaveHandle
from lazyckpt.deepspeed._engine import LazyCheckpointEngine
from lazyckpt.options import CheckpointerOptions


class EngineInstalls:
    """``options``: the integration's core options (single-level: its own levels copy whole folders);
    ``before_save(save_dir)``: run as each engine's ``save_checkpoint`` starts (the integration marks its
    folder incomplete before any engine file is there)."""

    def __init__(self, options: CheckpointerOptions, before_save: Callable[[str], None] | None = None) -> None:
        self.options = dataclasses.replace(options, levels=None)
        self.before_save = before_save
        self._handles: dict[int, tuple[Any, Any]] = {}  # id(engine) -> (engine, DeepSpeedHandle)

    def ensure(self, engine: Any) -> LazyCheckpointEngine:
        """``engine`` saves lazily from now on (installed once)."""
        entry = self._handles.get(id(engine))
        if entry is None:
            from lazyckpt.deepspeed import install

            handle = install(engine, options=self.options)
            if self.before_save is not None:
                handle.before_save.append(self.before_save)
            entry = self._handles[id(engine)] = (engine, handle)
        return entry[1].checkpoint_engine

    def tag_handle(self, engine: Any, save_dir: str, tag: str | None = None) -> SaveHandle | None:
        """The handle of the tag ``engine.save_checkpoint(save_dir, tag)`` made (the newest there for None)."""
        entry = self._handles.get(id(engine))
        return None if entry is None else entry[1].checkpoint_engine.handle_of(save_dir, tag)

    def abandon(self, engine: Any, save_dir: str, error: BaseException) -> None:
        """The framework call around ``engine``'s save into ``save_dir`` raised ``error``: its open tag fails."""
        entry = self._handles.get(id(engine))
        if entry is not None:
            entry[1].checkpoint_engine.abandon(save_dir, error)

    def wait(self, timeout: float | None = None) -> None:
        """Every engine's tags published (open ones handed over first); a failed tag's error raised once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, handle in list(self._handles.values()):
            handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

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
