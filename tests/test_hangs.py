"""The life of a save after save() returns: no lost error, no dead lazyckpt thread, no hang.

Each test forces its window (a held callback, a patched call) rather than hoping for a timing.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings

import pytest
import torch

from lazyckpt import BackpressureWarning, LazyCheckpointer
from lazyckpt.errors import WriteError
from lazyckpt.storage import fs as _fs


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(10_000)}


def _failing_pwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(fd: int, data: object, offset: int) -> None:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(_fs, "pwrite_all", fail)


def test_failed_save_is_published_only_once_its_error_is_set(tmp_path, monkeypatch):
    """Issue 11 item 3: a save()/wait() that runs while the committer is finishing a failed job must
    raise that job's WriteError, once; it used to find the handle without its error (assert)."""
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20)
    try:
        published, proceed = threading.Event(), threading.Event()
        real = ckpt._engine.committer._on_done

        def held(job):  # the committer, right after it handed the finished job to the checkpointer
            real(job)
            published.set()
            proceed.wait(30)

        monkeypatch.setattr(ckpt._engine.committer, "_on_done", held)
        _failing_pwrite(monkeypatch)
        handle = ckpt.save(_state(), tmp_path / "a.pt")
        assert published.wait(30)
        monkeypatch.setattr(_fs, "pwrite_all", _real_pwrite_all)  # b.pt may be written
        try:
            with pytest.raises(WriteError, match="injected"):
                ckpt.save(_state(), tmp_path / "b.pt")
        finally:
            proceed.set()
        with pytest.raises(WriteError):
            handle.wait(30)  # the owner still sees it
        ckpt.wait(30)  # but the checkpointer raised it once already
    finally:
        proceed.set()
        ckpt.close()


_real_pwrite_all = _fs.pwrite_all


def test_warning_turned_error_does_not_kill_the_committer(tmp_path):
    """Issue 11 item 5: under warnings.simplefilter("error") the backpressure warning used to be
    raised on the committer, killing it: the next wait() hung. It is now issued on the caller."""
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gate = threading.Event()
            handle = ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
            ckpt.pool.wait_s = 10.0  # as if staging had waited 10 s for host buffers
            gate.set()
            handle.wait(30)  # TimeoutError when the committer died
            with pytest.raises(BackpressureWarning):
                ckpt.wait(30)  # issued here, on the caller's thread
            ckpt.save(_state(), tmp_path / "b.pt").wait(30)
    finally:
        ckpt.close()


def test_warnings_are_issued_on_the_callers_thread(tmp_path, monkeypatch):
    threads = []
    real = warnings.warn

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(warnings, "warn", spy)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        gate = threading.Event()
        handle = ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
        ckpt.pool.wait_s = 10.0
        gate.set()
        handle.wait(30)
        with pytest.warns(BackpressureWarning):
            ckpt.wait(30)
    assert threads and not any(name.startswith("lazyckpt-") for name in threads)


def test_a_callback_raising_a_base_exception_does_not_kill_lazyckpt_threads(tmp_path):
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        gate = threading.Event()
        first = ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
        first.add_done_callback(lambda _h: (_ for _ in ()).throw(SystemExit(3)))  # still pending: runs later
        gate.set()
        first.wait(30)
        ckpt.save(_state(), tmp_path / "b.pt").wait(30)  # TimeoutError if the thread died
        ckpt.wait(30)


def test_remover_thread_that_cannot_start_deletes_inline(tmp_path, monkeypatch):
    """Issue 11 item 6: Thread.start() refused (thread limits; interpreter shutdown on 3.12+) after the
    path was renamed away used to leave a future nobody completes: wait() blocked for ever."""
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        path = tmp_path / "a.pt"
        ckpt.save(_state(), path).wait(30)

        def refuse(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")

        monkeypatch.setattr(threading.Thread, "start", refuse)
        fut = ckpt.remove(path)
        ckpt.wait(10)  # TimeoutError (or a hang without a timeout) before the fix
        assert fut.done() and fut.exception() is None
        monkeypatch.undo()
        assert os.listdir(tmp_path) == []


def test_done_callback_may_wait_for_later_saves(tmp_path):
    """Issue 11 item 7: a done-callback that waits for a later save (handle.wait(), ckpt.wait()) used
    to deadlock the committer that has to commit that save. Callbacks run on their own thread now."""
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        gate = threading.Event()
        ha = ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
        hb = ckpt.save(_state(), tmp_path / "b.pt")
        outcome: list[object] = []
        ran = threading.Event()

        def cb(_h):
            try:
                hb.wait(5)
                ckpt.wait(5)
                outcome.append("ok")
            except BaseException as exc:
                outcome.append(exc)
            finally:
                ran.set()

        ha.add_done_callback(cb)
        gate.set()
        assert ran.wait(30)
        assert outcome == ["ok"]


def test_done_callback_may_close_the_checkpointer(tmp_path):
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20)
    gate, closed = threading.Event(), threading.Event()
    ha = ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: gate.wait(30))
    hb = ckpt.save(_state(), tmp_path / "b.pt")
    errors: list[BaseException] = []

    def cb(_h):
        try:
            ckpt.close()
        except BaseException as exc:
            errors.append(exc)
        finally:
            closed.set()

    ha.add_done_callback(cb)
    gate.set()
    assert closed.wait(30)
    assert errors == [] and ckpt.closed and hb.done()
    ckpt.close()  # idempotent; joins what the callback could not join (its own thread)
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]


def test_writer_survives_an_unexpected_error_in_finalisation(tmp_path, monkeypatch):
    """Issue 11 item 5 (loops): an error no step expects (here: os.close raising a non-OSError) used
    to end the writer thread before it marked the file written: the committer then waited for ever."""
    real_close = _fs.close
    fired: list[int] = []

    def close(fd: int) -> None:
        real_close(fd)
        if threading.current_thread().name.startswith("lazyckpt-writer") and not fired:
            fired.append(fd)
            raise RuntimeError("injected")

    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20, writer_threads=1) as ckpt:
        monkeypatch.setattr(_fs, "close", close)
        with pytest.raises(WriteError, match="injected"):
            ckpt.save(_state(), tmp_path / "a.pt").wait(30)
        ckpt.save(_state(), tmp_path / "b.pt").wait(30)  # the one writer is still there
        monkeypatch.undo()
    assert fired and os.listdir(tmp_path) == ["b.pt"]


def test_committer_survives_an_unexpected_error(tmp_path, monkeypatch):
    """A failing cleanup step on the committer (here: discarding a failed save's temporary) used to
    end the committer thread: that handle and every later one never completed."""

    def discard(tmp: str) -> None:
        raise RuntimeError("injected discard failure")

    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        monkeypatch.setattr(_fs, "discard", discard)
        with pytest.raises(WriteError):
            ckpt.save(_state(), tmp_path / "a.pt", before_commit=lambda: 1 / 0).wait(30)
        monkeypatch.undo()
        ckpt.save(_state(), tmp_path / "b.pt").wait(30)
