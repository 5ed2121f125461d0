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


def test_old_import_paths_still_work_and_the_leftover_aliases_warn():
    """The aliases of names that moved (BackpressureWarning from lazyckpt.checkpointer, Accelerate's
    PENDING_MARKER_PREFIX) still work, with a DeprecationWarning naming the new spelling."""
    import pytest

    from lazyckpt.cli.inspect import InspectError

    with pytest.warns(DeprecationWarning, match="use lazyckpt.BackpressureWarning"):
        from lazyckpt.checkpointer import BackpressureWarning
    assert BackpressureWarning is errors.BackpressureWarning is lazyckpt.BackpressureWarning
    assert InspectError is errors.InspectError
    assert "BackpressureWarning" not in lazyckpt.checkpointer.__all__
    LA = pytest.importorskip("lazyckpt.accelerate")
    from lazyckpt.commit.folder import MARKER_PREFIX

    with pytest.warns(DeprecationWarning, match="use lazyckpt.commit.folder.MARKER_PREFIX"):
        assert LA.PENDING_MARKER_PREFIX == MARKER_PREFIX
    assert "PENDING_MARKER_PREFIX" not in LA.__all__
    with pytest.raises(AttributeError):
        LA.NO_SUCH_NAME  # noqa: B018


def test_every_error_lazyckpt_raises_derives_from_lazyckpterror():
    """``except lazyckpt.LazyCkptError`` catches every error class of lazyckpt.errors (InspectError too)."""
    for name in errors.__all__:
        obj = getattr(errors, name)
        if issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, errors.LazyCkptError), name


def test_accelerate_warning_is_reexported():
    import pytest

    LA = pytest.importorskip("lazyckpt.accelerate")
    assert LA.IncompleteCheckpointWarning is errors.IncompleteCheckpointWarning


def test_transformers_error_is_reexported():
    import pytest

    LT = pytest.importorskip("lazyckpt.transformers", exc_type=ImportError)
    assert LT.UnsupportedTrainerError is errors.UnsupportedTrainerError
    assert issubclass(errors.UnsupportedTrainerError, errors.SaveRefusedError)


def test_cleanup_temporaries_is_the_filesystem_modules():
    """``lazyckpt.cleanup_temporaries`` is ``lazyckpt.storage.fs``'s (the old alias module ``_commit``
    is gone with the package layout)."""
    from lazyckpt.storage import fs as _fs

    assert _fs.cleanup_temporaries is lazyckpt.cleanup_temporaries


def test_checkpointer_options_defaults_match_the_keywords(tmp_path):
    import dataclasses

    import pytest
    import torch

    from lazyckpt import CheckpointerOptions, LazyCheckpointer

    opts = CheckpointerOptions(host_memory_budget=64 << 20, chunk_bytes=1 << 20, writer_threads=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.fsync = False  # type: ignore[misc]
    with (
        LazyCheckpointer(opts) as a,
        LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20, writer_threads=2) as b,
    ):
        assert a.options == b.options == opts
        a.save({"w": torch.ones(3)}, tmp_path / "a.pt").wait()
    with LazyCheckpointer(opts, fsync=False) as c:  # keywords override fields of options
        assert c.options == dataclasses.replace(opts, fsync=False) and c.fsync is False


def test_checkpointer_options_validate_like_the_constructor():
    import pytest

    from lazyckpt import CheckpointerOptions, LazyCheckpointer

    for bad, match in (
        ({"on_backpressure": "drop"}, "on_backpressure"),
        ({"writer_threads": 0}, "writer_threads"),
        ({"host_memory_budget": 0}, "host_memory_budget"),
    ):
        with pytest.raises(ValueError, match=match):
            CheckpointerOptions(**bad)
        with pytest.raises(ValueError, match=match):
            LazyCheckpointer(**bad)
    with pytest.raises(TypeError):
        LazyCheckpointer(no_such_option=1)
    with pytest.raises(TypeError):
        LazyCheckpointer(1 << 20)  # options are a CheckpointerOptions or keywords


def test_integrations_take_checkpointer_options():
    import pytest

    from lazyckpt import CheckpointerOptions

    LL = pytest.importorskip("lazyckpt.lightning")
    plugin = LL.LazyCheckpointIO(options=CheckpointerOptions(writer_threads=2), fsync=False)
    assert plugin._options == CheckpointerOptions(writer_threads=2, fsync=False)
    with pytest.raises(TypeError):
        LL.LazyCheckpointIO(object(), options=CheckpointerOptions())  # type: ignore[arg-type]


def test_the_classes_users_hold_carry_no_internal_api():
    """Issue 36 item 5: what producers need of a public object is reached through its producer
    interface (``producer_of``, ``core.handle``'s functions, the plugin's runtime), not its methods."""
    import pytest

    from lazyckpt.checkpointer import producer_of
    from lazyckpt.core.handle import confirm, finished_report, wait_finished
    from lazyckpt.distributed import DistributedSaveHandle

    gone = {
        lazyckpt.LazyCheckpointer: ("publish", "callbacks", "reuse", "remote_tier", "run_job"),
        lazyckpt.SaveHandle: ("report", "confirm", "wait_finished"),
        DistributedSaveHandle: ("bind_local",),
    }
    for cls, names in gone.items():
        for name in names:
            assert not hasattr(cls, name), f"{cls.__name__}.{name}"
    for cls in (lazyckpt.LazyCheckpointer, lazyckpt.SaveHandle):
        assert "Internal API" not in "".join(inspect.getdoc(m) or "" for _, m in inspect.getmembers(cls))
    with lazyckpt.LazyCheckpointer(host_memory_budget=1 << 20) as ckpt:
        assert producer_of(ckpt).callbacks is not None
    assert callable(confirm) and callable(finished_report) and callable(wait_finished)
    L = pytest.importorskip("lazyckpt.lightning")
    for name in ("start_save", "open_checkpointer", "wait_path", "on_optimizer_step", "raise_errors",
                 "levels_saver", "save_sharded_levels", "settle_levels", "drain", "save_sharded"):  # fmt: skip
        assert not hasattr(L.LazyCheckpointIO, name), f"LazyCheckpointIO.{name}"
