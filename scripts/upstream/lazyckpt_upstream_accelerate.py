"""pytest plugin: ``lazyckpt.accelerate.install()`` applied to every Accelerator when $LAZYCKPT_UPSTREAM_MODE=lazy.

Loaded with ``-p lazyckpt_upstream_accelerate``; ``stock`` (the default) patches nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any

MODE = os.environ.get("LAZYCKPT_UPSTREAM_MODE", "stock")


def pytest_configure(config: Any) -> None:
    if MODE == "stock":
        return
    if MODE != "lazy":
        raise ValueError(f"LAZYCKPT_UPSTREAM_MODE={MODE!r}: expected stock or lazy for Accelerate")
    import accelerate.accelerator

    import lazyckpt.accelerate

    cls = accelerate.accelerator.Accelerator
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        lazyckpt.accelerate.install(self)

    cls.__init__ = __init__
