"""Multi-level folder checkpoints (``MultiLevel(..., folder=True).save_with``): the machinery under
Accelerate's ``save_state`` folders by level. Folders ``<level>/step-<8 digits>`` are made by
``produce`` at the fastest due level, copied whole (one rename) or uploaded (manifest last) to the
slower ones, kept ``keep`` per level, and found by ``latest()`` only when complete and intact."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import warnings

import pytest
import torch

import lazyckpt
from _util import assert_same
from lazyckpt import LazyCheckpointer, Level, LevelError
from lazyckpt.commit.folder import FolderSave, marker_name
from lazyckpt.core.handle import Completion, SaveStats
from lazyckpt.errors import IncompleteCheckpointWarning
from lazyckpt.schedule import _copy
from lazyckpt.schedule._multi import MultiLevel
from lazyckpt.storage import fs as _fs


def _state(i: int) -> dict:
    return {"model": {"w": torch.full((64, 64), float(i))}, "opt": {"m": torch.arange(256.0) * i}}


def _producer(ck: LazyCheckpointer, states: dict):
    """``produce(path)`` for a folder of two files saved lazily by ``ck`` (a FolderSave: marker,
    files, end), returning a handle that is done once the folder is complete."""

    def produce(path: str):
        step = int(os.path.basename(path).rsplit("step-", 1)[1])
        state = states[step]
        fsave = FolderSave(path)
        fsave.save(ck, state["model"], os.path.join(path, "model.safetensors"), format="safetensors")
        fsave.save(ck, state["opt"], os.path.join(path, "optimizer.bin"))
        fsave.save(ck, {"step": step}, os.path.join(path, "random_states_0.pkl"))  # as Accelerate's names go
        for h in fsave.handles:
            h.wait()
        fsave.end()
        completion = Completion(path)
        completion.finish(SaveStats(path, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), None)
        return completion.handle

    return produce


def _read(folder: str) -> dict:
    from safetensors.torch import load_file

    return {"model": load_file(os.path.join(folder, "model.safetensors")),
            "opt": torch.load(os.path.join(folder, "optimizer.bin"))}  # fmt: skip


def _levels(ck, levels):
    return MultiLevel(ck, tuple(levels), ck.options, folder=True)


def test_folders_by_level_copied_whole_kept_and_found(mem, tmp_path):
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=2, keep=2)]
    states = {i: _state(i) for i in range(1, 8)}
    with LazyCheckpointer() as ck:
        ml = _levels(ck, levels)
        produce = _producer(ck, states)
        for i in range(1, 8):
            h = ml.save_with(i, produce)
        h.wait()
        assert h.levels_done == [0]
        ml.drain()  # the disk level's copies
        ml.close()
    assert sorted(os.listdir(mem)) == ["step-00000006", "step-00000007"]
    assert sorted(os.listdir(tmp_path / "disk")) == ["step-00000004", "step-00000006"]  # no temporaries left
    for i in (4, 6):
        assert_same(_read(levels[1].folder(i)), states[i])
        assert not any(n.startswith(".") for n in os.listdir(levels[1].folder(i)))  # no marker copied
    found = lazyckpt.latest(levels)
    assert (found.step, found.level, found.path) == (7, 0, levels[0].folder(7))
    shutil.rmtree(mem)  # a reboot: the memory level is gone
    found = lazyckpt.latest(levels)
    assert (found.step, found.level) == (6, 1)
    assert_same(_read(found.path), states[6])


def test_latest_skips_an_interrupted_or_corrupt_folder(mem, tmp_path):
    levels = [Level(mem, every=1), Level(tmp_path / "disk", every=1)]
    states = {i: _state(i) for i in range(1, 4)}
    with LazyCheckpointer() as ck:
        ml = _levels(ck, levels)
        produce = _producer(ck, states)
        for i in range(1, 4):
            ml.save_with(i, produce).wait()
        ml.close()
    # step 3 at memory: a save into it was interrupted (a marker of a dead process of this host)
    marker = marker_name("0").replace(f"-{os.getpid()}-", "-999999-")
    open(os.path.join(levels[0].folder(3), marker), "w").close()
    # step 3 at disk: a flipped byte in the optimizer file
    victim = os.path.join(levels[1].folder(3), "optimizer.bin")
    with open(victim, "r+b") as fh:
        fh.seek(os.path.getsize(victim) // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0xFF]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = lazyckpt.latest(levels)
    assert (found.step, found.level) == (2, 0)
    said = " ".join(str(w.message) for w in seen if issubclass(w.category, IncompleteCheckpointWarning))
    assert levels[0].folder(3) in said and "incomplete" in said
    assert levels[1].folder(3) in said and "CRC" in said
    # verify=False: completeness only (the marker still counts, the CRC does not)
    with pytest.warns(IncompleteCheckpointWarning, match="incomplete"):
        found = lazyckpt.latest(levels, verify=False)
    assert (found.step, found.level) == (3, 1)


def test_a_failed_folder_copy_names_its_level_and_leaves_no_partial_folder(mem, tmp_path, monkeypatch):
    levels = [Level(mem, every=1, keep=3), Level(tmp_path / "disk", every=1)]
    states = {i: _state(i) for i in range(1, 3)}
    real = _fs.open_temporary

    def full(tmp, size):
        if str(tmp).startswith(str(tmp_path / "disk")) and "optimizer.bin" in str(tmp):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, size)

    with LazyCheckpointer() as ck:
        ml = _levels(ck, levels)
        produce = _producer(ck, states)
        ml.save_with(1, produce).wait()
        monkeypatch.setattr(_fs, "open_temporary", full)
        h = ml.save_with(2, produce)
        with pytest.raises(LevelError) as info:
            h.wait()
        ml.close()
    err = info.value
    assert (err.level, err.step, err.errno) == (1, 2, errno.ENOSPC)
    assert str(tmp_path / "disk") in str(err)
    assert sorted(os.listdir(tmp_path / "disk")) == ["step-00000001"]  # no step-2, no temporary folder
    assert sorted(os.listdir(mem)) == ["step-00000001", "step-00000002"]  # the memory level kept working
    assert lazyckpt.latest(levels).path == levels[0].folder(2)


def test_copy_tree_replaces_an_older_copy_of_the_same_step(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "lvl" / "step-00000001"
    src.mkdir()
    (src / "a.bin").write_bytes(b"new")
    (src / "sub").mkdir()
    (src / "sub" / "b.bin").write_bytes(b"deep")
    (src / marker_name(0)).write_text("marker")  # never copied
    dst.mkdir(parents=True)
    (dst / "a.bin").write_bytes(b"old")
    (dst / "stale.bin").write_bytes(b"x")
    _copy.copy_tree(str(src), str(dst), fsync=True)
    assert sorted(os.listdir(dst)) == ["a.bin", "sub"]
    assert (dst / "a.bin").read_bytes() == b"new" and (dst / "sub" / "b.bin").read_bytes() == b"deep"
    assert os.listdir(tmp_path / "lvl") == ["step-00000001"]


@pytest.mark.parametrize("size", [5, (3 << 20) + 123])
def test_copy_checked_copies_bytes_whose_crc_matches_and_refuses_others(tmp_path, monkeypatch, size):
    """A rank file's copy to a slower level (DCP, DeepSpeed): the bytes read are CRC-checked against the CRC
    recorded at their write; a mismatch is EIO and leaves no file (several chunks with a small chunk size)."""
    from lazyckpt.formats.crc import crc32

    monkeypatch.setattr(_copy, "COPY_CHUNK", 1 << 20)
    monkeypatch.setattr(_copy, "DIRECT_MIN", 1 << 20)
    data = os.urandom(size)
    src = tmp_path / "r0.distcp"
    src.write_bytes(data)
    _copy.copy_checked(str(src), str(tmp_path / "a"), "r0.distcp", crc32(data), fsync=True)
    assert (tmp_path / "a" / "r0.distcp").read_bytes() == data
    _copy.check_file(str(src), crc32(data))
    with pytest.raises(OSError, match="changed since it was written") as info:
        _copy.copy_checked(str(src), str(tmp_path / "b"), "r0.distcp", crc32(data) ^ 1, fsync=True)
    assert info.value.errno == errno.EIO and os.listdir(tmp_path / "b") == []
    with pytest.raises(OSError, match="changed since it was written"):
        _copy.check_file(str(src), crc32(data) ^ 1)


def test_a_copy_killed_midway_leaves_only_a_temporary_that_the_next_run_removes(mem, tmp_path):
    """A SIGKILLed copy leaves its hidden temporary folder: never a candidate, removed by the next
    multi-level saver of that level (its writer, of this host, is dead)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    left = disk / f".step-00000005.lazyckpt-{_fs.host_tag()}-999999-0.tmp"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"partial")
    levels = [Level(mem, every=1), Level(disk, every=1)]
    assert lazyckpt.latest(levels) is None
    with LazyCheckpointer() as ck:
        _levels(ck, levels).close()
    assert not left.exists()


def test_folder_level_on_s3_manifest_last(mem, tmp_path, s3):
    opts, fs = s3
    url = f"s3://levels/{uuid.uuid4().hex[:8]}"
    levels = [Level(mem, every=1, keep=1), Level(url, every=2, keep=1)]
    states = {i: _state(i) for i in range(1, 5)}
    with LazyCheckpointer(storage_options=opts, local_dir=str(tmp_path / "local")) as ck:
        ml = _levels(ck, levels)
        produce = _producer(ck, states)
        for i in range(1, 5):
            ml.save_with(i, produce)
        ml.drain()
        ml.close()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"), refresh=True))
    assert names == ["step-00000004"]  # keep=1 at the S3 level
    inside = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url.removeprefix('s3://')}/step-00000004", refresh=True))
    assert inside == [".lazyckpt-complete", "model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    assert not any(n.startswith(".") for n in os.listdir(levels[0].folder(4)))  # the source stays untouched
    shutil.rmtree(mem)
    found = lazyckpt.latest(levels, storage_options=opts)
    assert (found.step, found.level, found.path) == (4, 1, f"{url}/step-00000004")
    # without its manifest (a half-finished upload) the prefix is no checkpoint
    fs.rm(f"{url.removeprefix('s3://')}/step-00000004/.lazyckpt-complete")
    with pytest.warns(IncompleteCheckpointWarning, match="upload never finished"):
        assert lazyckpt.latest(levels, storage_options=opts) is None
