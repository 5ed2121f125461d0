"""The job's explicit state (core/job.py): the stages and file states a save goes through, in order,
the commit only after both WRITTEN and CONFIRMED, and no move outside the table."""

from __future__ import annotations

import threading

import pytest
import torch

from lazyckpt import LazyCheckpointer, StaleTensorError
from lazyckpt.core import engine as _engine
from lazyckpt.core import job as _job
from lazyckpt.core.handle import wait_finished
from lazyckpt.core.job import FileState, Stage
from lazyckpt.storage import fs as _fs


def _record(monkeypatch) -> list[str]:
    """Every move of every job, and every commit (rename to the final name), in order."""
    seen: list[str] = []
    real_move, real_commit = _job.Job._move, _fs.commit

    def move(self, to):
        real_move(self, to)
        seen.append(to.name)

    def commit(tmp, final, fsync):
        seen.append("commit")
        return real_commit(tmp, final, fsync)

    monkeypatch.setattr(_job.Job, "_move", move)
    monkeypatch.setattr(_fs, "commit", commit)
    return seen


def _lazy_param(zero_copy: bool):
    p = torch.nn.Parameter(torch.randn(1 << 20 if zero_copy else 1000))
    opt = torch.optim.SGD([p], lr=0.1)
    return p, opt


@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero_copy"])
def test_a_lazy_save_reads_then_is_confirmed_then_commits(tmp_path, monkeypatch, zero_copy):
    p, opt = _lazy_param(zero_copy)
    seen = _record(monkeypatch)
    with LazyCheckpointer(direct_io=zero_copy, zero_copy=zero_copy) as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "a.pt")
        h.wait(30)
    stages = [s for s in seen if s in Stage.__members__]
    assert stages == ["CPU_STAGED", "COPIES_QUEUED", "READ", "CONFIRMED"]
    assert [s for s in seen if s in FileState.__members__] == ["OPEN", "WRITTEN"]
    assert seen.index("commit") > max(seen.index("CONFIRMED"), seen.index("WRITTEN"))


def test_a_save_with_nothing_lazy_is_confirmed_when_its_reads_end(tmp_path, monkeypatch):
    seen = _record(monkeypatch)
    with LazyCheckpointer() as c:
        c.save({"t": torch.randn(1000)}, tmp_path / "a.pt").wait(30)
    assert [s for s in seen if s in Stage.__members__] == ["CPU_STAGED", "COPIES_QUEUED", "CONFIRMED"]


def test_a_save_failed_while_read_is_confirmed_when_its_reads_end_and_discarded(tmp_path, monkeypatch):
    """Changed in place while the stager is held: the stager's check fails the job, and the end of its
    reads confirms it at once (nothing to check on the training thread); nothing is committed."""
    p, opt = _lazy_param(zero_copy=False)
    seen = _record(monkeypatch)
    gate, real_stage = threading.Event(), _engine.Engine._stage

    def held_stage(self, job):
        assert gate.wait(30)
        real_stage(self, job)

    monkeypatch.setattr(_engine.Engine, "_stage", held_stage)
    with LazyCheckpointer(zero_copy=False) as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "a.pt")
        with torch.no_grad():
            p.add_(1)
        gate.set()
        with pytest.raises(StaleTensorError):
            h.wait(30)
    assert [s for s in seen if s in Stage.__members__] == ["CPU_STAGED", "COPIES_QUEUED", "CONFIRMED"]
    assert "commit" not in seen
    assert not (tmp_path / "a.pt").exists()


def test_the_commit_waits_for_the_confirmation_not_only_for_the_file(tmp_path):
    """The file is written and the reads are over, but no thread that mutates the tensors has
    checked them yet: the job waits at READ, uncommitted, until a call into lazyckpt confirms it."""
    p, opt = _lazy_param(zero_copy=False)
    with LazyCheckpointer(zero_copy=False) as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "a.pt")
        job = h._o.confirm.__self__
        assert job.wait_for(Stage.READ, 30)
        with job._lock:
            assert job._changed.wait_for(lambda: job.file is FileState.WRITTEN, 30)
        assert not wait_finished(h, 1.0)  # the committer may run: it must not commit (no confirming here)
        assert job.stage is Stage.READ and not (tmp_path / "a.pt").exists()
        h.wait(30)  # confirms on this thread
        assert job.stage is Stage.CONFIRMED and (tmp_path / "a.pt").exists()


def test_a_move_outside_the_table_is_an_internal_error(tmp_path):
    p, opt = _lazy_param(zero_copy=False)
    with LazyCheckpointer(zero_copy=False) as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "a.pt")
        job = h._o.confirm.__self__
        h.wait(30)
    assert job.stage is Stage.CONFIRMED and job.file is FileState.WRITTEN
    job.reach(Stage.READ)  # already further: nothing
    with job._lock, pytest.raises(RuntimeError, match="internal error"):
        job._move(Stage.READ)
    with job._lock, pytest.raises(RuntimeError, match="internal error"):
        job._move(FileState.OPEN)
    assert job.stage is Stage.CONFIRMED and job.file is FileState.WRITTEN
