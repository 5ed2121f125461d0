"""Injected write faults and bad input: typed errors, nothing partial at the final path,
temporary files removed, the previous checkpoint intact, the checkpointer still usable."""

from __future__ import annotations

import errno
import os
import pathlib
import threading
import warnings

import pytest
import torch

from _util import assert_same
from lazyckpt import BackpressureWarning, CheckpointerClosedError, LazyCheckpointer, SaveRefusedError, WriteError
from lazyckpt.core.handle import wait_finished
from lazyckpt.storage import fs as _fs

PREVIOUS = {"previous": torch.arange(10)}


def _prepare(ckpt, tmp_path):
    ckpt.save(PREVIOUS, tmp_path / "c.pt").wait()


def _assert_previous_intact(tmp_path):
    assert sorted(os.listdir(tmp_path)) == ["c.pt"], "temporary files must be removed"
    assert_same(torch.load(tmp_path / "c.pt"), PREVIOUS)


def _state():
    return {"w": torch.randn(200_000), "b": torch.randn(1000), "step": 7}


def _failing_pwrite(monkeypatch, exc, after=0):
    real = _fs.pwrite_all
    calls = {"n": 0}

    def fake(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > after:
            raise exc
        return real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", fake)
    return lambda: monkeypatch.setattr(_fs, "pwrite_all", real)


@pytest.mark.parametrize(
    "exc, code",
    [
        (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
        (OSError(errno.EIO, "Input/output error"), errno.EIO),
        (RuntimeError("writer blew up"), None),
    ],
    ids=["ENOSPC", "EIO", "writer-raises"],
)
def test_write_fault_part_way(ckpt, tmp_path, monkeypatch, exc, code):
    _prepare(ckpt, tmp_path)
    heal = _failing_pwrite(monkeypatch, exc, after=2)
    h = ckpt.save(_state(), tmp_path / "c.pt")
    with pytest.raises(WriteError) as info:
        h.wait()
    assert info.value.errno == code and info.value.__cause__ is exc
    assert info.value.path == str(tmp_path / "c.pt")
    _assert_previous_intact(tmp_path)
    heal()
    state = _state()
    ckpt.save(state, tmp_path / "c.pt").wait()  # usable again once the fault is gone
    assert_same(torch.load(tmp_path / "c.pt"), state)


def test_eio_on_fsync(ckpt, tmp_path, monkeypatch):
    _prepare(ckpt, tmp_path)
    real = _fs.fsync

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_fs, "fsync", fsync)
    with pytest.raises(WriteError) as info:
        ckpt.save(_state(), tmp_path / "c.pt").wait()
    assert info.value.errno == errno.EIO
    monkeypatch.setattr(_fs, "fsync", real)
    _assert_previous_intact(tmp_path)


def test_short_writes_still_produce_a_correct_file(ckpt, tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real(fd, memoryview(data)[: max(1, len(data) // 3)], off))
    state = _state()
    ckpt.save(state, tmp_path / "c.pt").wait()
    monkeypatch.setattr(os, "pwrite", real)
    assert_same(torch.load(tmp_path / "c.pt"), state)


def test_zero_byte_write_is_an_error(ckpt, tmp_path, monkeypatch):
    _prepare(ckpt, tmp_path)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: 0)
    with pytest.raises(WriteError):
        ckpt.save(_state(), tmp_path / "c.pt").wait()
    monkeypatch.undo()
    _assert_previous_intact(tmp_path)


def test_unobserved_error_surfaces_from_next_save(ckpt, tmp_path, monkeypatch):
    heal = _failing_pwrite(monkeypatch, OSError(errno.ENOSPC, "full"))
    h = ckpt.save(_state(), tmp_path / "a.pt")
    wait_finished(h)  # wait for the failure without observing it (as a user who never calls h.wait())
    heal()
    with pytest.raises(WriteError):
        ckpt.save(_state(), tmp_path / "b.pt")
    ckpt.save(_state(), tmp_path / "b.pt").wait()  # reported once, then usable


def test_error_surfaces_from_wait_and_close(tmp_path, monkeypatch):
    heal = _failing_pwrite(monkeypatch, OSError(errno.EIO, "bad disk"))
    c = LazyCheckpointer()
    c.save(_state(), tmp_path / "a.pt")
    with pytest.raises(WriteError):
        c.wait()
    c.wait()  # already reported
    c.save(_state(), tmp_path / "b.pt")
    with pytest.raises(WriteError):
        c.close()
    heal()
    assert c.closed and os.listdir(tmp_path) == []
    with pytest.raises(CheckpointerClosedError):
        c.save(_state(), tmp_path / "c.pt")


def test_error_reported_by_handle_is_not_raised_again(ckpt, tmp_path, monkeypatch):
    heal = _failing_pwrite(monkeypatch, OSError(errno.EIO, "bad disk"))
    with pytest.raises(WriteError):
        ckpt.save(_state(), tmp_path / "a.pt").wait()
    heal()
    ckpt.wait()
    ckpt.save(_state(), tmp_path / "a.pt").wait()


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this")


def _bad_inputs():
    with warnings.catch_warnings():  # torch deprecates quantized tensors; users still have them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)

    class Sub(torch.Tensor):
        pass

    return {
        "lambda": {"f": lambda x: x},
        "unpicklable": {"x": _Unpicklable()},
        "sparse": {"s": torch.randn(3, 3).to_sparse()},
        "meta": {"m": torch.empty(3, device="meta")},
        "quantized": {"q": q},
        "subclass": {"t": torch.randn(2).as_subclass(Sub)},
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_input_refused_at_save(ckpt, tmp_path, name):
    obj = _bad_inputs()[name]
    with pytest.raises(SaveRefusedError) as info:
        ckpt.save(obj, tmp_path / "c.pt")
    assert len(str(info.value)) > 20
    assert os.listdir(tmp_path) == []


def test_bad_safetensors_input(ckpt, tmp_path):
    base = torch.randn(4, 4)
    cases = [
        {"nested": {"a": torch.ones(1)}},
        {"t": base.t()},  # non-contiguous
        {"a": base, "b": base[1]},  # shared memory
        [torch.ones(1)],
    ]
    for obj in cases:
        with pytest.raises(SaveRefusedError):
            ckpt.save(obj, tmp_path / "m.safetensors", format="safetensors")
    with pytest.raises(SaveRefusedError):
        ckpt.save({"a": torch.ones(1)}, tmp_path / "x", format="zip")
    assert os.listdir(tmp_path) == []


def test_bad_paths(ckpt, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SaveRefusedError, match="directory"):
        ckpt.save({"a": 1}, tmp_path / "adir")
    with pytest.raises(SaveRefusedError, match="no usable filesystem"):  # URLs: test_remote.py
        ckpt.save({"a": 1}, "nosuchproto://bucket/key.ckpt")
    with pytest.raises(SaveRefusedError):
        ckpt.save({"a": 1}, tmp_path / "afile" / "below.pt")  # parent is a file
    with pytest.raises(SaveRefusedError):
        ckpt.save({"a": 1}, 42)  # type: ignore[arg-type]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_directory(ckpt, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises((SaveRefusedError, WriteError)):
        ckpt.save({"a": 1}, ro / "c.pt")


def test_str_and_path_paths(ckpt, tmp_path):
    ckpt.save({"a": 1}, str(tmp_path / "s.pt")).wait()
    ckpt.save({"a": 2}, pathlib.Path(tmp_path) / "p.pt").wait()
    ckpt.save({"a": 3}, tmp_path / "nested" / "dirs" / "n.pt").wait()
    assert torch.load(tmp_path / "nested" / "dirs" / "n.pt") == {"a": 3}


def test_requires_grad_and_non_leaf_tensors(ckpt, tmp_path):
    leaf = torch.randn(3, requires_grad=True)
    non_leaf = leaf * 2
    ckpt.save({"leaf": leaf, "non_leaf": non_leaf}, tmp_path / "g.pt").wait()
    got = torch.load(tmp_path / "g.pt")
    assert got["leaf"].requires_grad and torch.equal(got["non_leaf"], non_leaf.detach())


def test_checkpoint_larger_than_budget_streams(tmp_path):
    state = {"w": torch.randn(1_000_000)}  # 4 MB through 256 KiB of buffers
    with LazyCheckpointer(host_memory_budget=256 << 10, chunk_bytes=64 << 10) as c:
        c.save(state, tmp_path / "big.pt").wait()
        assert c.pool.allocated_bytes <= 256 << 10
    assert_same(torch.load(tmp_path / "big.pt"), state)


def test_skip_policy_counts_and_warns(tmp_path, monkeypatch):
    from _util import WriteGate

    gate = WriteGate(monkeypatch)
    with LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=256 << 10, on_backpressure="skip") as c:
        first = c.save({"w": torch.randn(200_000)}, tmp_path / "a.pt")
        with pytest.warns(BackpressureWarning, match="skipped"):
            second = c.save({"w": torch.randn(200_000)}, tmp_path / "b.pt")
        assert second.done() and second.wait().skipped and c.skipped_saves == 1
        gate.release()
        first.wait()
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]


def test_close_drains_pending_saves(tmp_path):
    c = LazyCheckpointer()
    handles = [c.save({"i": i, "t": torch.randn(10_000)}, tmp_path / f"{i}.pt") for i in range(10)]
    c.close()
    assert all(h.done() for h in handles)
    assert len(os.listdir(tmp_path)) == 10


def test_stale_temporaries_of_dead_processes_are_cleaned(tmp_path):
    from lazyckpt.storage.fs import host_tag

    dead = tmp_path / f".c.pt.lazyckpt-{host_tag()}-999999999-0.tmp"
    mine = tmp_path / f".c.pt.lazyckpt-{host_tag()}-{os.getpid()}-99999.tmp"
    dead.write_bytes(b"partial")
    mine.write_bytes(b"in flight")
    with LazyCheckpointer() as c:
        c.save({"a": 1}, tmp_path / "c.pt").wait()
    assert not dead.exists() and mine.exists()


def test_before_commit_runs_before_the_rename(ckpt, tmp_path):
    seen = []
    path = tmp_path / "c.pt"
    h = ckpt.save({"w": torch.randn(1000)}, path, before_commit=lambda: seen.append(path.exists()))
    h.wait()
    assert seen == [False] and path.exists()


def test_before_commit_failure_fails_the_save(ckpt, tmp_path):
    _prepare(ckpt, tmp_path)

    def refuse():
        raise OSError(errno.EIO, "marker not durable")

    h = ckpt.save({"w": torch.randn(1000)}, tmp_path / "c.pt", before_commit=refuse)
    with pytest.raises(WriteError, match="marker not durable") as info:
        h.wait()
    assert isinstance(info.value.__cause__, OSError)
    _assert_previous_intact(tmp_path)


def test_save_does_not_wait_for_the_file_to_be_created(ckpt, tmp_path, monkeypatch):
    """Creating and fallocating the temporary file can wait 0.1-0.4 s on an ext4 journal while the
    previous checkpoint is written and fsynced: a writer does it, not save() (with a core to spare,
    or a file above the busy regime's bound: conftest.py sets it to 0 here; below it, every core
    training, save() writes and so creates the file itself, test_busy_regime.py). The creation is held
    here until save() returned (with the creation back in save(), save() would sit there until the
    watchdog lets it go, and the test fails)."""
    _prepare(ckpt, tmp_path)
    gate, real = threading.Event(), _fs.open_temporary
    watchdog = threading.Timer(10, gate.set)

    def held(tmp, size):
        assert gate.wait(30)
        return real(tmp, size)

    monkeypatch.setattr(_fs, "open_temporary", held)
    state = _state()
    watchdog.start()
    try:
        h = ckpt.save(state, tmp_path / "c.pt")
        returned_first = not gate.is_set()
    finally:
        gate.set()
        watchdog.cancel()
    h.wait()
    assert returned_first
    assert_same(torch.load(tmp_path / "c.pt"), state)


def test_failed_creation_fails_the_save_in_its_handle(ckpt, tmp_path, monkeypatch):
    _prepare(ckpt, tmp_path)

    def full(tmp, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs, "open_temporary", full)
    h = ckpt.save(_state(), tmp_path / "c.pt")
    with pytest.raises(WriteError, match="cannot create") as info:
        h.wait()
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    _assert_previous_intact(tmp_path)
    ckpt.save(_state(), tmp_path / "d.pt").wait()  # usable again
