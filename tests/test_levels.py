"""Multi-level checkpoints (``LazyCheckpointer(levels=...)``, ``latest()``, ``load()``), single process."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import threading
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import lazyckpt
from _launch import SRC, TESTS, run_python
from _util import assert_same
from lazyckpt import BackpressureWarning, LazyCheckpointer, Level, LevelError, SaveRefusedError
from lazyckpt.core import plan as _plan
from lazyckpt.errors import IncompleteCheckpointWarning
from lazyckpt.schedule import _copy
from lazyckpt.storage import fs as _fs

SCRIPTS = os.path.join(os.path.dirname(__file__), "levels_scripts")


def _train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters())

    def step(i: int) -> dict:
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return {"model": model.state_dict(), "opt": opt.state_dict(), "step": i}

    return step


def _hold_copies(monkeypatch):
    """Every slower level's file copy blocks until ``release`` is set (``entered``: one has begun)."""
    entered, release = threading.Event(), threading.Event()
    real = _copy.copy_file

    def held(src, dst, fsync):
        entered.set()
        assert release.wait(60)
        real(src, dst, fsync)

    monkeypatch.setattr(_copy, "copy_file", held)
    return entered, release


def test_each_due_level_gets_the_state_at_save_even_as_training_goes_on(mem, tmp_path):
    levels = [Level(mem, every=1, keep=10), Level(tmp_path / "disk", every=3)]
    step, want, handles = _train(), {}, []
    with LazyCheckpointer(levels=levels) as ck:
        for i in range(1, 8):
            state = step(i)  # the previous save's tensors change here, at once
            want[i] = copy.deepcopy(state)
            handles.append(ck.save(state, step=i))
        for h in handles:
            h.wait()
    assert sorted(os.listdir(mem)) == [f"step-{i:08d}.pt" for i in range(1, 8)]
    assert sorted(os.listdir(tmp_path / "disk")) == ["step-00000003.pt", "step-00000006.pt"]
    for i in range(1, 8):
        assert_same(torch.load(levels[0].file(i)), want[i])
    for i in (3, 6):
        assert_same(torch.load(levels[1].file(i)), want[i])
    assert handles[5].levels_done == [0, 1] and handles[4].levels_done == [0]
    assert handles[5].path == levels[0].file(6)


def test_save_dispatch_refusals_and_plain_paths(mem, tmp_path):
    with LazyCheckpointer() as ck, pytest.raises(SaveRefusedError, match="needs a path"):
        ck.save({"a": 1})
    with LazyCheckpointer(levels=[Level(mem, keep=1)]) as ck:
        with pytest.raises(SaveRefusedError, match="step"):
            ck.save({"a": 1})
        with pytest.raises(SaveRefusedError, match="no step"):
            ck.save({"a": 1}, tmp_path / "x.pt", step=1)
        ck.save({"a": torch.ones(2)}, tmp_path / "x.pt").wait()  # save(obj, path) as before
    assert_same(torch.load(tmp_path / "x.pt"), {"a": torch.ones(2)})
    with LazyCheckpointer(levels=[Level(mem, every=5, keep=1)]) as ck:
        h = ck.save({"a": 1}, step=3)  # no level due
        assert h.done() and h.wait().skipped
    with pytest.raises(TypeError):
        LazyCheckpointer(levels=["/tmp/not-a-level"])


def test_retention_keeps_the_newest_n(mem, tmp_path):
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=2, keep=1)]
    step = _train()
    with LazyCheckpointer(levels=levels) as ck:
        for i in range(1, 10):
            ck.save(step(i), step=i)
    assert sorted(os.listdir(mem)) == ["step-00000008.pt", "step-00000009.pt"]
    assert sorted(os.listdir(tmp_path / "disk")) == ["step-00000008.pt"]


def test_retention_never_removes_a_file_a_slower_level_still_copies(mem, tmp_path, monkeypatch):
    """The disk copy of step 2 is held inside copy_file; meanwhile the memory level (keep=1)
    commits steps 3 and 4: its step-2 file feeds the copy and must stay until the copy is done."""
    disk = tmp_path / "disk"
    levels = [Level(mem, every=1, keep=1), Level(disk, every=2, keep=1, backlog=4)]
    entered, release = _hold_copies(monkeypatch)
    step, want = _train(), {}
    with LazyCheckpointer(levels=levels) as ck:
        ck.save(step(1), step=1).wait()
        want[2] = copy.deepcopy(s2 := step(2))
        h2 = ck.save(s2, step=2)
        h2.wait_local()  # confirms it (as the next optimizer step would, whichever the regime): the copy starts
        assert entered.wait(60)
        ck.save(step(3), step=3).wait()
        assert os.path.exists(levels[0].file(2)), "the copy's source was removed while it was read"
        assert not os.path.exists(levels[0].file(1))
        release.set()
        h2.wait()
    assert_same(torch.load(levels[1].file(2)), want[2])
    assert sorted(os.listdir(mem)) == ["step-00000003.pt"]  # removed once the copy was done


def test_a_rollback_makes_later_steps_of_the_old_timeline_go(mem):
    levels = [Level(mem, every=1, keep=5)]
    step = _train()
    with LazyCheckpointer(levels=levels) as ck:
        for i in range(1, 6):
            ck.save(step(i), step=i)
    with LazyCheckpointer(levels=levels) as ck:  # restarted from step 2 (say step 3 was bad)
        ck.save(step(3), step=3)
    assert sorted(os.listdir(mem)) == ["step-00000001.pt", "step-00000002.pt", "step-00000003.pt"]


def test_a_rollback_removes_the_old_timeline_at_every_level_at_its_first_save(mem, tmp_path, s3):
    """Resumed from the disk level's step 80 (say 90 and 100 learned badly): the first save, at 81,
    removes the later steps at once at the levels holding a step at or before 81, even those not due
    until step 90 or 150: a crash before their commits must not make ``latest()`` return step 100."""
    opts, fs = s3
    url = f"s3://levels/{uuid.uuid4().hex[:8]}"
    levels = [Level(mem, every=1, keep=3), Level(tmp_path / "disk", every=10), Level(url, every=50)]
    kw = {"storage_options": opts, "local_dir": str(tmp_path / "local")}
    with LazyCheckpointer(levels=levels, **kw) as ck:
        for i in range(1, 101):
            ck.save({"w": torch.full((4,), float(i))}, step=i)
    assert lazyckpt.latest(levels, storage_options=opts).step == 100
    with LazyCheckpointer(levels=levels, **kw) as ck:
        ck.save({"w": torch.full((4,), 81.5)}, step=81)
        # no wait: the disk level's old steps are gone when save() returns; the memory level holds
        # nothing at or before 81 (keep=3: 98-100), so its go at its first commit, within this save
        assert [p.name for p in sorted((tmp_path / "disk").glob("step-*"))][-1] == "step-00000080.pt"
        ck.wait()
        assert [p.name for p in Path(mem).glob("step-*")] == ["step-00000081.pt"]
    assert [os.path.basename(k) for k in fs.ls(url, refresh=True)] == ["step-00000050.pt"]
    found = lazyckpt.latest(levels, storage_options=opts)
    assert (found.step, found.level) == (81, 0)
    assert lazyckpt.load(found, storage_options=opts)["w"][0].item() == 81.5
    shutil.rmtree(mem)  # a reboot: then the disk level's 80, not the old timeline's 90
    assert lazyckpt.latest(levels, storage_options=opts).step == 80


def test_a_run_starting_below_every_step_a_level_holds_does_not_sweep_it(mem, tmp_path):
    """No rollback: a fresh run (or a step counter reset by mistake) into folders of an older run.
    A level holding nothing at or before the start keeps its steps until its own first commit."""
    levels = [Level(mem, every=1, keep=3), Level(tmp_path / "disk", every=5)]
    with LazyCheckpointer(levels=levels) as ck:
        for i in range(5, 11):
            ck.save({"w": torch.full((4,), float(i))}, step=i)
    with LazyCheckpointer(levels=levels) as ck:
        ck.save({"w": torch.zeros(4)}, step=1).wait()
        assert [p.name for p in sorted((tmp_path / "disk").glob("step-*"))] == ["step-00000005.pt", "step-00000010.pt"]
        ck.save({"w": torch.zeros(4)}, step=5).wait()  # its first commit there: the old 10 goes
        assert [p.name for p in sorted((tmp_path / "disk").glob("step-*"))] == ["step-00000005.pt"]
    assert [p.name for p in sorted(Path(mem).glob("step-*"))] == ["step-00000001.pt", "step-00000005.pt"]


def test_another_saves_error_raised_inside_a_level_save_is_not_relabelled(mem, tmp_path, monkeypatch):
    """An unseen error of a plain save that lands while a level save is under way (here: held in the
    memory check of the first level save) is raised by it as that save's own WriteError, not as a
    LevelError of the level being saved."""
    other = str(tmp_path / "other.pt")
    real_open = _fs.open_temporary

    def full(tmp, size):
        if os.path.basename(tmp).startswith(".other.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(tmp, size)

    monkeypatch.setattr(_fs, "open_temporary", full)
    monkeypatch.setattr(_plan, "write_in_save", lambda memory, devices, nbytes=0: False)
    with LazyCheckpointer(levels=[Level(mem, keep=2)]) as ck:
        failing = ck.save({"w": torch.ones(4)}, other)
        real_check = _copy.check_memory

        def land_the_other_error(levels, size):
            failing.exception(timeout=60)  # failed and published, unseen
            real_check(levels, size)

        monkeypatch.setattr(_copy, "check_memory", land_the_other_error)
        with pytest.raises(lazyckpt.WriteError) as info:
            ck.save({"w": torch.ones(4)}, step=1)
        assert not isinstance(info.value, LevelError) and info.value.path == other


KILL_POINTS = ("mid-write", "mid-copy", "before-rename", "after-rename", "retention")


def _kill_run(mem: str, tmp_path: Path, points: str, seed: str) -> list[dict]:
    expect = tmp_path / "expect"
    expect.mkdir()
    results = tmp_path / "results.jsonl"
    cmd = [os.path.join(SCRIPTS, "kill_driver.py"), mem, str(tmp_path / "disk"), str(expect), str(results), points,
           seed]  # fmt: skip
    r = run_python(cmd, dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)])), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in results.read_text().splitlines()]


def test_sigkilled_training_restarts_from_the_newest_complete_step(mem, tmp_path):
    """A training process SIGKILLed at each forced point of a multi-level save (halfway through a
    memory-level write, halfway through the disk level's copy, before the copy's rename, between a
    rename and its folder's fsync, before retention removes an older step), one child per point in
    turn: each next child's ``latest()`` is the newest step some level holds as a complete file,
    ``load()`` of it hashes to that step's state, and training resumes from it."""
    entries = _kill_run(mem, tmp_path, ",".join(KILL_POINTS), "7")
    kills = [e for e in entries if "point" in e]
    checks = [e for e in entries if "point" not in e]
    assert [e["point"] for e in kills] == list(KILL_POINTS), kills  # each window reached, in turn
    assert all(e.get("reached", True) for e in kills), kills
    assert len(checks) == len(KILL_POINTS) + 1, entries  # a check per restart, and a last one
    assert all(e["ok"] for e in checks), [e for e in checks if not e["ok"]]
    assert checks[-1]["found"] is not None and checks[-1]["found"][0] > len(KILL_POINTS)


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_sigkilled_at_random_moments_restarts_from_the_newest_complete_step(mem, tmp_path):
    """Opt-in soak (-m soak): 22 kills at random moments, the same checks."""
    entries = _kill_run(mem, tmp_path, os.environ.get("LAZYCKPT_SOAK_KILLS", "22"), "7")
    assert len(entries) == int(os.environ.get("LAZYCKPT_SOAK_KILLS", "22")) + 1, entries
    assert all(e["ok"] for e in entries), [e for e in entries if not e["ok"]]
    assert entries[-1]["found"] is not None and entries[-1]["found"][0] > 10


def test_latest_warnings_name_the_callers_line_on_the_agreed_path_too(tmp_path):
    """latest()'s warnings (a level that cannot be listed, a step skipped) name the line of the code
    that asked, also on the path the ranks agree on (the distributed checkpointer's latest())."""
    from lazyckpt.cluster._collective import StoreExchange
    from lazyckpt.resume._latest import latest_agreed

    levels = [Level(tmp_path / "a", every=1), Level("nosuchprotocol://bucket/b", every=1)]
    os.makedirs(tmp_path / "a")
    with open(levels[0].file(3), "wb") as fh:
        fh.write(b"not a checkpoint")
    exchange = StoreExchange(torch.distributed.HashStore(), "t", rank=0, world=1, timeout=10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert latest_agreed(levels, exchange) is None
        assert lazyckpt.latest(levels) is None
    said = [(w.message, w.filename) for w in seen if issubclass(w.category, IncompleteCheckpointWarning)]
    assert len(said) == 4 and {f for _, f in said} == {__file__}, said


def test_corrupt_memory_copy_is_skipped_then_a_wiped_memory_level_falls_back_to_disk(mem, tmp_path):
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=2, keep=2)]
    step, want = _train(), {}
    with LazyCheckpointer(levels=levels) as ck:
        for i in range(1, 5):
            want[i] = copy.deepcopy(s := step(i))
            ck.save(s, step=i)
    newest = levels[0].file(4)
    with open(newest, "r+b") as fh:  # a byte flipped in the middle of the newest memory copy
        fh.seek(os.path.getsize(newest) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.warns(IncompleteCheckpointWarning, match="step-00000004.pt"):
        found = lazyckpt.latest(ck.levels)
    assert (found.step, found.level, found.path) == (4, 1, levels[1].file(4))  # the same step, from disk
    assert_same(lazyckpt.load(found), want[4])
    shutil.rmtree(mem)  # a reboot
    found = lazyckpt.latest([mem, str(tmp_path / "disk")])
    assert (found.step, found.level) == (4, 1)
    shutil.rmtree(tmp_path / "disk")
    assert lazyckpt.latest(levels) is None


def test_enospc_on_the_disk_level_only(mem, tmp_path, monkeypatch):
    disk = str(tmp_path / "disk")
    real = _fs.open_temporary

    def full_disk(tmp, size):
        if tmp.startswith(disk):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, size)

    monkeypatch.setattr(_fs, "open_temporary", full_disk)
    levels = [Level(mem, every=1, keep=2), Level(disk, every=2)]
    step, want = _train(), {}
    ck = LazyCheckpointer(levels=levels)
    ck.save(step(1), step=1).wait()
    h = ck.save(step(2), step=2)
    with pytest.raises(LevelError, match="level 1") as info:
        h.wait()
    assert info.value.level == 1 and info.value.errno == errno.ENOSPC and info.value.step == 2
    assert isinstance(info.value.__cause__, OSError)
    assert h.levels_done == [0]
    want[3] = copy.deepcopy(s := step(3))
    ck.save(s, step=3).wait()  # the memory level keeps working; the error was reported once
    ck.save(step(4), step=4)  # the next disk copy fails too, unseen: raised by close()
    with pytest.raises(LevelError, match="step 4"):
        ck.close()
    assert_same(torch.load(levels[0].file(3)), want[3])
    assert os.listdir(disk) == []  # no partial file, no temporary left


def test_a_failure_of_the_fastest_level_is_its_level_error(mem, tmp_path, monkeypatch):
    """The memory level full (ENOSPC in the background), then unwritable (refused inside save()):
    each a LevelError naming level 0 and the step, reported once; that step reaches no slower level
    (they copy the fastest level's file); once the memory level works again, so does every level."""
    real = _fs.open_temporary
    full = threading.Event()

    def full_memory(tmp, size):
        if full.is_set() and tmp.startswith(mem):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, size)

    monkeypatch.setattr(_fs, "open_temporary", full_memory)
    monkeypatch.setattr(_plan, "write_in_save", lambda memory, devices, nbytes=0: False)  # opened in the background
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=1, keep=2)]
    step = _train()
    ck = LazyCheckpointer(levels=levels)
    ck.save(step(1), step=1).wait()
    full.set()
    h = ck.save(step(2), step=2)
    with pytest.raises(LevelError, match="level 0") as info:
        h.wait()
    err = info.value
    assert (err.level, err.step, err.errno, err.level_path) == (0, 2, errno.ENOSPC, levels[0].path)
    assert err.path == levels[0].file(2) and isinstance(err.__cause__, lazyckpt.WriteError)
    assert h.levels_done == []
    ck.save(step(3), step=3).exception(timeout=60)  # done, unseen: the next save raises it, once
    with pytest.raises(LevelError, match="step 3"):
        ck.save(step(4), step=4)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)  # the folder turned read-only
    with pytest.raises(LevelError, match="level 0") as info:
        ck.save(step(5), step=5)
    assert info.value.step == 5 and isinstance(info.value.__cause__, lazyckpt.WriteError)
    monkeypatch.undo()
    full.clear()
    h = ck.save(step(6), step=6)
    h.wait()
    assert h.levels_done == [0, 1]
    ck.close()  # nothing left unreported
    assert lazyckpt.latest(levels).step == 6
    assert [p.name for p in sorted(Path(levels[1].path).iterdir())] == ["step-00000001.pt", "step-00000006.pt"]


def test_a_level_folder_that_cannot_be_made_is_refused_at_construction_naming_it(mem, tmp_path):
    (tmp_path / "disk").write_text("a file where the level's folder should be")
    before = set(threading.enumerate())
    with pytest.raises(LevelError, match=r"level 1 .*disk") as info:
        LazyCheckpointer(levels=[Level(mem), Level(tmp_path / "disk")])
    assert info.value.level == 1 and info.value.errno == errno.EEXIST
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("lazyckpt-")]


def test_a_step_of_any_integer_type_is_taken_and_others_refused(mem):
    np = pytest.importorskip("numpy")
    with LazyCheckpointer(levels=[Level(mem, keep=10)]) as ck:
        ck.save({"w": torch.ones(2)}, step=np.int64(4)).wait()
        ck.save({"w": torch.ones(2)}, step=torch.tensor(5)).wait()
        for bad in (True, 1.0, "6", -1, None):
            with pytest.raises(SaveRefusedError):
                ck.save({"w": torch.ones(2)}, step=bad)
    assert sorted(os.listdir(mem)) == ["step-00000004.pt", "step-00000005.pt"]


def test_unseen_level_error_is_raised_once_by_the_next_save(mem, tmp_path, monkeypatch):
    disk = str(tmp_path / "disk")
    real = _fs.open_temporary
    monkeypatch.setattr(
        _fs, "open_temporary",
        lambda tmp, size: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")) if tmp.startswith(disk)
        else real(tmp, size),
    )  # fmt: skip
    step = _train()
    ck = LazyCheckpointer(levels=[Level(mem, every=1, keep=2), Level(disk, every=2)])
    h = ck.save(step(2), step=2)
    h.exception(timeout=60)  # done; not seen
    with pytest.raises(LevelError):
        ck.save(step(3), step=3)
    ck.save(step(4), step=4).exception(timeout=60)
    monkeypatch.setattr(_fs, "open_temporary", real)
    with pytest.raises(LevelError):  # step 4's disk copy failed; nobody saw it
        ck.close()
    assert h.exception() is not None


def test_skip_backpressure_skips_only_the_slow_level(mem, tmp_path, monkeypatch):
    entered, release = _hold_copies(monkeypatch)
    levels = [Level(mem, every=1, keep=5), Level(tmp_path / "disk", every=1, backlog=1)]
    step = _train()
    with LazyCheckpointer(levels=levels, on_backpressure="skip") as ck:
        h1 = ck.save(step(1), step=1)
        h1.wait_local()  # confirms it (as the next optimizer step would, whichever the regime): the copy starts
        assert entered.wait(60)
        with pytest.warns(BackpressureWarning, match=r"skipped level 1 .* 1 earlier copies .* backlog bound 1") as rec:
            h2 = ck.save(step(2), step=2)
        h2.wait()
        assert h2.levels_done == [0] and h2.levels_skipped == [1] and ck.skipped_copies == 1
        assert rec[0].filename == __file__  # the caller's line, not lazyckpt's
        release.set()
        h1.wait()
    assert os.path.exists(levels[0].file(2)) and not os.path.exists(levels[1].file(2))
    assert os.path.exists(levels[1].file(1))


def test_memory_level_warns_at_the_first_save_with_numbers(mem, monkeypatch):
    monkeypatch.setattr(_copy, "memory_total", lambda: 1 << 20)
    with LazyCheckpointer(levels=[Level(mem, every=1, keep=2)]) as ck:
        numbers = r"MB \(level 0 .*keep=2.* of 1.05 MB\), more than 50% of RAM"
        with pytest.warns(lazyckpt.MemoryLevelWarning, match=numbers) as rec:
            ck.save({"w": torch.zeros(1 << 18)}, step=1)
        assert rec[0].filename == __file__  # the caller's line, not lazyckpt's
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.save({"w": torch.zeros(1 << 18)}, step=2)  # once


def test_s3_level_against_the_test_s3_server(mem, tmp_path, s3):
    opts, fs = s3
    url = f"s3://levels/{uuid.uuid4().hex[:8]}"
    levels = [Level(mem, every=1, keep=2), Level(url, every=2, keep=2, backlog=4)]  # never waits (-W error)
    step, want = _train(), {}
    with LazyCheckpointer(levels=levels, storage_options=opts, local_dir=str(tmp_path / "local")) as ck:
        for i in range(1, 8):
            want[i] = copy.deepcopy(s := step(i))
            h = ck.save(s, step=i)
        h.wait()
        assert h.levels_done == [0]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"), refresh=True))
    assert names == ["step-00000004.pt", "step-00000006.pt"]  # keep=2 at the S3 level
    shutil.rmtree(mem)  # the node is lost: only the object store is left
    found = lazyckpt.latest(levels, storage_options=opts)
    assert (found.step, found.level, found.path) == (6, 1, f"{url}/step-00000006.pt")
    assert_same(lazyckpt.load(found, storage_options=opts), want[6])
    # an S3 level as the fastest due one: a local staging file, uploaded, removed
    only = [Level(f"{url}-only", every=1, keep=1)]
    with LazyCheckpointer(levels=only, storage_options=opts, local_dir=str(tmp_path / "local2")) as ck:
        ck.save(want[1], step=1)
        ck.save(want[2], step=2).wait()
    found = lazyckpt.latest(only, storage_options=opts)
    assert found.step == 2 and found.path == f"{url}-only/step-00000002.pt"
    assert_same(lazyckpt.load(found, storage_options=opts), want[2])
    assert not any(n.endswith(".pt") for _, _, files in os.walk(tmp_path / "local2") for n in files)


def test_block_backpressure_waits_for_the_slow_level_and_warns(mem, tmp_path, monkeypatch):
    from lazyckpt.schedule import _multi

    monkeypatch.setattr(_multi, "WARN_AFTER_S", 0.0)  # any wait warns
    entered, release = _hold_copies(monkeypatch)
    levels = [Level(mem, every=1, keep=5), Level(tmp_path / "disk", every=1, backlog=1)]
    step = _train()
    with LazyCheckpointer(levels=levels) as ck:
        waiting = threading.Event()
        confirm = ck.wait_staged

        def about_to_wait(timeout=None):  # _admit confirms the pending saves, then waits for a slot
            confirm(timeout)
            waiting.set()

        monkeypatch.setattr(ck, "wait_staged", about_to_wait)
        h1 = ck.save(step(1), step=1)
        h1.wait_local()  # confirms it (as the next optimizer step would, whichever the regime): the copy starts
        assert entered.wait(60)
        s2, caught, out = step(2), [], {}

        def second() -> None:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out["h"] = ck.save(s2, step=2)
            caught.extend(w)

        t = threading.Thread(target=second)
        t.start()
        assert waiting.wait(60)
        assert "h" not in out  # save(step=2) waits for level 1's backlog
        release.set()
        t.join(60)
        assert not t.is_alive()
        out["h"].wait()
        h1.wait()
        assert out["h"].levels_done == [0, 1]
    msgs = [str(w.message) for w in caught if issubclass(w.category, BackpressureWarning)]
    assert msgs and "level 1" in msgs[0] and "backlog bound 1" in msgs[0], msgs


_CUT_SHORT = """
import errno, os, sys
from lazyckpt.schedule import _copy
from lazyckpt.storage import fs as _fs
src, out = sys.argv[1], sys.argv[2]
real, calls = _fs.pwrite_all, []

def pwrite_all(fd, view, offset):
    calls.append(offset)
    if len(calls) == 2:
        os.truncate(src, _copy.COPY_CHUNK // 2)  # the source cut short under the copy (not by lazyckpt)
    return real(fd, view, offset)

_fs.pwrite_all = pwrite_all
try:
    _copy.copy_file(src, os.path.join(out, "a.bin"), fsync=True)
except OSError as exc:
    print("OSError", exc.errno == errno.EFAULT, sorted(os.listdir(out)))
"""


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_source_cut_short_under_the_copy_fails_it_and_the_process_lives(tmp_path, mem, where):
    """The copy writes straight from a mapping of the source; a source truncated meanwhile fails the
    write (EFAULT), never the process (SIGBUS), and the mapping still closes (the failed write's
    frames are cleared: otherwise BufferError would replace the error). In a child process: a
    SIGBUS must not take the test run with it."""
    folder = tmp_path if where == "disk" else Path(mem)
    folder.mkdir(exist_ok=True)
    src = folder / "src.bin"
    src.write_bytes(os.urandom(_copy.DIRECT_MIN + 3 * _copy.COPY_CHUNK // 2 + 123))
    (folder / "out").mkdir()
    r = run_python(["-c", _CUT_SHORT, str(src), str(folder / "out")], dict(os.environ, PYTHONPATH=str(SRC)), 120)
    assert r.returncode == 0, r.stderr[-3000:]  # -7 would be SIGBUS
    assert r.stdout.split() == ["OSError", "True", "[]"], r.stdout + r.stderr[-3000:]  # EFAULT; no file left


def test_a_source_that_cannot_be_mapped_is_copied_through_a_buffer(tmp_path, monkeypatch):
    """Some filesystems (FUSE, network) refuse mmap (ENODEV): the copy reads through a page-aligned
    buffer instead, every byte kept, O_DIRECT as before."""
    import mmap as _mmap

    src = tmp_path / "src.bin"
    data = os.urandom(_copy.DIRECT_MIN + 3 * _copy.COPY_CHUNK // 2 + 123)
    src.write_bytes(data)
    real, refused = _mmap.mmap, []

    def mmap(fileno, *args, **kwargs):
        if fileno != -1:  # a file's mapping: refused; the anonymous buffer: allowed
            refused.append(fileno)
            raise OSError(errno.ENODEV, "No such device")
        return real(fileno, *args, **kwargs)

    monkeypatch.setattr(_mmap, "mmap", mmap)
    _copy.copy_file(str(src), str(tmp_path / "out" / "a.bin"), fsync=True)
    assert (tmp_path / "out" / "a.bin").read_bytes() == data
    assert len(refused) == 1  # tried once, then the buffer for every chunk


def test_a_big_copy_goes_through_o_direct_and_keeps_every_byte(tmp_path, monkeypatch):
    """Whole pages through the O_DIRECT descriptor, the tail buffered; a filesystem that refuses
    O_DIRECT for a write (EINVAL) gets the rest buffered."""
    src = tmp_path / "src.bin"
    data = os.urandom(_copy.DIRECT_MIN + 3 * _copy.COPY_CHUNK // 2 + 123)  # a partial chunk, a partial page
    src.write_bytes(data)
    direct_writes = []
    real_open, real_pwrite = _fs.open_direct, _fs.pwrite_all

    def open_direct(tmp):
        fd = real_open(tmp)
        direct_writes.append(fd)
        return fd

    def pwrite_all(fd, view, offset):
        if fd == direct_writes[-1] and len(direct_writes) == 2 and offset >= _copy.COPY_CHUNK:
            raise OSError(errno.EINVAL, "Invalid argument")  # the second copy: refused after one chunk
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(_fs, "open_direct", open_direct)
    monkeypatch.setattr(_fs, "pwrite_all", pwrite_all)
    for name in ("a.bin", "b.bin"):
        _copy.copy_file(str(src), str(tmp_path / "out" / name), fsync=True)
        assert (tmp_path / "out" / name).read_bytes() == data
    if direct_writes[0] < 0:
        pytest.skip("this filesystem takes no O_DIRECT")
    assert sorted(os.listdir(tmp_path / "out")) == ["a.bin", "b.bin"]  # no temporary left


@pytest.mark.parametrize(
    "field, value",
    [("every", 0), ("every", 1.5), ("every", "2"), ("every", True), ("keep", 0), ("keep", 2.5), ("backlog", 0),
     ("backlog", "2"), ("replicas", -1), ("replicas", 1.5), ("replicas", "1"), ("replicas", True)],
)  # fmt: skip
def test_a_level_refuses_counts_that_are_not_whole_numbers(tmp_path, field, value):
    """A float, a string or a bool where a count goes is a ValueError when the Level is made (not a
    TypeError at the first save, nor a silently truncated count)."""
    with pytest.raises(ValueError, match=f"Level {field} must be an int"):
        Level(tmp_path, **{field: value})


def test_a_levels_counts_are_ints(tmp_path):
    level = Level(tmp_path, every=torch.tensor(3).item(), keep=None, backlog=4, replicas=0)
    assert (level.every, level.keep, level.backlog, level.replicas) == (3, None, 4, 0)
    assert all(type(v) is int for v in (level.every, level.backlog, level.replicas))
