from __future__ import annotations

import threading

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ckpt():
    from lazyckpt import LazyCheckpointer

    c = LazyCheckpointer(host_memory_budget=256 << 20, chunk_bytes=4 << 20)
    yield c
    if not c.closed:
        c.close()


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    """Every test must close its checkpointers: no lazyckpt thread may outlive it."""
    yield
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("lazyckpt-")]
    if leaked:
        from lazyckpt.core import exit as _exit

        for c in _exit.registered(_exit.CORE):
            try:
                c.close()
            except Exception:
                pass
        pytest.fail(f"lazyckpt threads left running: {sorted(set(leaked))}")
