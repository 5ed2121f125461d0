"""Small disk files are written inside save() when training uses every core (the busy regime).

With every core training (``torch.get_num_threads()`` >= the usable CPUs, CPU tensors), lazyckpt's
background threads take a core from the training's intra-op threads, which wait for the thread
that lost its core at every parallel op's end: for a small checkpoint that disruption cost more
than the whole save (transformers Trainer, 63 MB per checkpoint: 0.06-0.19 s in the background,
0.04 s written in save(), stock 0.07 s). So ``save()`` writes a disk file of at most
``core/plan.INLINE_MAX_BYTES`` of tensor data itself, straight from the tensors, and only the
fsync and the commit run in the background; larger files keep the background's O_DIRECT writes
(cheaper in CPU than a page-cache copy). With a core to spare only a tiny file (``TINY_MAX_BYTES``)
is written in save().

These tests use the product's bound (``busy_rule``; the other tests of this process run with it at
0, see conftest.py).
"""

from __future__ import annotations

import errno
import os
import threading
import zipfile
from pathlib import Path

import pytest
import torch

import lazyckpt
from _util import assert_same, data_writers
from lazyckpt import LazyCheckpointer, WriteError
from lazyckpt.core import plan
from lazyckpt.core.plan import usable_cpus
from lazyckpt.storage import fs as _fs

CPU = [torch.device("cpu")]


@pytest.fixture
def busy(busy_rule):
    """Every usable core trains (the busy regime), the product's bound."""
    torch.set_num_threads(usable_cpus())  # restored by conftest's _torch_threads_restored
    return busy_rule


def _trained(width: int = 512) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return model, opt


def test_the_rule(busy):
    small, large = 1 << 20, plan.INLINE_MAX_BYTES + 1
    assert plan.write_in_save(False, CPU, small)  # a small disk file: in save()
    assert plan.write_in_save(False, CPU, plan.INLINE_MAX_BYTES)
    assert not plan.write_in_save(False, CPU, large)  # a large one: the background's O_DIRECT writes
    assert plan.write_in_save(True, CPU, large)  # a memory filesystem: any size (a write is a memory copy)
    assert not plan.write_in_save(False, CPU, 0)  # no tensor data on a disk: nothing to gain, created by a writer
    assert not plan.write_in_save(False, [torch.device("cuda", 0)], small)  # device tensors: copies overlap
    assert not plan.write_in_save(True, [torch.device("cpu"), torch.device("cuda", 0)], small)
    if usable_cpus() >= 2:
        torch.set_num_threads(1)  # a core to spare: the background overlap is free
        assert not plan.write_in_save(False, CPU, 2 * small)
        assert not plan.write_in_save(True, CPU, large)
        assert plan.write_in_save(False, CPU, plan.TINY_MAX_BYTES)  # but not worth a tiny file's handoffs
        assert plan.write_in_save(True, CPU, plan.TINY_MAX_BYTES)
        assert not plan.write_in_save(False, [torch.device("cuda", 0)], plan.TINY_MAX_BYTES)


def test_a_small_disk_file_is_written_inside_save_and_committed_in_the_background(tmp_path, busy, monkeypatch):
    model, opt = _trained()
    path = tmp_path / "c.pt"
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    writers = data_writers(monkeypatch)
    fsynced, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:  # the commit waits here: the save is in flight
        fsynced.set()
        assert release.wait(30)
        real_fsync(fd)

    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        monkeypatch.setattr(os, "fsync", held_fsync)
        h = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, path)
        assert writers and set(writers) == {threading.current_thread().name}  # all data written in save()
        assert fsynced.wait(30)  # the background reached the commit ...
        assert not path.exists()  # ... and the final name does not exist before it
        model(torch.randn(4, 512)).sum().backward()
        opt.step()  # nothing guarded: the step does not wait, and changes nothing the file holds
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        release.set()
        stats = h.wait()
    assert stats.guard_wait_s == 0.0
    assert_same(torch.load(path, weights_only=True)["model"], expected["model"])
    assert zipfile.ZipFile(path).testzip() is None
    lazyckpt.verify(path)
    assert os.listdir(tmp_path) == ["c.pt"]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_many_small_tensors_written_inside_save_are_gathered_between_lazy_ones(tmp_path, busy, fmt):
    """Small tensors written inside save() go in runs, one pwrite per run of them adjacent in the file
    (``Engine.write_now_all``); a large one and the optimizer's (copied in the background) break the runs.
    The file reads back exactly (torch.load / safetensors), its CRCs verify."""
    import safetensors.torch

    model, opt = _trained(64)
    small = {f"s{i}": torch.full((i % 7 + 1,), float(i)) for i in range(200)}
    large = torch.arange(300_000, dtype=torch.float32)  # past the gathering bound: written alone
    obj = {**{f"p{i}": p for i, p in enumerate(model.parameters())}, **small, "large": large}
    path = tmp_path / ("c.pt" if fmt == "torch" else "c.safetensors")
    expected = {k: v.detach().clone() for k, v in obj.items()}
    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)  # the parameters: lazy, between the small ones in the file
        ckpt.save({k: v.detach() for k, v in obj.items()}, path, format=fmt).wait()
    got = torch.load(path, weights_only=True) if fmt == "torch" else safetensors.torch.load_file(str(path))
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert lazyckpt.verify(path).ok


def test_a_file_above_the_bound_keeps_the_background_writes(tmp_path, busy, monkeypatch):
    model, opt = _trained()
    monkeypatch.setattr(plan, "INLINE_MAX_BYTES", 1 << 20)  # the model and its AdamW state are ~25 MB
    writers = data_writers(monkeypatch)
    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c.pt").wait()
    assert writers and all(name.startswith("lazyckpt-") for name in writers)
    lazyckpt.verify(str(tmp_path / "c.pt"))


def test_a_spare_core_keeps_the_background_writes(tmp_path, busy_rule, monkeypatch):
    if usable_cpus() < 2:
        pytest.skip("needs 2 CPUs to leave one spare")
    torch.set_num_threads(1)
    model, opt = _trained()
    writers = data_writers(monkeypatch)
    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c.pt").wait()
    assert writers and all(name.startswith("lazyckpt-") for name in writers)


def test_a_tiny_file_is_written_inside_save_with_a_core_to_spare_too(tmp_path, busy_rule, monkeypatch):
    if usable_cpus() < 2:
        pytest.skip("needs 2 CPUs to leave one spare")
    torch.set_num_threads(1)
    model, opt = _trained(width=64)  # ~200 KB with its AdamW state
    writers = data_writers(monkeypatch)
    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        expected = {"model": model.state_dict(), "optim": opt.state_dict()}
        ckpt.save(expected, tmp_path / "c.pt").wait()
    assert writers and set(writers) == {threading.current_thread().name}
    assert_same(torch.load(tmp_path / "c.pt"), expected)


def test_a_failed_write_inside_save_fails_that_save_loudly_and_leaves_no_file(tmp_path, busy, monkeypatch):
    model, opt = _trained()
    real = _fs.pwrite_all
    seen: list[str] = []

    def full(fd, data, offset):  # type: ignore[no-untyped-def]
        if len(memoryview(data)) >= 64 << 10:
            seen.append(threading.current_thread().name)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        monkeypatch.setattr(_fs, "pwrite_all", full)
        h = ckpt.save({"model": model.state_dict()}, tmp_path / "c.pt")  # returns; fails in the handle
        assert seen == [threading.current_thread().name]  # the failing write was save()'s own
        with pytest.raises(WriteError) as info:
            h.wait()
        assert info.value.errno == errno.ENOSPC
        assert os.listdir(tmp_path) == []  # no file at the final name, the temporary file removed
        monkeypatch.setattr(_fs, "pwrite_all", real)
        ckpt.save({"model": model.state_dict()}, tmp_path / "c.pt").wait()  # usable again
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_failed_creation_inside_save_fails_the_save_in_its_handle(tmp_path, busy, monkeypatch):
    """A small disk file is created inside save() in this regime: a full disk (ENOSPC from the
    reservation) still fails the save in its handle, as a writer's creation does, never in save()."""
    model, opt = _trained()
    created: list[str] = []

    def full(tmp, size):  # type: ignore[no-untyped-def]
        created.append(threading.current_thread().name)
        raise OSError(errno.ENOSPC, "No space left on device")

    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        monkeypatch.setattr(_fs, "open_temporary", full)
        h = ckpt.save({"model": model.state_dict()}, tmp_path / "c.pt")  # returns
        assert created == [threading.current_thread().name]  # created (tried) inside save()
        with pytest.raises(WriteError, match="cannot create") as info:
            h.wait()
        assert info.value.errno == errno.ENOSPC
        monkeypatch.undo()
        ckpt.save({"model": model.state_dict()}, tmp_path / "c.pt").wait()  # usable again
    assert os.listdir(tmp_path) == ["c.pt"]


def test_an_explicit_direct_io_keeps_the_background_writes(tmp_path, busy, monkeypatch):
    model, opt = _trained()
    writers = data_writers(monkeypatch)
    with LazyCheckpointer(direct_io=True) as ckpt:
        ckpt.track(opt)
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c.pt").wait()
    assert writers and all(name.startswith("lazyckpt-") for name in writers)


@pytest.mark.integration
def test_transformers_trainer_checkpoints_in_the_busy_regime_equal_stock(tmp_path: Path, busy, monkeypatch):
    """The case that made the rule: the Trainer's checkpoint-N files written in save(), equal to stock's."""
    pytest.importorskip("transformers")
    from test_transformers import assert_same_checkpoints, stock_and_lazy

    decided: list[bool] = []
    rule = plan.write_in_save

    def spy(memory, devices, nbytes=0):  # type: ignore[no-untyped-def]
        decided.append(rule(memory, devices, nbytes))
        return decided[-1]

    monkeypatch.setattr(plan, "write_in_save", spy)
    stock, lazy = stock_and_lazy(tmp_path, save_total_limit=2)
    assert decided and all(decided)  # every file of every checkpoint-N written in save()
    assert assert_same_checkpoints(stock, lazy) == ["checkpoint-4", "checkpoint-6"]
    for name in ("model.safetensors", "optimizer.pt"):  # by the writer stock calls: stock's very bytes
        assert (lazy / "checkpoint-6" / name).read_bytes() == (stock / "checkpoint-6" / name).read_bytes()
