"""LazyCheckpointer.remove: the name is free at once, the space is freed in the background, a pending
save to the path is never raced, errors reach wait(), and leftovers of a killed process are cleaned."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import pytest
import torch

from lazyckpt import LazyCheckpointer, _remove, cleanup_temporaries


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


def test_waits_for_a_pending_save_to_the_path(tmp_path, monkeypatch):
    """A remove issued while the save is still writing deletes the committed file, never races it."""
    from lazyckpt import _engine

    gate = threading.Event()
    real = _engine.pwrite_all

    def slow(fd, data, offset):
        gate.wait(30)
        return real(fd, data, offset)

    monkeypatch.setattr(_engine, "pwrite_all", slow)
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        path = tmp_path / "a.pt"
        handle = ckpt.save({"w": torch.randn(100_000)}, path)
        done = threading.Event()

        def remover():
            ckpt.remove(path)
            done.set()

        t = threading.Thread(target=remover)
        t.start()
        assert not done.wait(0.2)  # blocked behind the pending save
        gate.set()
        t.join(30)
        assert done.is_set() and handle.done()
        ckpt.wait()
        assert os.listdir(tmp_path) == []


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

    monkeypatch.setattr(os, "rename", exdev)
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
        "from lazyckpt import LazyCheckpointer, _remove\n"
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


def test_remove_from_a_done_callback_of_a_pending_path_refuses_instead_of_deadlocking(tmp_path):
    """Done-callbacks run on the committer; b's save commits after a's on that same thread, so waiting
    for it there would never end: remove() raises instead."""
    with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 20) as ckpt:
        a, b = tmp_path / "a.pt", tmp_path / "b.pt"
        registered, ran = threading.Event(), threading.Event()
        errors = []

        def cb(_h):
            try:
                ckpt.remove(b)
            except RuntimeError as exc:
                errors.append(exc)
            finally:
                ran.set()

        ha = ckpt.save({"w": torch.randn(1000)}, a, before_commit=lambda: registered.wait(30))
        hb = ckpt.save({"w": torch.randn(1000)}, b)
        ha.add_done_callback(cb)
        registered.set()
        assert ran.wait(30)
        hb.wait()
        assert errors and "deadlock" in str(errors[0])
        assert b.exists()


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
