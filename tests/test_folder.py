"""Folder checkpoints in the core (lazyckpt.commit.folder): marker durable before any file commits, end, is_complete."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

import lazyckpt
from _util import WriteGate, assert_same
from lazyckpt import IncompleteCheckpointError, LazyCheckpointer, WriteError
from lazyckpt.commit import folder as _folder
from lazyckpt.commit.folder import (
    MARKER_PREFIX,
    FolderSave,
    is_complete,
    marker_is_stale,
    marker_owner,
    pending_markers,
)
from lazyckpt.storage import fs as _fs


@pytest.fixture
def ckpt():
    with LazyCheckpointer(host_memory_budget=8 << 20, writer_threads=2) as c:
        yield c


def _state():
    return {"w": torch.arange(1000, dtype=torch.float32), "step": 3}


class MarkerGate:
    """Holds the marker's fsync until release(): "the marker is not durable yet", deterministically."""

    def __init__(self, monkeypatch, fail: bool = False) -> None:
        self.entered, self.go, self.fail = threading.Event(), threading.Event(), fail
        self.threads: list[str] = []
        self._real = _fs.fsync_file
        monkeypatch.setattr(_fs, "fsync_file", self._fsync)

    def _fsync(self, path: str) -> None:
        if os.path.basename(path).startswith(MARKER_PREFIX):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.go.wait(10)
            if self.fail:
                raise OSError(5, "injected EIO on the marker")
        self._real(path)

    def release(self) -> None:
        self.go.set()


class SeenCommit(FolderSave):
    """Tells the test when the committer asks to commit a file of this save."""

    def __init__(self, *a, **kw) -> None:
        self.asked = threading.Event()
        super().__init__(*a, **kw)

    def before_commit(self) -> None:
        self.asked.set()
        super().before_commit()


def test_no_file_commits_before_the_marker_is_durable(tmp_path, ckpt, monkeypatch):
    gate = MarkerGate(monkeypatch)
    fs = SeenCommit(tmp_path / "ck", tag=0)
    assert [fs.marker] == [str(tmp_path / "ck" / n) for n in pending_markers(tmp_path / "ck")]
    assert not is_complete(tmp_path / "ck")
    h = fs.save(ckpt, _state(), tmp_path / "ck" / "model.pt")
    assert fs.asked.wait(10) and gate.entered.wait(10)  # written, fsynced, waiting only for the marker
    assert not (tmp_path / "ck" / "model.pt").exists()
    assert gate.threads and gate.threads[0] != threading.current_thread().name  # fsync off the caller's thread
    gate.release()
    h.wait()
    assert_same(torch.load(tmp_path / "ck" / "model.pt", weights_only=True), _state())
    assert not is_complete(tmp_path / "ck"), "complete only once end() ran"
    assert fs.end() is True
    assert is_complete(tmp_path / "ck") and pending_markers(tmp_path / "ck") == []


def test_marker_that_cannot_be_made_durable_fails_every_file(tmp_path, ckpt, monkeypatch):
    gate = MarkerGate(monkeypatch, fail=True)
    gate.release()
    fs = FolderSave(tmp_path / "ck", tag=0)
    h = fs.save(ckpt, _state(), tmp_path / "ck" / "model.pt")
    with pytest.raises(WriteError, match="injected EIO") as info:
        h.wait()
    assert isinstance(info.value.__cause__ or info.value.__context__, BaseException)
    with pytest.raises(IncompleteCheckpointError, match="model.pt"):
        fs.end()
    assert not (tmp_path / "ck" / "model.pt").exists()
    assert not is_complete(tmp_path / "ck") and pending_markers(tmp_path / "ck")


def test_end_refuses_while_a_file_is_pending(tmp_path, ckpt, monkeypatch):
    gate = WriteGate(monkeypatch)
    fs = FolderSave(tmp_path / "ck", tag=0)
    h = fs.save(ckpt, _state(), tmp_path / "ck" / "model.pt")
    with pytest.raises(IncompleteCheckpointError, match="before .*model.pt committed"):
        fs.end()
    assert not is_complete(tmp_path / "ck")
    gate.release()
    h.wait()
    assert fs.end() is True and is_complete(tmp_path / "ck")
    with pytest.raises(RuntimeError, match="has ended"):
        fs.save(ckpt, _state(), tmp_path / "ck" / "again.pt")


def test_each_writer_has_its_own_marker(tmp_path, ckpt):
    """Several processes (ranks) saving into one folder: complete only once the last one ended."""
    ranks = [FolderSave(tmp_path / "ck", tag=r, submit=lambda job: job()) for r in range(2)]
    handles = [fs.save(ckpt, _state(), tmp_path / "ck" / f"shard_{i}.pt") for i, fs in enumerate(ranks)]
    for h in handles:
        h.wait()
    assert len(pending_markers(tmp_path / "ck")) == 2
    assert ranks[1].end() and not is_complete(tmp_path / "ck")
    assert ranks[0].end() and is_complete(tmp_path / "ck")


def test_marker_fsync_runs_inline_when_no_thread_can_start(tmp_path, monkeypatch):
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    fs = FolderSave(tmp_path / "ck")
    assert fs.marker_durable.done() and fs.marker_durable.exception() is None  # never a before_commit that hangs
    assert fs.end() is True and is_complete(tmp_path / "ck")


def test_end_fsyncs_the_files_written_outside_lazyckpt(tmp_path, monkeypatch):
    synced: list[str] = []
    real = _fs.fsync_file
    monkeypatch.setattr(_fs, "fsync_file", lambda p: (real(p), synced.append(os.fspath(p))))
    fs = FolderSave(tmp_path / "ck", submit=lambda job: job())
    rng = tmp_path / "ck" / "random_states_0.pkl"
    rng.write_bytes(b"x")
    assert fs.end([rng, rng, tmp_path / "ck" / "never_written.pkl"]) is True
    assert synced == [fs.marker, str(rng)]  # each once; a file that is not there is skipped


def test_end_of_a_folder_deleted_meanwhile_is_a_no_op(tmp_path):
    fs = FolderSave(tmp_path / "ck", submit=lambda job: job())
    os.unlink(fs.marker)
    os.rmdir(tmp_path / "ck")
    assert fs.end() is False


def test_marker_names_stay_what_accelerate_wrote(tmp_path):
    fs = FolderSave(tmp_path / "ck", tag=3, submit=lambda job: job())
    name = os.path.basename(fs.marker)
    assert name.startswith(".lazyckpt-pending-3-")
    assert marker_owner(name) == _folder.MarkerOwner("3", socket.gethostname(), os.getpid())
    # a name written by lazyckpt.accelerate before the core owned the protocol (host names may have '-')
    assert marker_owner(".lazyckpt-pending-0-node-a-12-7") == _folder.MarkerOwner("0", "node-a", 12)
    assert marker_owner(".lazyckpt-pending-garbage") is None
    assert marker_owner("model.safetensors") is None
    with pytest.raises(ValueError):
        FolderSave(tmp_path / "x", tag="a-b")


def test_stale_markers_are_this_hosts_dead_processes_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid, host = int(dead.stdout), socket.gethostname()
    assert marker_is_stale(f"{MARKER_PREFIX}0-{host}-{pid}-0")
    assert not marker_is_stale(f"{MARKER_PREFIX}0-{host}-{os.getpid()}-0")  # alive
    assert not marker_is_stale(f"{MARKER_PREFIX}0-{host}.elsewhere-{pid}-0")  # another host: can't tell
    assert not marker_is_stale(f"{MARKER_PREFIX}garbage")


def test_live_markers_are_other_processes_saves_that_may_still_end(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    names = {
        "dead": f"{MARKER_PREFIX}1-{host}-{int(dead.stdout)}-0",
        "elsewhere": f"{MARKER_PREFIX}2-{host}.elsewhere-{int(dead.stdout)}-0",
        "live": f"{MARKER_PREFIX}3-{host}-{os.getppid()}-0",
    }
    for n in names.values():
        (tmp_path / n).write_text("")
    mine = FolderSave(tmp_path, tag=0, submit=lambda job: job())
    assert _folder.live_markers(tmp_path) == sorted([names["elsewhere"], names["live"]])
    assert os.path.basename(mine.marker) in _folder.live_markers(tmp_path, others_only=False)


def test_is_complete(tmp_path):
    assert lazyckpt.is_complete is is_complete
    assert not is_complete(tmp_path / "missing")
    assert is_complete(tmp_path)  # never written by lazyckpt
    (tmp_path / f"{MARKER_PREFIX}0-h-1-0").write_text("")
    assert not is_complete(tmp_path)
    (tmp_path / "file").write_text("")
    assert not is_complete(tmp_path / "file") and pending_markers(tmp_path / "file") == []
