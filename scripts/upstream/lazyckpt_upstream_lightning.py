"""pytest plugin: every Trainer/Fabric whose caller gave no CheckpointIO gets one, per $LAZYCKPT_UPSTREAM_MODE.

    stock  nothing injected (the baseline)
    lazy   lazyckpt's ``LazyCheckpointIO()``
    async  Lightning's own ``AsyncCheckpointIO(TorchCheckpointIO())``: the control, to tell "any asynchronous
           plugin differs here" from "lazyckpt is wrong"

Patches ``Trainer.__init__`` and ``Fabric.__init__`` of every Lightning package installed (``lightning`` and the
standalone ``pytorch_lightning`` / ``lightning_fabric``) when the plugin is loaded (``-p lazyckpt_upstream_lightning``).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

MODE = os.environ.get("LAZYCKPT_UPSTREAM_MODE", "stock")
PACKAGES = (("lightning.pytorch", "lightning.fabric"), ("pytorch_lightning", "lightning_fabric"))


def _make_plugin(pytorch_pkg: str, fabric_pkg: str) -> Any:
    if MODE == "lazy":
        from lazyckpt.lightning import LazyCheckpointIO

        return LazyCheckpointIO()
    if MODE == "async":
        io = importlib.import_module(f"{pytorch_pkg}.plugins.io")
        torch_io = importlib.import_module(f"{fabric_pkg}.plugins.io.torch_io")
        # Fabric's strategies never fill in a wrapping plugin's inner CheckpointIO: give it one.
        return io.AsyncCheckpointIO(torch_io.TorchCheckpointIO())
    raise ValueError(f"LAZYCKPT_UPSTREAM_MODE={MODE!r}: expected stock, lazy or async")


def _has_checkpoint_io(kwargs: dict[str, Any], checkpoint_io_cls: type) -> bool:
    plugins = kwargs.get("plugins")
    items = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    if any(isinstance(p, checkpoint_io_cls) for p in items if p is not None):
        return True
    strategy = kwargs.get("strategy")
    return getattr(strategy, "_checkpoint_io", None) is not None


def _with_plugin(init: Any, pytorch_pkg: str, fabric_pkg: str, checkpoint_io_cls: type) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not _has_checkpoint_io(kwargs, checkpoint_io_cls):
            plugins = kwargs.get("plugins")
            if plugins is None:
                plugins = []
            elif not isinstance(plugins, (list, tuple)):
                plugins = [plugins]
            kwargs["plugins"] = [*plugins, _make_plugin(pytorch_pkg, fabric_pkg)]
        init(self, *args, **kwargs)

    return __init__


def _patch(pytorch_pkg: str, fabric_pkg: str) -> None:
    try:
        trainer = importlib.import_module(f"{pytorch_pkg}.trainer.trainer").Trainer
        fabric = importlib.import_module(f"{fabric_pkg}.fabric").Fabric
        checkpoint_io_cls = importlib.import_module(f"{fabric_pkg}.plugins.io.checkpoint_io").CheckpointIO
    except ImportError:
        return
    for cls in (trainer, fabric):
        cls.__init__ = _with_plugin(cls.__init__, pytorch_pkg, fabric_pkg, checkpoint_io_cls)


def pytest_configure(config: Any) -> None:
    if MODE != "stock":
        for pytorch_pkg, fabric_pkg in PACKAGES:
            _patch(pytorch_pkg, fabric_pkg)
