"""The one "reported once" API of the core, which both integrations use: raise_errors / add_error."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from lazyckpt import LazyCheckpointer
from lazyckpt.errors import LazyCkptError, WriteError
from lazyckpt.storage import fs as _fs


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(1000)}


def _fail_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(fd: int, data: object, offset: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(_fs, "pwrite_all", fail)


def test_added_error_is_raised_once_by_the_next_call(ckpt):
    err = LazyCkptError("upload failed")
    ckpt.add_error(err)
    with pytest.raises(LazyCkptError, match="upload failed"):
        ckpt.wait(30)
    ckpt.wait(30)
    ckpt.raise_errors()


def test_raise_errors_raises_the_oldest_and_names_the_others(ckpt, tmp_path, monkeypatch):
    _fail_writes(monkeypatch)
    first = ckpt.save(_state(), tmp_path / "a.pt")
    first.exception(30)  # settled, not seen
    ckpt.add_error(LazyCkptError("second"))
    with pytest.raises(WriteError, match="a.pt") as info:
        ckpt.raise_errors()
    assert any("1 more" in note and "second" in note for note in getattr(info.value, "__notes__", []))
    ckpt.raise_errors()  # both seen


def test_exception_with_timeout_waits_without_claiming(ckpt, tmp_path, monkeypatch):
    _fail_writes(monkeypatch)
    handle = ckpt.save(_state(), tmp_path / "a.pt")
    assert isinstance(handle.exception(timeout=30), WriteError)
    assert not handle.reported
    with pytest.raises(WriteError):
        ckpt.wait(30)
    assert handle.reported
    with pytest.raises(WriteError):
        handle.wait(30)  # the owner still gets it from its own handle


def test_exception_timeout_on_a_pending_save(ckpt, tmp_path):
    gate = threading.Event()
    handle = ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
    assert handle.exception() is None  # default: no wait
    with pytest.raises(TimeoutError):
        handle.exception(timeout=0.01)
    gate.set()
    assert handle.exception(timeout=30) is None


def test_wait_timeout_on_a_pending_save_and_removal(tmp_path):
    gate = threading.Event()
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
        with pytest.raises(TimeoutError):
            ckpt.wait(0.01)
        gate.set()
        ckpt.wait(30)


def test_concurrent_reporters_see_each_error_once(tmp_path, monkeypatch):
    """Many threads asking at once: the failed save's error is raised exactly once between them."""
    _fail_writes(monkeypatch)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        ckpt.save(_state(), tmp_path / "a.pt").exception(30)
        start = threading.Barrier(8)
        raised = []

        def report():
            start.wait(30)
            try:
                ckpt.raise_errors()
            except WriteError as exc:
                raised.append(exc)

        threads = [threading.Thread(target=report) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(raised) == 1
