"""``DistributedCheckpointer(levels=...)`` in this process, on a 1-rank gloo group: retention that
never removes a step a copy still reads, backpressure, errors reported once, a URL level, the
refusals, and ``latest()``'s bounded exchange (never a hang: the missing ranks named)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
import warnings

import fsspec
import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402

import _launch  # noqa: E402
import lazyckpt  # noqa: E402
from lazyckpt import BackpressureWarning, Level, SaveRefusedError  # noqa: E402
from lazyckpt.cluster._collective import StoreExchange  # noqa: E402
from lazyckpt.distributed import DistributedCheckpointer, DistributedLevelError, _levels  # noqa: E402
from lazyckpt.schedule import _runner  # noqa: E402
from lazyckpt.storage import fs as _fs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
OPTS = dict(host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=20)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with _launch.one_rank_group():
        yield


def _state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "b": torch.arange(300.0) * step, "meta": {"step": step}}


def _load(path: str) -> dict:
    state = {"w": torch.empty(64, 64), "b": torch.empty(300), "meta": {"step": -1}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def _steps(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def test_retention_keeps_a_step_until_every_slower_level_has_copied_it(mem, tmp_path, monkeypatch):
    """Memory keep=1, two disk levels every 2: while the second disk's copy of step 2 is held (the
    first's done), step 3 commits to memory and its retention runs; step 2 stays (pinned by the
    copy still to come) until that copy has read it, then goes."""
    disk, disk2 = tmp_path / "disk", tmp_path / "disk2"
    release, entered = threading.Event(), threading.Event()
    real = _levels.copy_checked

    def held(src, staging, *args, **kwargs):
        if os.path.dirname(staging) == str(disk2):
            entered.set()
            release.wait(10)  # bounded: never a hang
        return real(src, staging, *args, **kwargs)

    first_copied = threading.Event()
    real_copy = _runner.Runner._copy

    def promote(self, item):
        real_copy(self, item)
        if item.level == 1:
            first_copied.set()  # the first disk's copy of step 2 ended: its reader is gone

    monkeypatch.setattr(_levels, "copy_checked", held)
    monkeypatch.setattr(_runner.Runner, "_copy", promote)
    levels = [Level(mem, every=1, keep=1), Level(disk, every=2, keep=2), Level(disk2, every=2, keep=2)]
    with DistributedCheckpointer(levels=levels, **OPTS) as ckpt:
        h2 = ckpt.save(_state(2), step=2)
        assert entered.wait(10) and first_copied.wait(10)
        ckpt.save(_state(3), step=3).wait()  # memory retention ran after step 3's commit
        assert _steps(mem) == ["step-00000002", "step-00000003"]  # step 2 pinned, kept
        release.set()
        h2.wait()
        assert h2.levels_done == [0, 1, 2]
        ckpt.save(_state(4), step=4).wait()
        ckpt.wait()
    assert _steps(mem) == ["step-00000004"]
    for folder in (disk, disk2):
        assert _steps(folder) == ["step-00000002", "step-00000004"]
        assert _load(str(folder / "step-00000002"))["meta"] == {"step": 2}


def test_a_slow_level_at_its_backlog_bound_makes_save_wait_and_warn(mem, tmp_path, monkeypatch):
    """Disk backlog 1: with a copy to it running slowly (held up to 1 s), the next disk-due save
    waits for it, confirming its own pending file first, and warns with the numbers."""
    release = threading.Event()  # never set: each copy is slowed by the bounded wait
    real = _levels.copy_checked

    def slow(*args, **kwargs):
        release.wait(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(_levels, "copy_checked", slow)
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=1, keep=2, backlog=1)]
    with DistributedCheckpointer(levels=levels, **OPTS) as ckpt:
        ckpt.save(_state(1), step=1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            h = ckpt.save(_state(2), step=2)
        said = [str(w.message) for w in seen if issubclass(w.category, BackpressureWarning)]
        assert said and "level 1" in said[0] and "backlog bound 1" in said[0], said
        h.wait()
        assert h.levels_done == [0, 1]


def test_a_failed_level_is_raised_once_with_its_level_and_the_memory_level_goes_on(mem, tmp_path, monkeypatch):
    """ENOSPC on the disk level: the step's handle (or else wait(), or close()) raises one
    DistributedLevelError naming level 1; memory keeps every step."""
    disk = str(tmp_path / "disk")
    real = _fs.open_temporary

    def full(path, size):
        if os.path.dirname(os.path.dirname(path)) == disk:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return real(path, size)

    monkeypatch.setattr(_fs, "open_temporary", full)
    levels = [Level(mem, every=1, keep=3), Level(disk, every=2)]
    ckpt = DistributedCheckpointer(levels=levels, **OPTS)
    with pytest.raises(DistributedLevelError) as raised:
        ckpt.save(_state(2), step=2).wait()
    err = raised.value
    assert (err.level, err.level_path, err.step, err.ranks, err.errno) == (1, disk, 2, (0,), errno.ENOSPC)
    assert isinstance(err, lazyckpt.LevelError) and isinstance(err, lazyckpt.distributed.DistributedSaveError)
    assert isinstance(err.__cause__, OSError)
    ckpt.wait()  # raised by the handle: not again
    ckpt.save(_state(3), step=3).wait()
    ckpt.save(_state(4), step=4)  # its error unseen: wait() raises it, once
    with pytest.raises(DistributedLevelError, match="level 1"):
        ckpt.wait()
    ckpt.close()
    assert _steps(mem) == ["step-00000002", "step-00000003", "step-00000004"]
    assert _steps(disk) == []


def test_a_url_level_gets_metadata_last_and_latest_finds_it(mem, tmp_path):
    """A memory:// level every 2 (fed by the memory level's committed files): each step a prefix
    with ``.metadata``, loadable by stock DCP; keep=1 removes the older prefix; with the local
    levels gone, ``latest()`` finds it."""
    fs = fsspec.filesystem("memory")
    url = f"memory://levels-{uuid.uuid4().hex[:8]}/run"
    levels = [Level(mem, every=1, keep=1), Level(tmp_path / "disk", every=3), Level(url, every=2, keep=1)]
    with DistributedCheckpointer(levels=levels, local_dir=str(tmp_path / "tier"), **OPTS) as ckpt:
        for step in range(1, 5):
            ckpt.save(_state(step), step=step).wait()
        assert ckpt.latest() == lazyckpt.Found(os.path.join(mem, "step-00000004"), 4, 0)
    prefix = url.split("://", 1)[1]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False)) == ["step-00000004"]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{prefix}/step-00000004", detail=False))
    assert names[:2] == [".lazyckpt-manifest.json", ".metadata"] and names[2].startswith("__0_0."), names
    shutil.rmtree(mem)
    shutil.rmtree(tmp_path / "disk")
    found = lazyckpt.latest(levels)
    assert (found.step, found.level) == (4, 2)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    state = {"w": torch.empty(64, 64), "b": torch.empty(300), "meta": {"step": -1}}
    dcp.load(state, storage_reader=FsspecReader(found.path), no_dist=True)
    assert state["meta"] == {"step": 4} and torch.equal(state["w"], _state(4)["w"])
    fs.rm(url.split("://", 1)[1].split("/")[0], recursive=True)


def test_a_rollback_removes_the_old_timeline_at_every_level_at_its_first_save(mem, tmp_path):
    """Resumed from the disk level's step 80 (90 and 100 learned badly): the first save, at 81,
    removes the later steps at once at every level holding a step at or before 81 (the URL level's
    on its own thread, before any upload), not at each level's next commit (disk at 90, URL at 150):
    a crash in between must not make ``latest()`` return step 100 of the abandoned run."""
    fs = fsspec.filesystem("memory")
    url = f"memory://levels-{uuid.uuid4().hex[:8]}/run"
    disk = tmp_path / "disk"
    levels = [Level(mem, every=1, keep=3), Level(disk, every=10), Level(url, every=50)]
    kw = dict(local_dir=str(tmp_path / "tier"), **OPTS)
    with DistributedCheckpointer(levels=levels, **kw) as ckpt:
        for step in (40, 50, 60, 70, 80, 90, 100):
            ckpt.save(_state(step), step=step).wait()
    with DistributedCheckpointer(levels=levels, **kw) as ckpt:
        assert ckpt.latest().step == 100
        h = ckpt.save(_state(81), step=81)
        # no wait: the local levels' later steps are gone when save() returns
        assert _steps(disk) == [f"step-000000{s}" for s in (40, 50, 60, 70, 80)]
        assert "step-00000090" not in _steps(mem) and "step-00000100" not in _steps(mem)
        h.wait()
        ckpt.wait()
    prefix = url.split("://", 1)[1]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False)) == ["step-00000050"]
    assert _steps(mem) == ["step-00000080", "step-00000081"]
    found = lazyckpt.latest(levels)
    assert (found.step, found.level) == (81, 0)
    assert _load(found.path)["meta"] == {"step": 81}
    shutil.rmtree(mem)  # a reboot: the disk level's 80, not the old timeline's 100
    assert lazyckpt.latest(levels).step == 80
    fs.rm(prefix.split("/")[0], recursive=True)


def test_a_run_starting_below_every_step_a_level_holds_does_not_sweep_it(mem, tmp_path):
    """No rollback: a fresh run (or a step counter reset by mistake) into an older run's folders.
    A level holding nothing at or before the start keeps its steps until its own first commit."""
    disk = tmp_path / "disk"
    levels = [Level(mem, every=1, keep=3), Level(disk, every=5)]
    with DistributedCheckpointer(levels=levels, **OPTS) as ckpt:
        for step in (5, 10):
            ckpt.save(_state(step), step=step).wait()
    with DistributedCheckpointer(levels=levels, **OPTS) as ckpt:
        ckpt.save(_state(1), step=1).wait()
        assert _steps(disk) == ["step-00000005", "step-00000010"]
        ckpt.save(_state(5), step=5).wait()  # its first commit there: the old 10 goes
        assert _steps(disk) == ["step-00000005"]
    assert _steps(mem) == ["step-00000001", "step-00000005"]


def test_refusals(mem, tmp_path):
    with DistributedCheckpointer(**OPTS) as plain:
        with pytest.raises(SaveRefusedError, match="levels"):
            plain.save(_state(1), step=1)
        with pytest.raises(SaveRefusedError, match="levels"):
            plain.latest()
    with pytest.raises(ValueError, match="URL"):
        DistributedCheckpointer(levels=[Level(mem, every=2), Level("memory://x/run", every=3)], **OPTS)
    with pytest.raises(ValueError, match="share a path"):
        DistributedCheckpointer(levels=[Level(mem), Level(mem, every=2)], **OPTS)
    with DistributedCheckpointer(levels=[Level(mem, every=2)], **OPTS) as ckpt:
        with pytest.raises(SaveRefusedError):
            ckpt.save(_state(1), str(tmp_path / "x"), step=1)  # type: ignore[call-overload]
        with pytest.raises(SaveRefusedError, match="step"):
            ckpt.save(_state(1), step=-1)
        h = ckpt.save(_state(1), step=1)  # no level due: nothing written
        assert h.done() and h.stats.skipped
        ckpt.save(_state(2), str(tmp_path / "plain")).wait()  # a path save still works
    assert _steps(mem) == []


def test_a_rank_whose_check_fails_makes_the_others_fail_at_once_not_at_their_timeout():
    """Two ranks in two threads over one store: rank 1's check raises; rank 0 raises RuntimeError
    naming rank 1 right away (its timeout is 60 s), rank 1 its own error."""
    from lazyckpt.cluster._collective import agree

    store = dist.HashStore()
    outcome: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        def check(level, step, path):
            if r == 1:
                raise PermissionError("injected")
            return True

        try:
            agree({0: {5: f"/r{r}/step-5"}}, check, StoreExchange(store, "t", rank=r, world=2, timeout=60))
            outcome[r] = None
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank still waits"
    assert isinstance(outcome[1], PermissionError)
    assert isinstance(outcome[0], RuntimeError) and "rank 1: PermissionError: injected" in str(outcome[0])


def test_a_rank_that_holds_nothing_answers_none_at_once_and_so_do_the_others():
    """Rank 1's levels are empty (a replaced node, nothing shared yet): it posts that and returns
    None without waiting; rank 0, which holds step 5, reads it and returns None too."""
    from lazyckpt.cluster._collective import agree

    store = dist.HashStore()
    empty = StoreExchange(store, "t", rank=1, world=2, timeout=60)
    assert agree({0: {}}, lambda *a: True, empty) is None  # no wait: rank 0 has not posted yet
    holder = StoreExchange(store, "t", rank=0, world=2, timeout=5)
    assert agree({0: {5: "/r0/step-5"}}, lambda *a: True, holder) is None


def test_the_exchange_of_latest_is_bounded_and_names_the_missing_ranks():
    """A rank that never calls latest(): the others raise TimeoutError naming it, never hang."""
    store = dist.HashStore()
    alone = StoreExchange(store, "t", rank=0, world=3, timeout=0.3)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 2\] did not answer"):
        alone.all_gather({"steps": [1]})
    store.set("t2/0/r1", "7")
    pair = StoreExchange(store, "t2", rank=0, world=2, timeout=5)
    assert pair.all_gather(3) == [3, 7]
