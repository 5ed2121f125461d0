"""A save from a signal handler (``threads/reentry.py``): forced into every window where the main thread is
inside lazyckpt (holding each lock it takes in a save / step / wait / remove cycle, blocked in
``handle.wait()``, ``wait()`` and the step guard), it never deadlocks, is durable when it returns and holds
the state of that moment; a pending save of the same path is superseded, never renamed over it."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from tests import _launch

from lazyckpt import LazyCheckpointer
from lazyckpt.threads import reentry

pytestmark = pytest.mark.reentry

SCRIPT = Path(__file__).parent / "reentry_scripts" / "signal_windows.py"


def test_a_save_from_a_signal_handler_in_every_window_is_durable_and_right(tmp_path: Path) -> None:
    """The child raises the signal at every lock its main thread takes in four save / step / wait / remove
    cycles, then while it is blocked in each wait. With the protection removed (``reentered()`` always
    False) it deadlocks at the first lock; with it, it ends in seconds."""
    try:
        run = _launch.run_python([str(SCRIPT), str(tmp_path)], dict(os.environ), timeout=120)
    except subprocess.TimeoutExpired as exc:
        armed = [ln for ln in str(exc.stdout or "").splitlines() if ln.startswith(("ARMED", "FIRED"))]
        pytest.fail(f"deadlock: a save from the handler never returned (last: {armed[-1:] or 'the lock windows'})")
    assert run.returncode == 0 and "DONE" in run.stdout, run.stdout + run.stderr[-3000:]
    fired = next(ln for ln in run.stdout.splitlines() if ln.startswith("FIRED ")).split()
    sites = fired[2:]
    assert int(fired[1]) >= 50 and len(sites) >= 15, fired  # each lock of the save, commit, guard, ledger, ...
    for module in ("core/report.py", "core/pending.py", "core/committer.py", "core/job.py", "core/guard.py"):
        assert any(module in site for site in sites), (module, sites)
    assert run.stdout.count("OK ") == 3


def _held_stager(ckpt: LazyCheckpointer) -> threading.Event:
    hold = threading.Event()
    stage = ckpt._engine._stager._handle
    ckpt._engine._stager._handle = lambda job: (hold.wait(60), stage(job))[1]
    return hold


def test_a_reentered_save_supersedes_a_pending_save_of_the_same_path(tmp_path: Path) -> None:
    """The pending save is held before its write; a save of the same path made re-entered (what a signal
    handler that interrupted lazyckpt does) is on disk when it returns; once the held save finishes, the
    file is still the re-entered one's: the last save wins."""
    path = tmp_path / "c.pt"
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20)
    hold = _held_stager(ckpt)
    old = ckpt.save({"v": torch.zeros(1000)}, path)
    with reentry.inside():
        new = ckpt.save({"v": torch.ones(1000)}, path)
    assert new.done() and torch.equal(torch.load(path)["v"], torch.ones(1000))
    hold.set()
    old.wait(60)
    ckpt.close()
    assert torch.equal(torch.load(path)["v"], torch.ones(1000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_a_reentered_save_waits_out_a_rename_under_way_then_renames_last(tmp_path: Path, monkeypatch) -> None:
    """The committer is held inside its rename of the pending save (``publishing`` set, not ``published``):
    the re-entered save waits it out (bounded, no lock) and renames after it."""
    from lazyckpt.storage import fs as _fs

    real, entered, go = _fs.commit, threading.Event(), threading.Event()

    def held_commit(tmp: str, final: str, fsync: bool) -> None:
        if threading.current_thread().name.startswith("lazyckpt-committer"):
            entered.set()
            go.wait(60)
        real(tmp, final, fsync)

    monkeypatch.setattr(_fs, "commit", held_commit)
    path = tmp_path / "c.pt"
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20)
    old = ckpt.save({"v": torch.zeros(1000)}, path)
    assert entered.wait(60)
    main = threading.main_thread().ident

    def release_once_waiting() -> None:  # the main thread is in Engine.supersede's wait: let the rename go
        while not any(f.f_code.co_name == "supersede" for f in _frames(main)):
            threading.Event().wait(0.001)
        go.set()

    threading.Thread(target=release_once_waiting, daemon=True).start()
    with reentry.inside():
        ckpt.save({"v": torch.ones(1000)}, path)
    old.wait(60)
    ckpt.close()
    assert torch.equal(torch.load(path)["v"], torch.ones(1000))


def _frames(ident: int | None) -> list:
    import sys

    frame, out = sys._current_frames().get(ident), []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def test_a_wait_for_every_save_from_a_handler_that_interrupted_lazyckpt_returns_at_once(tmp_path: Path) -> None:
    """``wait()`` from such a handler may need the frame it interrupted: it returns at once (a warning),
    and the save made in the handler is durable already; the pending save is drained by the next wait."""
    ckpt = LazyCheckpointer(host_memory_budget=64 << 20)
    hold = _held_stager(ckpt)
    pending = ckpt.save({"v": torch.zeros(10)}, tmp_path / "a.pt")
    with reentry.inside():
        ckpt.save({"v": torch.ones(10)}, tmp_path / "b.pt")
        ckpt.wait()  # returns: it does not wait for a.pt (the stager is held)
    assert not pending.done() and torch.equal(torch.load(tmp_path / "b.pt")["v"], torch.ones(10))
    hold.set()
    ckpt.wait()
    ckpt.close()
    assert torch.equal(torch.load(tmp_path / "a.pt")["v"], torch.zeros(10))
