"""``lazyckpt.deepspeed.install()`` applied to every engine ``deepspeed.initialize`` returns when
$LAZYCKPT_UPSTREAM_MODE=lazy; ``stock`` (the default) patches nothing.

DeepSpeed's unit tests run each test in processes of their own (spawn / forkserver), which load no pytest
plugin: ``deepspeed_site/sitecustomize.py`` (on PYTHONPATH for this suite) calls :func:`inject` in every
process. Loaded as a pytest plugin (``-p lazyckpt_upstream_deepspeed``) it only checks the mode.
"""

from __future__ import annotations

import functools
import os
from typing import Any

MODE = os.environ.get("LAZYCKPT_UPSTREAM_MODE", "stock")


def pytest_configure(config: Any) -> None:
    if MODE not in ("stock", "lazy"):
        raise ValueError(f"LAZYCKPT_UPSTREAM_MODE={MODE!r}: expected stock or lazy for DeepSpeed")


def inject() -> None:
    """In lazy mode: every engine from ``deepspeed.initialize`` gets a ``LazyCheckpointEngine``."""
    if MODE != "lazy":
        return
    import deepspeed

    import lazyckpt.deepspeed

    initialize = deepspeed.initialize

    @functools.wraps(initialize)
    def lazy_initialize(*args: Any, **kwargs: Any) -> Any:
        out = initialize(*args, **kwargs)
        lazyckpt.deepspeed.install(out[0], commit_timeout=120)
        record = os.environ.get("LAZYCKPT_UPSTREAM_RECORD")
        if record:  # one line per engine installed: the proof the spawned test processes were reached
            with open(record + ".installs", "a", encoding="utf-8") as fh:
                fh.write(f"{os.getpid()} {os.environ.get('PYTEST_CURRENT_TEST', '?')}\n")
        return out

    deepspeed.initialize = lazy_initialize
