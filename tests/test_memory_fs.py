"""Saves to a memory filesystem (tmpfs) while training uses every core are written inside save().

There a write is a memory copy: on a background thread it takes a core from the training's intra-op
threads (issue 15: lazyckpt's stall on /dev/shm was 1.15x torch.save's in that regime), so the
checkpointer writes the file on the caller's thread, straight from the tensors, and commits it in the
background. With a core to spare, nothing changes.
"""

from __future__ import annotations

import errno
import os
import threading
import zipfile

import pytest
import torch

import lazyckpt
from _util import assert_same
from lazyckpt import LazyCheckpointer, WriteError
from lazyckpt.core.plan import usable_cpus as _usable_cpus
from lazyckpt.storage import fs as _fs

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(
    not (os.path.isdir(SHM) and os.access(SHM, os.W_OK) and _fs.is_memory_filesystem(SHM)),
    reason="no writable tmpfs at /dev/shm",
)


@pytest.fixture
def shm(tmp_path):
    d = os.path.join(SHM, f"lazyckpt-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(d)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


def _data_writes(monkeypatch) -> list[str]:
    """Names of the threads that write tensor data (pieces of at least 64 KiB) from now on."""
    writers: list[str] = []
    real = _fs.pwrite_all

    def pwrite_all(fd, data, offset):
        if len(memoryview(data)) >= 64 << 10:
            writers.append(threading.current_thread().name)
        real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", pwrite_all)
    return writers


def test_every_core_busy_writes_inside_save_from_the_tensors(shm, threads, monkeypatch):
    threads(_usable_cpus())
    model, opt = _trained()
    path = os.path.join(shm, "c.pt")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writers = _data_writes(monkeypatch)
    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        h = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, path)
        assert writers and set(writers) == {threading.current_thread().name}  # all data written in save()
        with torch.no_grad():
            for p in model.parameters():  # through .data: no save with lazy copies could see this
                p.data.add_(1.0)
        stats = h.wait()
    assert stats.guard_wait_s == 0.0
    assert_same(torch.load(path, weights_only=True)["model"], expected)
    assert zipfile.ZipFile(path).testzip() is None
    lazyckpt.verify(path)
    assert os.listdir(shm) == ["c.pt"]


def test_a_spare_core_keeps_the_background_writes(shm, threads, monkeypatch):
    if _usable_cpus() < 2:
        pytest.skip("needs 2 CPUs to leave one spare")
    threads(1)
    model, opt = _trained()
    writers = _data_writes(monkeypatch)
    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(shm, "c.pt")).wait()
    assert writers and all(name.startswith("lazyckpt-") for name in writers)


def test_a_failed_write_inside_save_fails_that_save_only(shm, threads, monkeypatch):
    threads(_usable_cpus())
    model, opt = _trained()
    real = _fs.pwrite_all

    def full(fd, data, offset):
        if len(memoryview(data)) >= 64 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    with LazyCheckpointer() as ckpt:
        ckpt.track(opt)
        monkeypatch.setattr(_fs, "pwrite_all", full)
        h = ckpt.save({"model": model.state_dict()}, os.path.join(shm, "c.pt"))  # returns; fails in the handle
        with pytest.raises(WriteError) as info:
            h.wait()
        assert info.value.errno == errno.ENOSPC
        monkeypatch.setattr(_fs, "pwrite_all", real)
        ckpt.save({"model": model.state_dict()}, os.path.join(shm, "c.pt")).wait()  # usable again
    assert os.listdir(shm) == ["c.pt"]  # the failed save's temporary file is gone
