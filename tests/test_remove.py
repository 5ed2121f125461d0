"""LazyCheckpointer.remove: the name is free at once (or, behind a pending save to it, right after that
save commits: ordered in the commit queue), the space is freed in the background, errors reach wait()
once, and leftovers of a killed process are cleaned."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import pytest
import torch

from lazyckpt import LazyCheckpointer, cleanup_temporaries
from lazyckpt.core import removal as _remove
from lazyckpt.storage import fs as _fs


def test_file_is_gone_at_once_and_deleted_after_wait(ckpt, tmp_path):
    path = tmp_path / "a.pt"
    ckpt.save({"w": torch.randn(1000)}, path).wait()
    fut = ckpt.remove(path)
    assert not path.exists()
    ckpt.wait()
    assert fut.done() and fut.exception() is None
    assert os.listdir(tmp_path) == []


def test_folder_goes_to_trash_dir_and_is_deleted(ckpt, tmp_path):
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    folder.mkdir(parents=True)
    ckpt.save({"w": torch.randn(1000)}, folder / "model.bin").wait()
    (folder / "sub").mkdir()
    (folder / "sub" / "x").write_bytes(b"x")
    ckpt.remove(folder, trash_dir=tmp_path)
    assert os.listdir(tmp_path / "checkpoints") == []
    ckpt.wait()
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_symlink_is_unlinked_target_kept(ckpt, tmp_path):
    target = tmp_path / "t.pt"
    ckpt.save({"w": torch.ones(3)}, target).wait()
    link = tmp_path / "last.pt"
    link.symlink_to(target.name)
    ckpt.remove(link).result(timeout=10)
    assert not os.path.lexists(link) and target.exists()


def test_missing_path_raises(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.remove(tmp_path / "nope.pt")


def _held_writes(monkeypatch):
    """Hold every pwrite until the returned event is set: saves stay pending meanwhile."""

    gate = threading.Event()
    real = _fs.pwrite_all

    def held(fd, data, offset):
        gate.wait(30)
        return real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", held)
    return gate


def test_remove_of_a_pending_save_returns_at_once_and_follows_its_commit(tmp_path, monkeypatch):
    """The delete is ordered in the commit queue: after the pending save to the path commits, before
    a later save to it; remove() itself never waits."""
    gate = _held_writes(monkeypatch)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        path = tmp_path / "a.pt"
        first = ckpt.save({"w": torch.full((100_000,), 1.0)}, path)
        fut = ckpt.remove(path)  # returns although the save is held
        assert not fut.done() and not first.done()
        later = ckpt.save({"w": torch.full((100_000,), 2.0)}, path)
        gate.set()
        first.wait(30)
        later.wait(30)
        assert fut.result(timeout=30) is None
        ckpt.wait(30)
        assert torch.load(path)["w"][0].item() == 2.0  # the later save survives the delete
        assert os.listdir(tmp_path) == ["a.pt"]


def test_remove_of_a_folder_follows_every_pending_save_into_it(tmp_path, monkeypatch):
    gate = _held_writes(monkeypatch)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        folder = tmp_path / "checkpoint_0"
        handles = [ckpt.save({"w": torch.randn(10_000)}, folder / f"{i}.bin") for i in range(3)]
        fut = ckpt.remove(folder, trash_dir=tmp_path)
        assert not fut.done()
        gate.set()
        for h in handles:
            h.wait(30)
        ckpt.wait(30)
        assert fut.done() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("trash", ["renamed", "other_filesystem"])
def test_remove_of_a_folder_keeps_a_later_save_into_it(tmp_path, monkeypatch, trash):
    """A save into the folder started after remove() writes its temporary there while the removal
    waits for the earlier save: the removal takes the folder away without that later save's
    temporary, and the later save commits into the same folder name."""
    gate = _held_writes(monkeypatch)
    if trash == "other_filesystem":  # the folder cannot be renamed: deleted in place
        real_rename = _fs.rename

        def exdev(src, dst):
            if os.path.basename(src) == "checkpoint_0":
                raise OSError(errno.EXDEV, "cross-device link")
            real_rename(src, dst)

        monkeypatch.setattr(_fs, "rename", exdev)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        folder = tmp_path / "checkpoint_0"
        first = ckpt.save({"w": torch.full((10_000,), 1.0)}, folder / "a.bin")
        fut = ckpt.remove(folder, trash_dir=tmp_path)
        later = ckpt.save({"w": torch.full((10_000,), 2.0)}, folder / "b.bin")
        gate.set()
        first.wait(30)
        later.wait(30)
        assert fut.result(timeout=30) is None
        ckpt.wait(30)
        assert os.listdir(tmp_path) == ["checkpoint_0"]
        assert os.listdir(folder) == ["b.bin"]
        assert torch.load(folder / "b.bin")["w"][0].item() == 2.0


def test_remove_behind_a_failed_save_of_a_new_path_has_nothing_to_delete(tmp_path, monkeypatch):
    """The path is missing when the removal's turn comes (the save failed, nothing was there): the
    removal completes quietly; the save's error is raised once, by the save's own reporting."""
    from lazyckpt.errors import WriteError

    gate = threading.Event()

    def fail(fd, data, offset):
        gate.wait(30)
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(_fs, "pwrite_all", fail)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        path = tmp_path / "a.pt"
        handle = ckpt.save({"w": torch.randn(10_000)}, path)
        fut = ckpt.remove(path)
        gate.set()
        assert fut.result(timeout=30) is None
        with pytest.raises(WriteError, match="injected"):
            ckpt.wait(30)
        ckpt.wait(30)  # once
        assert handle.exception() is not None and os.listdir(tmp_path) == []


def test_background_failure_is_raised_by_wait(ckpt, tmp_path, monkeypatch):
    path = tmp_path / "a.pt"
    ckpt.save({"w": torch.ones(3)}, path).wait()

    def boom(p):
        raise PermissionError(errno.EACCES, "injected", p)

    monkeypatch.setattr(_remove, "_delete", boom)
    fut = ckpt.remove(path)
    with pytest.raises(PermissionError, match="injected"):
        ckpt.wait()
    assert isinstance(fut.exception(), PermissionError)
    ckpt.wait()  # raised once
    monkeypatch.undo()
    cleanup_temporaries(tmp_path)  # our own pid: kept
    assert len(os.listdir(tmp_path)) == 1


def test_other_filesystem_deletes_in_place(ckpt, tmp_path, monkeypatch):
    path = tmp_path / "a.pt"
    ckpt.save({"w": torch.ones(3)}, path).wait()

    def exdev(src, dst):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(_fs, "rename", exdev)
    fut = ckpt.remove(path)
    assert fut.done() and not path.exists()


def test_close_drains_removals(tmp_path):
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20)
    for i in range(3):
        ckpt.save({"w": torch.randn(10_000)}, tmp_path / f"{i}.pt").wait()
        ckpt.remove(tmp_path / f"{i}.pt")
    ckpt.close()
    assert os.listdir(tmp_path) == []


def test_trash_of_a_killed_process_is_cleaned(tmp_path):
    """A process killed between the rename and the delete leaves a hidden temporary; the next
    cleanup_temporaries in that directory removes it (folders included)."""
    code = (
        "import os, sys, torch\n"
        "from lazyckpt import LazyCheckpointer\nfrom lazyckpt.core import removal as _remove\n"
        "_remove._delete = lambda p: os._exit(0)\n"  # die in the background delete
        "c = LazyCheckpointer(host_memory_budget=1 << 24, chunk_bytes=1 << 20)\n"
        "d = os.path.join(sys.argv[1], 'checkpoints', 'checkpoint_0')\n"
        "os.makedirs(d)\n"
        "c.save({'w': torch.ones(3)}, os.path.join(d, 'model.bin')).wait()\n"
        "c.remove(d, trash_dir=sys.argv[1]).result(timeout=60)\n"  # the background delete exits first
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    left = [n for n in os.listdir(tmp_path) if n != "checkpoints"]
    assert len(left) == 1 and left[0].startswith(".checkpoint_0.lazyckpt-")
    assert os.path.isdir(tmp_path / left[0])
    removed = cleanup_temporaries(tmp_path)
    assert [os.path.basename(p) for p in removed] == left
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]


def test_remove_from_a_done_callback_of_a_pending_path_is_ordered_not_refused(tmp_path):
    """A done-callback of a's save removes b while b's save is still pending: remove() returns at
    once (it used to have to refuse: waiting there would have deadlocked), and b goes after it commits."""
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        a, b = tmp_path / "a.pt", tmp_path / "b.pt"
        registered, ran = threading.Event(), threading.Event()
        outcome = []

        def cb(_h):
            try:
                outcome.append(ckpt.remove(b))
            except BaseException as exc:
                outcome.append(exc)
            finally:
                ran.set()

        ha = ckpt.save({"w": torch.randn(1000)}, a, before_commit=lambda: registered.wait(30))
        hb = ckpt.save({"w": torch.randn(1000)}, b, before_commit=lambda: ran.wait(30))
        ha.add_done_callback(cb)
        registered.set()
        assert ran.wait(30)
        hb.wait(30)
        ckpt.wait(30)
        assert len(outcome) == 1 and not isinstance(outcome[0], BaseException)
        assert outcome[0].result(timeout=30) is None
        assert os.listdir(tmp_path) == ["a.pt"]


def test_a_failed_deletion_is_not_forgotten_by_later_removes(ckpt, tmp_path, monkeypatch):
    for name in ("a.pt", "b.pt"):
        ckpt.save({"w": torch.ones(3)}, tmp_path / name).wait()
    real = _remove._delete

    def fail_a(p):
        if ".a.pt." in p:
            raise PermissionError(errno.EACCES, "injected", p)
        return real(p)

    monkeypatch.setattr(_remove, "_delete", fail_a)
    fa = ckpt.remove(tmp_path / "a.pt")
    while not fa.done():  # settle it before the next remove() prunes its list
        threading.Event().wait(0.01)
    ckpt.remove(tmp_path / "b.pt")
    with pytest.raises(PermissionError, match="injected"):
        ckpt.wait()


def test_an_error_fetched_from_the_future_is_not_raised_again(ckpt, tmp_path, monkeypatch):
    ckpt.save({"w": torch.ones(3)}, tmp_path / "a.pt").wait()
    monkeypatch.setattr(_remove, "_delete", lambda p: (_ for _ in ()).throw(PermissionError("injected")))
    fut = ckpt.remove(tmp_path / "a.pt")
    assert isinstance(fut.exception(timeout=30), PermissionError)
    ckpt.wait()  # already seen by its owner
