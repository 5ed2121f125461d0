"""Soundness of the staleness check, interrupts, forks, and frozen tensors (issue 11: 2, 4, 8, Also)."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from _util import assert_same, hold_copies
from lazyckpt import LazyCheckpointer, StaleTensorError
from lazyckpt.core import engine as _engine
from lazyckpt.storage import fs as _fs

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
    real_write = _engine.Engine._write_data

    def write(job, piece, data, addr):
        if piece.live:
            assert until.wait(30)
        return real_write(job, piece, data, addr)

    hold_copies(until, monkeypatch.setattr)
    monkeypatch.setattr(_engine.Engine, "_write_data", staticmethod(write))


def _exact_or_stale(h, path, want) -> None:
    """The save either committed exactly the state at save() or failed with StaleTensorError, no file."""
    try:
        h.wait()
    except StaleTensorError:
        assert not path.exists()
    else:
        assert_same(torch.load(path)["p"].detach(), want)


@contextlib.contextmanager
def _one_tracked_param_saved(tmp_path):
    """A save of one optimizer-owned parameter of ones, pending while the body runs (which gets the
    parameter, its optimizer and the handle); then the file must hold the ones."""
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer() as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "c.pt")
        yield p, opt, h
        h.wait()
    assert_same(torch.load(tmp_path / "c.pt")["p"], torch.nn.Parameter(torch.ones(1 << 20)))


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
            done = threading.Thread(target=lambda h=h, finish=finish: (h._o.staged.wait(30), finish.set()))
            done.start()  # "the kernel" ends once every reader is through, checks included
            _straddling_mul_(p, inside, finish)
            done.join()
            _exact_or_stale(h, tmp_path / f"c{i}.pt", want)
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

            def mutate(started=started):
                started.set()
                with torch.no_grad():
                    p.mul_(1.5)

            t = threading.Thread(target=mutate)
            t.start()
            t.join()  # the mutating thread is done: its bump is ordered before our wait()
            _exact_or_stale(h, tmp_path / f"c{i}.pt", want)
            monkeypatch.undo()


def test_mutation_after_wait_staged_is_not_reported_stale(tmp_path):
    """wait_staged() confirms on the calling thread: changes after it are legitimate."""
    with _one_tracked_param_saved(tmp_path) as (p, _, h):
        h.wait_staged()
        with torch.no_grad():
            p.mul_(3)


def test_step_after_copies_finished_is_not_reported_stale(tmp_path):
    """The guard confirms before the step changes the tensors, even when staging finished long ago."""
    with _one_tracked_param_saved(tmp_path) as (p, opt, h):
        h._o.staged.wait(30)  # staged, not yet confirmed
        p.grad = torch.ones_like(p)
        opt.step()


# -- item 8: Ctrl-C and fork -------------------------------------------------------------------------


def test_ctrl_c_while_save_waits_for_host_buffers_propagates(tmp_path, monkeypatch):
    """save() blocks on a full pool (writes held, an unguarded tensor larger than the budget): a
    Ctrl-C right then must raise KeyboardInterrupt from save(), leave no temporary file, and not
    hang or re-raise from the later wait()/close(). Before the fix, ``_start`` caught it: save()
    returned a handle and no KeyboardInterrupt was seen.

    The interrupt is raised from inside the pool's wait, exactly where Python's SIGINT handler
    raises it when the signal lands during the blocking acquire. (An earlier version sent a real
    SIGINT from another thread once the wait was entered; on CPython 3.11 a signal that lands just
    before the acquire can stay pending while the main thread blocks, and CI hung once that way.)
    """
    from _util import WriteGate

    gate = WriteGate(monkeypatch)
    c = LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=1 << 20, writer_threads=1)
    cond = c.pool._cond
    waits = []

    def interrupted(*a, **k):
        waits.append(threading.current_thread())
        raise KeyboardInterrupt

    monkeypatch.setattr(cond, "wait", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            c.save({"x": torch.ones(1 << 20)}, tmp_path / "c.pt")  # 4 MiB through a 1 MiB budget
        assert waits == [threading.current_thread()]  # it was save() itself that waited for buffers
    finally:
        gate.release()
        monkeypatch.undo()
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

    tmp = _fs.temporary_path(str(tmp_path / "c.pt"))
    assert f".lazyckpt-{_fs.host_tag()}-{os.getpid()}-" in os.path.basename(tmp)
    assert _fs.is_temporary(tmp)


def test_cleanup_keeps_other_hosts_temporaries(tmp_path):
    """Another node's in-flight temporary whose pid happens not to run here must survive. Before the
    fix names carried no host, so every temporary with a pid dead on this host was deleted."""
    from lazyckpt import cleanup_temporaries

    dead = _dead_pid()
    here = tmp_path / f".c.pt.lazyckpt-{_fs.host_tag()}-{dead}-0.tmp"
    other = tmp_path / f".c.pt.lazyckpt-node-17.cluster-{dead}-0.tmp"
    mine = tmp_path / f".c.pt.lazyckpt-{_fs.host_tag()}-{os.getpid()}-0.tmp"
    for f in (here, other, mine):
        f.write_bytes(b"partial")
    assert cleanup_temporaries(tmp_path) == [str(here)]
    assert sorted(os.listdir(tmp_path)) == sorted([other.name, mine.name])


def test_cleanup_of_old_style_names_waits_for_them_to_go_quiet(tmp_path):
    """Old names (``.<name>.lazyckpt-<pid>-<n>.tmp``) do not say which host wrote them: they are
    still temporaries, removed when their pid is dead here and nothing wrote them for an hour."""
    import time

    from lazyckpt import cleanup_temporaries

    dead = _dead_pid()
    fresh = tmp_path / f".c.pt.lazyckpt-{dead}-0.tmp"
    stale = tmp_path / f".d.pt.lazyckpt-{dead}-1.tmp"
    for f in (fresh, stale):
        f.write_bytes(b"partial")
    old = time.time() - 2 * _fs.OLD_STYLE_QUIET_S
    os.utime(stale, (old, old))
    assert _fs.is_temporary(fresh.name)
    assert cleanup_temporaries(tmp_path) == [str(stale)]
    assert os.listdir(tmp_path) == [fresh.name]


# -- item 4: updates that bypass optimizer.step() ------------------------------------------------------


def _functional_sgd_(params, lr=0.5):
    """An update that never calls Optimizer.step() (as a DDP comm hook's fused optimizer does)."""
    with torch.no_grad():
        torch._foreach_add_(params, [torch.ones_like(p) for p in params], alpha=-lr)


def test_update_bypassing_step_while_copy_pending_fails_loudly(tmp_path, monkeypatch):
    """The guard never runs for such an update: the version jump must fail the save (held copy)."""
    copy_may_run = threading.Event()
    _hold_readers(monkeypatch, copy_may_run)
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer(zero_copy=False) as c:
        c.track(opt)
        h = c.save({"p": p}, tmp_path / "c.pt")
        _functional_sgd_([p])
        copy_may_run.set()
        with pytest.raises(StaleTensorError):
            h.wait()
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero_copy"])
def test_capture_in_save_orders_the_copy_before_later_updates(tmp_path, monkeypatch, zero_copy):
    """``capture_in_save=True``: save() copies optimizer-owned tensors too before it returns (CPU),
    so an update that bypasses the guard right after save() changes nothing in the file, even
    while every write is held. Before the option existed: TypeError."""
    from _util import WriteGate

    gate = WriteGate(monkeypatch)
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer(capture_in_save=True, direct_io=zero_copy, zero_copy=zero_copy) as c:
        c.track(opt)
        try:
            h = c.save({"p": p}, tmp_path / "c.pt")
            _functional_sgd_([p])
        finally:
            gate.release()
        h.wait()
    assert_same(torch.load(tmp_path / "c.pt")["p"].detach(), torch.ones(1 << 20))


# -- item 10 / 11 (the parts that run without a GPU) ---------------------------------------------------


def test_pinned_pool_pins_exactly_its_chunks_and_unpins_on_close(monkeypatch):
    """Pinned chunks are registered memory of exactly chunk_bytes, unregistered by close(). Before
    the fix they came from torch.empty(pin_memory=True) (rounded to a power of two by the caching
    host allocator, kept after close; on this CPU build it raised)."""
    from lazyckpt.core import pool as _pool

    registered: dict[int, int] = {}
    unregistered: list[int] = []
    monkeypatch.setattr(_pool, "_register", lambda addr, n: registered.__setitem__(addr, n))
    monkeypatch.setattr(_pool, "_unregister", unregistered.append)
    pool = _pool.HostBufferPool(4 << 20, 1 << 20, pin_memory=True)
    bufs = [pool.alloc(1 << 20) for _ in range(3)]
    assert sorted(registered.values()) == [1 << 20] * 3
    assert pool.pinned_bytes == 3 << 20 == sum(registered.values())
    assert all(b.view.data_ptr() in registered for b in bufs)
    for b in bufs:
        pool.release(b)
    pool.close()
    assert sorted(unregistered) == sorted(registered)
    assert pool.pinned_bytes == 0


def test_o_direct_refused_with_another_errno_falls_back(tmp_path, monkeypatch):
    """O_DIRECT from (pinned) memory refused with EFAULT: the bytes go through the buffered
    descriptor. Before the fix only EINVAL fell back: every save failed with WriteError."""
    import errno
    import fcntl

    real = _fs.pwrite_all
    refused = []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(offset)
            raise OSError(errno.EFAULT, "Bad address")
        return real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", pwrite)
    want = {"w": torch.randn(1 << 21)}
    with LazyCheckpointer(direct_io=True, zero_copy=False) as c:
        h = c.save(want, tmp_path / "c.pt")
        h.wait()
    assert_same(torch.load(tmp_path / "c.pt"), want)
    if _commit_supports_direct(tmp_path):
        assert refused


def _commit_supports_direct(directory) -> bool:

    fd = _fs.open_direct(os.path.join(directory, "c.pt"))
    if fd >= 0:
        os.close(fd)
    return fd >= 0


# -- Also (a): frozen tensors ---------------------------------------------------------------------------


def test_declared_frozen_tensors_are_not_copied_inside_save(tmp_path, monkeypatch):
    """A frozen base (requires_grad=False, no optimizer) declared frozen is copied in the background:
    with every read held, save() returns without having copied it, and the file is exact. Before the
    declaration existed, save() copied it on the caller's thread (and the test had no API to call)."""
    from _util import WriteGate

    base = torch.nn.Linear(512, 512).requires_grad_(False)
    lora = torch.nn.Parameter(torch.zeros(512, 8))
    opt = torch.optim.SGD([lora], lr=0.1)
    read_may_run = threading.Event()
    _hold_readers(monkeypatch, read_may_run)
    gate = WriteGate(monkeypatch)
    with LazyCheckpointer(zero_copy=False) as c:
        c.track(opt)
        c.declare_frozen(base)
        state = {"base": base.state_dict(), "lora": lora}
        want = {"base": {k: v.clone() for k, v in base.state_dict().items()}, "lora": lora.detach().clone()}
        try:
            h = c.save(state, tmp_path / "c.pt")  # returns although every lazyckpt memmove is held
            assert not h.staged()
        finally:
            read_may_run.set()
            gate.release()
        h.wait()
    got = torch.load(tmp_path / "c.pt")
    assert_same(got["base"], want["base"])
    assert_same(got["lora"].detach(), want["lora"])


def test_declaring_a_tensor_frozen_twice_keeps_one_entry_that_goes_with_the_tensor():
    """Declared again (each save of an integration declares what it saves): once a WeakSet compared the
    tensor with itself by ``==`` and raised "Boolean value of Tensor ... is ambiguous"."""
    import gc

    from lazyckpt.core import guard

    t = torch.ones(16)
    before = len(guard._frozen)
    with LazyCheckpointer() as c:
        c.declare_frozen(t)
        c.declare_frozen(t, t)
        assert len(guard._frozen) == before + 1
        assert t.untyped_storage().data_ptr() in guard.guarded_storages()
    del t
    gc.collect()
    assert len(guard._frozen) == before


def test_declared_frozen_tensor_changed_during_save_fails_loudly(tmp_path, monkeypatch):
    read_may_run = threading.Event()
    _hold_readers(monkeypatch, read_may_run)
    frozen = torch.ones(1 << 20)
    with LazyCheckpointer(zero_copy=False) as c:
        c.declare_frozen(frozen)
        h = c.save({"f": frozen}, tmp_path / "c.pt")
        frozen.add_(1)
        read_may_run.set()
        with pytest.raises(StaleTensorError):
            h.wait()
    assert not (tmp_path / "c.pt").exists()


def test_waiting_for_a_save_confirms_the_saves_committed_before_it(tmp_path, monkeypatch):
    """A thread waiting for its own save must not wait for itself through an earlier save: the
    committer commits in save order, and a save still read when the caller last called into
    lazyckpt can be confirmed only on that caller's thread (Lightning's ``OnExceptionCheckpoint``:
    a save outside ``fit`` right after ``ModelCheckpoint``'s, no step between; it hung ~1 in 8 CI
    runs). Forced: the first save's reads are held through the second ``save()``."""
    reads_may_run = threading.Event()
    p = torch.nn.Parameter(torch.ones(1 << 20))
    opt = torch.optim.SGD([p], lr=0.1)
    with LazyCheckpointer() as c:
        c.track(opt)
        _hold_readers(monkeypatch, reads_may_run)
        first = c.save({"p": p}, tmp_path / "a.pt")
        second = c.save({"x": torch.full((1 << 10,), 2.0)}, tmp_path / "b.pt")  # a's copies still held
        reads_may_run.set()
        second.wait(20)  # confirms a on this thread; without that, the committer waits on a for ever
        first.wait(20)
        with torch.no_grad():
            p.mul_(3)  # after the waits: the files hold the state at save()
    assert_same(torch.load(tmp_path / "a.pt")["p"], torch.nn.Parameter(torch.ones(1 << 20)))
    assert_same(torch.load(tmp_path / "b.pt")["x"], torch.full((1 << 10,), 2.0))
