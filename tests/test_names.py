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


def test_old_import_paths_still_work():
    from lazyckpt.checkpointer import BackpressureWarning
    from lazyckpt.cli.inspect import InspectError

    assert BackpressureWarning is errors.BackpressureWarning is lazyckpt.BackpressureWarning
    assert InspectError is errors.InspectError


def test_accelerate_warning_is_reexported():
    import pytest

    LA = pytest.importorskip("lazyckpt.accelerate")
    assert LA.IncompleteCheckpointWarning is errors.IncompleteCheckpointWarning


def test_commit_is_the_filesystem_module():
    """``lazyckpt._commit`` is the old name of ``lazyckpt._fs``: the same module, so patching either works."""
    from lazyckpt import _commit, _fs

    assert _commit is _fs
    assert _fs.cleanup_temporaries is lazyckpt.cleanup_temporaries
