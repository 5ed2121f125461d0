"""Soundness of the staleness check, interrupts, forks, and frozen tensors (issue 11: 2, 4, 8, Also)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from _util import assert_same
from lazyckpt import LazyCheckpointer, StaleTensorError, _engine

_N = 4 << 20  # floats: 16 MiB, several pieces and (zero copy) several live pieces


def _straddling_mul_(t: torch.Tensor, inside_kernel: threading.Event, finish: threading.Event) -> None:
    """``t.mul_(2)`` as torch runs it, with a pause in the middle: the kernel writes the memory and
    only after it returns does torch bump ``t._version``. Writing through ``.data`` (its own version
    counter) and bumping by hand reproduces exactly that order."""
    flat = t.data.view(-1)
    half = flat.numel() // 2
    flat[:half].mul_(2)
    inside_kernel.set()
    assert finish.wait(30)
    flat[half:].mul_(2)
    torch.autograd.graph.increment_version(t)


def _hold_readers(monkeypatch, until: threading.Event) -> None:
    """Hold every lazyckpt read of a caller's tensor (stager memmove, live write) until ``until``."""
    real_memmove, real_write = _engine.ctypes.memmove, _engine.Engine._write_data

    class _Ctypes:
        def __getattr__(self, name):
            return getattr(ctypes, name)

        @staticmethod
        def memmove(dst, src, n):
            if threading.current_thread().name.startswith("lazyckpt-"):
                assert until.wait(30)
            return real_memmove(dst, src, n)

    def write(job, piece, data, addr):
        if piece.live:
            assert until.wait(30)
        return real_write(job, piece, data, addr)

    monkeypatch.setattr(_engine, "ctypes", _Ctypes())
    monkeypatch.setattr(_engine.Engine, "_write_data", staticmethod(write))


@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero_copy"])
def test_in_place_op_straddling_the_end_of_the_copy_never_commits_a_torn_file(tmp_path, monkeypatch, zero_copy):
    """The in-place op starts before lazyckpt reads the tensor and ends (version bumped) after the
    last reader's version check. Before the fix, that check passed and the file was committed with
    half the tensor doubled (``assert_same`` failed on every round); now the commit waits for a
    check on the training thread, which sees the bump."""
    p = torch.nn.Parameter(torch.arange(_N, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=0.1)
    for i in range(5):
        inside, finish = threading.Event(), threading.Event()
        _hold_readers(monkeypatch, inside)
        with LazyCheckpointer(direct_io=zero_copy, zero_copy=zero_copy, writer_threads=2, chunk_bytes=4 << 20) as c:
            c.track(opt)
            want = p.detach().clone()
            h = c.save({"p": p}, tmp_path / f"c{i}.pt")
            done = threading.Thread(target=lambda: (h._staged.wait(30), finish.set()))
            done.start()  # "the kernel" ends once every reader is through, checks included
            _straddling_mul_(p, inside, finish)
            done.join()
            try:
                h.wait()
            except StaleTensorError:
                assert not (tmp_path / f"c{i}.pt").exists()
            else:
                assert_same(torch.load(tmp_path / f"c{i}.pt")["p"].detach(), want)
        monkeypatch.undo()


def test_real_in_place_op_racing_the_copy_many_times(tmp_path, monkeypatch):
    """A real ``mul_`` on another thread, started while the copy is held, many times: every round
    either commits exactly the state at save() or fails with StaleTensorError."""
    p = torch.nn.Parameter(torch.ones(_N))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer(zero_copy=False, chunk_bytes=4 << 20) as c:
        c.track(opt)
        for i in range(10):
            started = threading.Event()
            _hold_readers(monkeypatch, started)
            want = p.detach().clone()
            h = c.save({"p": p}, tmp_path / f"c{i}.pt")

            def mutate():
                started.set()
                with torch.no_grad():
                    p.mul_(1.5)

            t = threading.Thread(target=mutate)
            t.start()
            t.join()  # the mutating thread is done: its bump is ordered before our wait()
            try:
                h.wait()
            except StaleTensorError:
                assert not (tmp_path / f"c{i}.pt").exists()
            else:
                assert_same(torch.load(tmp_path / f"c{i}.pt")["p"].detach(), want)
            monkeypatch.undo()


def test_mutation_after_wait_staged_is_not_reported_stale(tmp_path):
    """wait_staged() confirms on the calling thread: changes after it are legitimate."""
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer() as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "c.pt")
        h.wait_staged()
        with torch.no_grad():
            p.mul_(3)
        h.wait()
    assert_same(torch.load(tmp_path / "c.pt")["p"], torch.nn.Parameter(torch.ones(1 << 20)))


def test_step_after_copies_finished_is_not_reported_stale(tmp_path):
    """The guard confirms before the step changes the tensors, even when staging finished long ago."""
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer() as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "c.pt")
        h._staged.wait(30)  # staged, not yet confirmed
        p.grad = torch.ones_like(p)
        opt.step()
        h.wait()
    assert_same(torch.load(tmp_path / "c.pt")["p"], torch.nn.Parameter(torch.ones(1 << 20)))


# -- item 8: Ctrl-C and fork -------------------------------------------------------------------------


def test_ctrl_c_while_save_waits_for_host_buffers_propagates(tmp_path, monkeypatch):
    """save() blocks on a full pool (writes held, an unguarded tensor larger than the budget): a
    SIGINT delivered right then must raise KeyboardInterrupt from save(), leave no temporary file,
    and not hang or re-raise from the later wait()/close(). Before the fix, ``_start`` caught it:
    save() returned a handle and no KeyboardInterrupt was seen."""
    import signal

    from _util import WriteGate

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT is delivered to the main thread")
    gate = WriteGate(monkeypatch)
    c = LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=1 << 20, writer_threads=1)
    blocked = threading.Event()
    cond = c.pool._cond
    real_wait = cond.wait

    def waiting(*a, **k):
        blocked.set()
        return real_wait(*a, **k)

    monkeypatch.setattr(cond, "wait", waiting)

    def interrupt():
        assert blocked.wait(30)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    t = threading.Thread(target=interrupt)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            c.save({"x": torch.ones(1 << 20)}, tmp_path / "c.pt")  # 4 MiB through a 1 MiB budget
    finally:
        t.join()
        gate.release()
        try:
            c.wait()  # the interrupted save failed cleanly; its error was the KeyboardInterrupt itself
        finally:
            c.close()
    assert os.listdir(tmp_path) == []


def test_forked_child_with_saves_pending_steps_and_exits(tmp_path, monkeypatch):
    """A fork while a save's copies are held: the child (which has none of lazyckpt's threads) must
    step its optimizer and exit without hanging. Before the fix the child's step waited forever
    for the parent's stager (the test saw its exit timeout)."""
    import warnings

    from _util import WriteGate

    gate = WriteGate(monkeypatch)
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer(direct_io=True, writer_threads=1) as c:  # zero copy: staging waits for writes
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "c.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: that is the point
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                torch.set_num_threads(1)  # torch's OpenMP pool does not survive fork() (hangs without lazyckpt)
                p.grad = torch.ones_like(p)
                opt.step()
                code = 0
            finally:
                os._exit(code)
        status: list[int] = []
        waiter = threading.Thread(target=lambda: status.append(os.waitpid(pid, 0)[1]), daemon=True)
        waiter.start()
        waiter.join(30)
        if waiter.is_alive():
            os.kill(pid, 9)
            waiter.join()
        gate.release()
        h.wait()
    assert status and os.waitstatus_to_exitcode(status[0]) == 0, status


# -- item 9: temporaries on a directory shared by several hosts ---------------------------------------


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporary_names_carry_the_host(tmp_path):
    from lazyckpt import _commit

    tmp = _commit.temporary_path(str(tmp_path / "c.pt"))
    assert f".lazyckpt-{_commit.host_tag()}-{os.getpid()}-" in os.path.basename(tmp)
    assert _commit.is_temporary(tmp)


def test_cleanup_keeps_other_hosts_temporaries(tmp_path):
    """Another node's in-flight temporary whose pid happens not to run here must survive. Before the
    fix names carried no host, so every temporary with a pid dead on this host was deleted."""
    from lazyckpt import _commit, cleanup_temporaries

    dead = _dead_pid()
    here = tmp_path / f".c.pt.lazyckpt-{_commit.host_tag()}-{dead}-0.tmp"
    other = tmp_path / f".c.pt.lazyckpt-node-17.cluster-{dead}-0.tmp"
    mine = tmp_path / f".c.pt.lazyckpt-{_commit.host_tag()}-{os.getpid()}-0.tmp"
    for f in (here, other, mine):
        f.write_bytes(b"partial")
    assert cleanup_temporaries(tmp_path) == [str(here)]
    assert sorted(os.listdir(tmp_path)) == sorted([other.name, mine.name])


def test_cleanup_of_old_style_names_waits_for_them_to_go_quiet(tmp_path):
    """Old names (``.<name>.lazyckpt-<pid>-<n>.tmp``) do not say which host wrote them: they are
    still temporaries, removed when their pid is dead here and nothing wrote them for an hour."""
    import time

    from lazyckpt import _commit, cleanup_temporaries

    dead = _dead_pid()
    fresh = tmp_path / f".c.pt.lazyckpt-{dead}-0.tmp"
    stale = tmp_path / f".d.pt.lazyckpt-{dead}-1.tmp"
    for f in (fresh, stale):
        f.write_bytes(b"partial")
    old = time.time() - 2 * _commit.OLD_STYLE_QUIET_S
    os.utime(stale, (old, old))
    assert _commit.is_temporary(fresh.name)
    assert cleanup_temporaries(tmp_path) == [str(stale)]
    assert os.listdir(tmp_path) == [fresh.name]
