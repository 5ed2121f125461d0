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
from _util import assert_same, data_writers
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


def test_every_core_busy_writes_inside_save_from_the_tensors(shm, threads, monkeypatch):
    threads(_usable_cpus())
    model, opt = _trained()
    path = os.path.join(shm, "c.pt")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writers = data_writers(monkeypatch)
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
    writers = data_writers(monkeypatch)
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


def _max_concurrent_writes(folder: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """Save 8 tensors of 4 MiB (8 pieces for 4 writer threads) into ``folder``; the first data
    write waits (at most 2 s) for a second one to start alongside it. The most writes seen at once."""
    real = _fs.pwrite_all
    lock, inside, most = threading.Lock(), [0], [0]
    second = threading.Event()

    def pwrite_all(fd: int, data, offset: int) -> None:  # type: ignore[no-untyped-def]
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] > 1:
                second.set()
        try:
            if len(data) >= 1 << 20:
                second.wait(2.0)  # the window: another writer would write now if it may
            real(fd, data, offset)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(_fs, "pwrite_all", pwrite_all)
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core to spare: the writers write (not save() itself, see above)
    try:
        with LazyCheckpointer(writer_threads=4, chunk_bytes=4 << 20, host_memory_budget=64 << 20) as ck:
            ck.save(state, os.path.join(folder, "s.pt")).wait()
    finally:
        torch.set_num_threads(threads)
    assert_same(torch.load(os.path.join(folder, "s.pt"), weights_only=True), state)
    return most[0]


@pytest.mark.slow(reason="two processes contend for one memory-filesystem file")
def test_a_memory_filesystem_file_has_one_writer_at_a_time(shm, monkeypatch):
    """The kernel serialises writes to one tmpfs file; parallel writers only spin on its lock and
    take CPU from the training (4 writers: 2x the CPU of 1 for a 1.17 GB file here)."""
    assert _max_concurrent_writes(shm, monkeypatch) == 1


def test_a_memory_filesystem_file_is_written_by_one_thread_not_the_pool(shm, tmp_path, monkeypatch):
    """Not only one write at a time: one thread (``lazyckpt-writer-memory``) takes every piece of a
    memory filesystem's file, so the pool's writers do not wake, take the GIL and sleep on the
    file's lock for each piece (beside a training thread on one spare core, that cost 0.03 s per
    step of waiting for a core). A disk file's pieces still go to the pool."""
    real = _fs.pwrite_all
    writers: dict[str, set[str]] = {}

    def pwrite_all(fd: int, data, offset: int) -> None:  # type: ignore[no-untyped-def]
        where = os.readlink(f"/proc/self/fd/{fd}")
        writers.setdefault(os.path.dirname(where), set()).add(threading.current_thread().name)
        real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", pwrite_all)
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core to spare: the writers write (not save() itself)
    try:
        with LazyCheckpointer(writer_threads=4, chunk_bytes=1 << 20, host_memory_budget=64 << 20,
                              direct_io=False) as ck:  # fmt: skip
            ck.save(state, os.path.join(shm, "m.pt")).wait()
            ck.save(state, str(tmp_path / "d.pt")).wait()
    finally:
        torch.set_num_threads(threads)
    assert writers[shm] == {"lazyckpt-writer-memory"}, writers
    assert "lazyckpt-writer-memory" not in writers[str(tmp_path)], writers
    for name in ("m.pt", "d.pt"):
        folder = shm if name == "m.pt" else str(tmp_path)
        assert_same(torch.load(os.path.join(folder, name), weights_only=True), state)


def test_a_disk_file_has_parallel_writers(tmp_path, monkeypatch):
    """The control: the window above is real (a disk file's pieces are written in parallel)."""
    assert not _fs.is_memory_filesystem(str(tmp_path))
    assert _max_concurrent_writes(str(tmp_path), monkeypatch) >= 2
