"""``MultiLevel`` (``LazyCheckpointer(levels=...)``): a fastest level's file feeding two slower levels
stays until the LAST of their copies has read it (one pin per copy; it used to be one per save, so
the first copy to end unpinned it and retention removed it under the second)."""

from __future__ import annotations

import os
import threading

import torch

from lazyckpt import LazyCheckpointer, Level
from lazyckpt.schedule import _copy, _runner


def _state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


def test_a_file_feeding_two_slower_levels_stays_until_both_copied_it(mem, tmp_path, monkeypatch):
    disk, disk2 = tmp_path / "disk", tmp_path / "disk2"
    release, entered, first_copied = threading.Event(), threading.Event(), threading.Event()
    real_copy, real_promote = _copy.copy_file, _runner.Runner._copy

    def held(src, dst, fsync):
        if os.path.dirname(dst) == str(disk2):
            entered.set()
            release.wait(10)  # bounded: never a hang
        return real_copy(src, dst, fsync)

    def promote(self, item):
        real_promote(self, item)
        if item.level == 1:
            first_copied.set()  # the first disk's copy of step 2 ended: its reader is gone

    monkeypatch.setattr(_copy, "copy_file", held)
    monkeypatch.setattr(_runner.Runner, "_copy", promote)
    levels = [Level(mem, every=1, keep=1), Level(disk, every=2, keep=2), Level(disk2, every=2, keep=2)]
    with LazyCheckpointer(levels=levels) as ckpt:
        h2 = ckpt.save(_state(2), step=2)
        assert entered.wait(10) and first_copied.wait(10)
        ckpt.save(_state(3), step=3).wait()  # the memory level's retention ran after step 3's commit
        assert sorted(os.listdir(mem)) == ["step-00000002.pt", "step-00000003.pt"]  # still pinned by disk2
        release.set()
        h2.wait()
        assert h2.levels_done == [0, 1, 2]
        ckpt.wait()
    assert sorted(os.listdir(mem)) == ["step-00000003.pt"]
    for folder in (disk, disk2):
        assert torch.load(folder / "step-00000002.pt")["step"] == 2


def test_wait_with_a_timeout_raises_while_a_copy_is_still_running(mem, tmp_path, monkeypatch):
    """A held copy to the slower level: ``wait(timeout)`` raises ``TimeoutError`` once the time is spent, also
    when it ran out before the last handle was reached (it used to return then), and waits it out without one."""
    disk = tmp_path / "disk"
    release, entered = threading.Event(), threading.Event()
    real_copy = _copy.copy_file

    def held(src, dst, fsync):
        entered.set()
        release.wait(10)  # bounded: never a hang
        return real_copy(src, dst, fsync)

    monkeypatch.setattr(_copy, "copy_file", held)
    with LazyCheckpointer(levels=[Level(mem, every=1, keep=1), Level(disk, every=1)]) as ckpt:
        ckpt.save(_state(1), step=1)
        assert entered.wait(10)
        for timeout in (0.05, 0.0):
            try:
                ckpt.wait(timeout)
            except TimeoutError:
                pass
            else:
                raise AssertionError(f"wait({timeout}) returned with a copy running")
        release.set()
        ckpt.wait()
    assert torch.load(disk / "step-00000001.pt")["step"] == 1
