"""Page reuse on a memory level (storage/spare.py): the file retention drops becomes the next save's
file, and never one that somebody may still read.

Each protection has a test that forces its window: a reader's descriptor opened before the rename
and locked after it, a file this process maps, a file another process ``lazyckpt.load``ed and keeps;
the last two also run with the protection switched off and show the mapped tensors changing, so the
window they guard is real.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import subprocess
import sys
import textwrap

import pytest
import torch

import lazyckpt
from lazyckpt import LazyCheckpointer, Level, WriteError
from lazyckpt.checkpointer import producer_of
from lazyckpt.errors import IncompleteCheckpointWarning
from lazyckpt.formats import torch_zip
from lazyckpt.storage import fs as _fs
from lazyckpt.storage import spare as _spare

pytestmark = pytest.mark.skipif(
    not (os.path.isdir("/dev/shm") and _fs.is_memory_filesystem("/dev/shm")), reason="no tmpfs at /dev/shm"
)


def _state(step: int, n: int = 1 << 18) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(step)), "b": torch.arange(step * 10, dtype=torch.int64)}


def _file(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:08d}.pt")


def _saver(mem: str, **level: object) -> LazyCheckpointer:
    return LazyCheckpointer(
        levels=[Level(mem, every=1, keep=1, **{"reuse_pages": True, **level})], host_memory_budget=64 << 20
    )  # type: ignore[arg-type]


def test_memory_level_overwrites_the_file_retention_dropped(mem):
    ck = _saver(mem)
    inodes = {}
    try:
        for step in range(1, 6):
            ck.save(_state(step), step=step).wait()
            inodes[step] = os.stat(_file(mem, step)).st_ino
            got = torch.load(_file(mem, step), weights_only=True)
            assert torch.equal(got["w"], _state(step)["w"]) and torch.equal(got["b"], _state(step)["b"])
            assert lazyckpt.verify(_file(mem, step)).ok
        spares = ck._engine.spares
        assert spares.reused == 3  # steps 3, 4, 5 were written over steps 1, 2, 3's files
        assert inodes[3] == inodes[1] and inodes[4] == inodes[2] and inodes[5] == inodes[3]
    finally:
        ck.close()
    assert sorted(os.listdir(mem)) == ["step-00000005.pt"]  # close() deleted the spare


def test_a_reused_file_holds_the_same_bytes_as_a_fresh_one(mem, monkeypatch):
    monkeypatch.setattr(torch_zip, "_serialization_id", lambda: "0" * 20)  # torch.save draws one per file
    ck = _saver(mem)
    try:
        ck.save(_state(1, 1 << 20), step=1).wait()  # bigger than the next: the reused file is cut
        ck.save(_state(2, 1 << 10), step=2).wait()
        ck.save(_state(3, 1 << 16), step=3).wait()  # into step 1's pages
        assert ck._engine.spares.reused == 1
    finally:
        ck.close()
    fresh_dir = f"{mem}-fresh"
    os.makedirs(fresh_dir)
    try:
        with LazyCheckpointer(host_memory_budget=64 << 20) as fresh:
            fresh.save(_state(3, 1 << 16), _file(fresh_dir, 3)).wait()
        with open(_file(mem, 3), "rb") as a, open(_file(fresh_dir, 3), "rb") as b:
            assert a.read() == b.read()  # every byte written: nothing of step 1 left in padding or tail
    finally:
        for name in os.listdir(fresh_dir):
            os.unlink(os.path.join(fresh_dir, name))
        os.rmdir(fresh_dir)


def test_reuse_pages_false_deletes(mem):
    ck = _saver(mem, reuse_pages=False)
    try:
        inodes = []
        for step in range(1, 5):
            ck.save(_state(step), step=step).wait()
            inodes.append(os.stat(_file(mem, step)).st_ino)
        assert ck._engine.spares.reused == 0
        ck.wait()  # retention's deletions: renamed away at once, unlinked on the remover thread
        assert not [n for n in os.listdir(mem) if _fs.is_temporary(n)]
    finally:
        ck.close()


def test_a_disk_level_is_never_reused(tmp_path):
    assert not _fs.is_memory_filesystem(str(tmp_path))
    ck = LazyCheckpointer(levels=[Level(str(tmp_path), every=1, keep=1, reuse_pages=True)], host_memory_budget=64 << 20)
    try:
        for step in range(1, 4):
            ck.save(_state(step), step=step).wait()
        assert ck._engine.spares.reused == 0
    finally:
        ck.close()


# -- the readers' side ---------------------------------------------------------------------------


def _one_file(mem: str) -> str:
    os.makedirs(mem, exist_ok=True)
    path = _file(mem, 1)
    torch.save(_state(1), path)
    return path


@pytest.mark.parametrize("name_then", ["empty", "another file"])
def test_a_reader_that_opened_before_the_rename_finds_the_file_gone(mem, name_then):
    """The window: a reader opens the name, the file is renamed away for reuse, then the reader
    locks its descriptor. Its lock is granted (the spare's lock is held by the spare's descriptor
    only until it is taken), so it must notice that the name no longer names that file (gone, or
    holding another file: a later save of that step)."""
    path = _one_file(mem)
    spares = _spare.Spares()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert spares.offer(path)
        spare_fd = spares.take(_file(mem, 2), os.path.join(mem, ".next.lazyckpt-x-1-1.tmp"), 4096)
        os.close(spare_fd)  # the writer finished: the exclusive lock is gone
        if name_then == "another file":
            torch.save(_state(9), path)
        with pytest.raises(FileNotFoundError):
            _spare.share_lock(fd, path)
    finally:
        os.close(fd)
        spares.clear()


def test_a_reader_that_locked_first_keeps_its_file(mem):
    path = _one_file(mem)
    spares = _spare.Spares()
    fd = os.open(path, os.O_RDONLY)
    try:
        _spare.share_lock(fd, path)
        assert not spares.offer(path)  # refused: deleted as before by the caller
        assert os.path.exists(path)
    finally:
        os.close(fd)
        spares.clear()


def test_a_file_being_reused_is_skipped_by_latest_and_refused_by_load(mem):
    older = _one_file(mem)
    newer = _file(mem, 2)
    torch.save(_state(2), newer)
    fd = os.open(newer, os.O_RDWR)  # what a spare's descriptor holds while the file is renamed away
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.warns(IncompleteCheckpointWarning, match="gone since it was listed"):
            found = lazyckpt.latest([mem])
        assert found is not None and found.path == older
        with pytest.raises(FileNotFoundError):
            lazyckpt.load(newer)
    finally:
        os.close(fd)


def test_a_hard_linked_file_is_not_reused(mem):
    path = _one_file(mem)
    os.link(path, os.path.join(mem, "kept-by-the-user.pt"))
    spares = _spare.Spares()
    try:
        assert not spares.offer(path)
    finally:
        spares.clear()


def _map_and_drop(mem: str, protected: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, int]:
    """torch.load(mmap=True) step 1's file in this process, keep its tensors, save steps 2 and 3
    (keep=1: step 1 is dropped, then step 3 is written). Whether the mapped tensors still hold
    step 1's values, and how many files were reused."""
    if not protected:
        monkeypatch.setattr(_spare, "mapped_here", lambda dev, ino: False)
    ck = _saver(mem)
    try:
        ck.save(_state(1), step=1).wait()
        mapped = torch.load(_file(mem, 1), mmap=True, weights_only=True)
        ck.save(_state(2), step=2).wait()
        ck.save(_state(3), step=3).wait()
        return torch.equal(mapped["w"], _state(1)["w"]), ck._engine.spares.reused
    finally:
        ck.close()


def test_a_file_this_process_maps_is_not_reused(mem, monkeypatch):
    same, reused = _map_and_drop(mem, protected=True, monkeypatch=monkeypatch)
    assert same and reused == 0  # step 1's file was deleted (it stays allocated while mapped), step 3's fresh


def test_without_the_maps_check_the_mapped_tensors_change(mem, monkeypatch):
    same, reused = _map_and_drop(mem, protected=False, monkeypatch=monkeypatch)
    assert not same and reused == 1  # the window is real: step 3 was written into the mapped pages


_CHILD = textwrap.dedent(
    """
    import sys, torch, lazyckpt
    from lazyckpt.storage import spare
    if sys.argv[2] == "off":
        spare.share_lock = lambda fd, path: None
        spare.hold_while_mapped = lambda fd, path: None
    state = lazyckpt.load(sys.argv[1], mmap=sys.argv[3] == "mmap")
    print("ready", flush=True)
    sys.stdin.readline()
    print("same" if torch.equal(state["w"], torch.full_like(state["w"], 1.0)) else "changed", flush=True)
    """
)


def _other_process_maps(mem: str, protected: bool, mmap: bool = True) -> tuple[str, int]:
    ck = _saver(mem)
    child = None
    try:
        ck.save(_state(1), step=1).wait()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, _file(mem, 1), "on" if protected else "off", "mmap" if mmap else "read"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None and child.stdin is not None
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline().strip() == "ready"
        ck.save(_state(2), step=2).wait()  # drops step 1: reused only if no reader holds it
        ck.save(_state(3), step=3).wait()
        out, _ = child.communicate("check\n", timeout=120)
        return out.strip(), ck._engine.spares.reused
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        ck.close()


def test_a_file_another_process_loaded_is_not_reused(mem):
    verdict, reused = _other_process_maps(mem, protected=True)
    assert verdict == "same" and reused == 0  # step 1's file was deleted, step 3 went into a fresh one


def test_without_the_readers_lock_the_other_process_sees_its_tensors_change(mem):
    verdict, reused = _other_process_maps(mem, protected=False)
    assert verdict == "changed" and reused == 1  # the window is real: step 3 went into the mapped pages


def test_a_file_another_process_read_into_its_memory_is_reused(mem):
    """load() without mmap (the default) holds no page of the file once it returns: the memory level
    reuses the dropped file's pages, and the reader's tensors stay as loaded."""
    verdict, reused = _other_process_maps(mem, protected=True, mmap=False)
    assert verdict == "same" and reused == 1


# -- failures --------------------------------------------------------------------------------------


def test_a_full_memory_filesystem_while_growing_a_spare_fails_that_save_only(mem, monkeypatch):
    ck = _saver(mem)
    real = _fs.reserve

    def full(fd: int, size: int, offset: int = 0) -> None:
        if offset:  # growing a reused file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, size, offset)

    try:
        ck.save(_state(1, 1 << 10), step=1).wait()
        ck.save(_state(2, 1 << 10), step=2).wait()
        monkeypatch.setattr(_fs, "reserve", full)
        with pytest.raises(WriteError) as info:
            ck.save(_state(3, 1 << 16), step=3).wait()  # bigger than step 1's file
        assert info.value.errno == errno.ENOSPC
        assert not [n for n in os.listdir(mem) if _fs.is_temporary(n)]  # the spare went with the save
        monkeypatch.setattr(_fs, "reserve", real)
        ck.save(_state(4, 1 << 16), step=4).wait()
        assert torch.equal(torch.load(_file(mem, 4), weights_only=True)["w"], _state(4, 1 << 16)["w"])
    finally:
        ck.close()


# -- folder levels: a dropped step folder's files, by name ---------------------------------------


def _big(value: float, n: int = 1 << 19) -> dict[str, torch.Tensor]:  # 2 MiB: above FOLDER_MIN_BYTES
    return {"w": torch.full((n,), value)}


def _temporaries(folder: str) -> list[str]:
    """The spares parked in ``folder`` (temporary files; a dropped folder being freed is not one)."""
    return sorted(n for n in os.listdir(folder) if _fs.is_temporary(n) and os.path.isfile(os.path.join(folder, n)))


def test_a_dropped_step_folder_gives_each_large_file_to_the_save_of_its_name(mem):
    step = lambda n: os.path.join(mem, f"step-{n:08d}")  # noqa: E731
    with LazyCheckpointer(host_memory_budget=64 << 20) as ck:
        ck.save(_big(1.0), os.path.join(step(1), "model.pt")).wait()
        ck.save(_big(2.0), os.path.join(step(1), "shard", "opt.pt")).wait()  # two folders deep
        ck.save(_state(1, 16), os.path.join(step(1), "small.pt")).wait()  # under FOLDER_MIN_BYTES
        model = os.stat(os.path.join(step(1), "model.pt")).st_ino
        opt = os.stat(os.path.join(step(1), "shard", "opt.pt")).st_ino
        assert producer_of(ck).reuse(step(1))
        assert not os.path.exists(step(1))  # gone from its name at once, in one rename
        assert len(_temporaries(mem)) == 2  # the two large files, parked in the level
        ck.save(_big(3.0, 1 << 18), os.path.join(step(2), "model.pt")).wait()  # smaller: the file is cut
        ck.save(_state(2, 16), os.path.join(step(2), "other.pt")).wait()  # no spare of that name
        ck.save(_big(4.0, 1 << 20), os.path.join(step(2), "shard", "opt.pt")).wait()  # larger: grown
        assert ck._engine.spares.reused == 2
        assert os.stat(os.path.join(step(2), "model.pt")).st_ino == model
        assert os.stat(os.path.join(step(2), "shard", "opt.pt")).st_ino == opt
        assert _temporaries(mem) == []
        ck.wait()  # the rest of step 1 (small.pt) is freed on the remover thread
        assert sorted(os.listdir(mem)) == ["step-00000002"]
        for name, want in [("model.pt", _big(3.0, 1 << 18)), ("shard/opt.pt", _big(4.0, 1 << 20))]:
            path = os.path.join(step(2), name)
            assert lazyckpt.verify(path).ok
            assert torch.equal(torch.load(path, weights_only=True)["w"], want["w"])


def test_the_spares_of_a_folder_replace_those_of_the_folder_before(mem):
    """A name the saves no longer write (another process's shard) is kept one step at most."""
    with LazyCheckpointer(host_memory_budget=64 << 20) as ck:
        for n, name in [(1, "a.pt"), (2, "b.pt")]:
            ck.save(_big(float(n)), os.path.join(mem, f"step-{n}", name)).wait()
        assert producer_of(ck).reuse(os.path.join(mem, "step-1")) and len(_temporaries(mem)) == 1
        assert (
            producer_of(ck).reuse(os.path.join(mem, "step-2")) and len(_temporaries(mem)) == 1
        )  # a.pt's spare dropped
        ck.save(_big(3.0), os.path.join(mem, "step-3", "a.pt")).wait()
        assert ck._engine.spares.reused == 0
        ck.save(_big(3.0), os.path.join(mem, "step-3", "b.pt")).wait()
        assert ck._engine.spares.reused == 1
    assert sorted(os.listdir(mem)) == ["step-3"]


def test_a_folder_with_a_save_pending_inside_is_not_reused(mem, monkeypatch):
    from _util import WriteGate
    from lazyckpt.core import plan

    folder = os.path.join(mem, "step-1")
    with LazyCheckpointer(host_memory_budget=64 << 20) as ck:
        ck.save(_big(1.0), os.path.join(folder, "model.pt")).wait()
        monkeypatch.setattr(plan, "write_in_save", lambda memory, devices, nbytes=0: False)  # written in the background
        gate = WriteGate(monkeypatch)  # ... where the next save's writes wait: it is pending
        h = ck.save(_big(2.0), os.path.join(folder, "late.pt"))
        try:
            assert not producer_of(ck).reuse(folder)
            assert os.path.isdir(folder) and _temporaries(mem) == []
        finally:
            gate.release()
        h.wait()
        assert producer_of(ck).reuse(folder)


def test_a_file_a_reader_holds_in_a_dropped_folder_is_deleted_not_reused(mem):
    folder = os.path.join(mem, "step-1")
    with LazyCheckpointer(host_memory_budget=64 << 20) as ck:
        ck.save(_big(1.0), os.path.join(folder, "model.pt")).wait()
        ck.save(_big(2.0), os.path.join(folder, "opt.pt")).wait()
        fd = os.open(os.path.join(folder, "model.pt"), os.O_RDONLY)
        try:
            _spare.share_lock(fd, os.path.join(folder, "model.pt"))  # lazyckpt.load's side
            assert producer_of(ck).reuse(folder)
            ck.save(_big(3.0), os.path.join(mem, "step-2", "model.pt")).wait()
            ck.save(_big(4.0), os.path.join(mem, "step-2", "opt.pt")).wait()
            assert ck._engine.spares.reused == 1  # opt.pt only
            ck.wait()
            assert os.pread(fd, 8, 0)  # the reader's file is intact (unlinked, still open)
            assert os.fstat(fd).st_nlink == 0
        finally:
            os.close(fd)
