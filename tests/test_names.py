"""Issue 12 outcome 5: every error and warning lives in errors.py; old import paths keep working."""

from __future__ import annotations

import inspect

import lazyckpt
import lazyckpt.checkpointer
import lazyckpt.cli.inspect
import lazyckpt.errors as errors


def test_every_error_and_warning_is_defined_in_errors():
    for mod in (lazyckpt, lazyckpt.checkpointer, lazyckpt.cli.inspect):
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("lazyckpt"):
                assert obj.__module__ == "lazyckpt.errors", f"{mod.__name__}.{name}"
                assert getattr(errors, name) is obj


def test_removed_aliases_are_gone():
    """A library never released keeps no deprecated spellings."""
    import pytest

    from lazyckpt.cli.inspect import InspectError

    assert InspectError is errors.InspectError
    assert not hasattr(lazyckpt.checkpointer, "BackpressureWarning")
    LA = pytest.importorskip("lazyckpt.accelerate")
    assert not hasattr(LA, "PENDING_MARKER_PREFIX")
