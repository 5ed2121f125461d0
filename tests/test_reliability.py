"""Crashes, slow and full storage, long runs, odd sizes: the promise holds under faults too."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import psutil
import pytest
import torch

import _launch
import lazyckpt
from _util import WriteGate, assert_same
from lazyckpt import LazyCheckpointer, WriteError, verify
from lazyckpt.storage import fs as _fs

SCRIPTS = Path(__file__).parent / "scripts"


def _env():
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(lazyckpt.__file__).parents[1]), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }


def _final_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if not p.name.startswith("."))


def _check_after_kill(folder: Path, newest: dict[str, int]) -> None:
    """Every file at a final name is a complete checkpoint; every save reported durable is still there."""
    for f in _final_files(folder):
        assert zipfile.ZipFile(f).testzip() is None, f
        assert verify(f).ok, verify(f).problems
        state = torch.load(f)
        assert set(state) == {"model", "optim", "step", "blob"}
    for path, step in newest.items():
        assert os.path.exists(path), f"{path} completed (step {step}) before the kill but is gone"
        assert torch.load(path)["step"] >= step


def _done_lines(text: str, newest: dict[str, int]) -> None:
    for line in text.splitlines():
        if line.startswith("DONE"):
            _, path, step = line.split()
            newest[path] = max(newest.get(path, -1), int(step))


KILL_POINTS = ("create", "mid-write", "before-fsync", "after-rename")


def test_sigkill_at_each_point_of_a_write(tmp_path):
    """A process SIGKILLed at each point of a checkpoint's write (before the temporary is created,
    halfway through a write, before the fsync, between the rename and the folder's fsync), on its
    third file, while earlier files of the same names exist: every file at a final name is a
    complete, valid checkpoint, every save reported durable survives, and the next writer cleans up
    the temporaries. The children run side by side, each its own folder."""
    folders = {p: tmp_path / p for p in KILL_POINTS}
    children = {}
    for point, folder in folders.items():
        folder.mkdir()
        children[point] = _launch.python([str(SCRIPTS / "crash_child.py"), str(folder), "0", point, "3"], _env())
    for point, child in children.items():
        out, _ = child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL and f"KILL {point}" in out, (point, child.returncode, out[-3000:])
        newest: dict[str, int] = {}
        _done_lines(out, newest)
        assert newest, f"{point}: no save completed before the kill"
        _check_after_kill(folders[point], newest)
        # Leftover temporaries are never mistaken for checkpoints and are cleaned by the next writer.
        with LazyCheckpointer() as c:
            c.save({"x": 1}, folders[point] / "after.pt").wait()
        assert not [p for p in folders[point].iterdir() if p.name.startswith(".")], point


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments(tmp_path):
    """Opt-in soak (-m soak): 20+ SIGKILLs at random moments mid-training: every file at a final name
    is a complete, valid checkpoint. test_sigkill_at_each_point_of_a_write forces each window."""
    rng = random.Random(int(os.environ.get("LAZYCKPT_SOAK_SEED", "20261129")))
    kills, start = 0, 0
    newest: dict[str, int] = {}  # final path -> newest completed step seen by the parent
    while kills < int(os.environ.get("LAZYCKPT_SOAK_KILLS", "22")):
        child = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "crash_child.py"), str(tmp_path), str(start)],
            stdout=subprocess.PIPE, text=True, env=_env(),
        )  # fmt: skip
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
        done_lines = rng.randint(0, 12)
        for _ in range(done_lines):  # let some saves complete, then kill at a random moment
            _done_lines(child.stdout.readline(), newest)
        threading.Event().wait(rng.uniform(0, 0.05))  # a random moment, not a wait for work
        child.send_signal(signal.SIGKILL)
        _done_lines(child.communicate()[0], newest)  # completions printed before the kill landed
        kills += 1
        start += 1000
        _check_after_kill(tmp_path, newest)
    with LazyCheckpointer() as c:
        c.save({"x": 1}, tmp_path / "after.pt").wait()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _mount_tmpfs(path: Path, size: str, ro: bool = False) -> bool:
    path.mkdir()
    opts = f"size={size}" + (",ro" if ro else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "2m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_real_full_filesystem(small_fs):
    c = LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=256 << 10)
    try:
        small = {"w": torch.randn(100_000)}  # 400 kB: fits
        c.save(small, small_fs / "c.pt").wait()
        with pytest.raises(WriteError) as info:  # 4 MB on a 2 MB filesystem
            c.save({"w": torch.randn(1_000_000)}, small_fs / "c.pt").wait()
        assert info.value.errno == errno.ENOSPC
        assert [p.name for p in small_fs.iterdir()] == ["c.pt"]
        assert_same(torch.load(small_fs / "c.pt"), small)
        c.save({"w": torch.ones(10)}, small_fs / "c.pt").wait()  # usable again
    finally:
        c.close()


def test_read_only_location(tmp_path):
    mnt = tmp_path / "ro"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "1m", ro=True):
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        with LazyCheckpointer() as c, pytest.raises(WriteError) as info:
            c.save({"a": torch.ones(3)}, mnt / "c.pt")
        assert info.value.errno == errno.EROFS
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _throttle(monkeypatch, seconds_per_mb: float):
    real = _fs.pwrite_all
    pause = threading.Event()

    def slow(fd, data, offset):
        pause.wait(len(data) / 1e6 * seconds_per_mb)  # storage speed, not a wait for our own work
        return real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", slow)


def test_block_policy_bounds_memory_with_slow_storage(tmp_path, monkeypatch):
    """Storage ten times slower than saves arrive: memory stays in budget, nothing is lost."""
    _throttle(monkeypatch, 0.01)  # 100 MB/s
    budget = 512 << 10
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wants = []
    with LazyCheckpointer(host_memory_budget=budget, chunk_bytes=128 << 10) as c:
        for i in range(10):
            model(torch.randn(4, 512)).sum().backward()
            opt.step()
            state = {"i": i, "m": model.state_dict()}
            wants.append(
                (
                    {"i": i, "m": {k: v.clone() for k, v in model.state_dict().items()}},
                    c.save(state, tmp_path / f"{i}.pt"),
                )
            )
            assert c.pool.allocated_bytes <= budget
        for want, h in wants:
            h.wait()
            assert_same(torch.load(h.path), want)


def test_skip_policy_keeps_staged_saves(tmp_path, monkeypatch):
    gate = WriteGate(monkeypatch)
    with LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=256 << 10, on_backpressure="skip") as c:
        kept = [c.save({"i": 0, "w": torch.randn(150_000)}, tmp_path / "0.pt")]
        with pytest.warns(lazyckpt.BackpressureWarning):
            skipped = [c.save({"i": i, "w": torch.randn(150_000)}, tmp_path / f"{i}.pt") for i in range(1, 6)]
        gate.release()
        assert all(h.wait().skipped for h in skipped) and c.skipped_saves == 5
        assert not kept[0].wait().skipped
    assert [p.name for p in _final_files(tmp_path)] == ["0.pt"]


@pytest.mark.slow(reason="200 saves in a row, watching memory and open files")
@pytest.mark.timeout(600)
def test_bounded_resources_over_200_saves(tmp_path):
    proc = psutil.Process()
    state = {f"w{i}": torch.randn(1_250_000) for i in range(10)}  # 50 MB
    opt = torch.optim.SGD([torch.nn.Parameter(t) for t in state.values()], lr=0.1)
    c = LazyCheckpointer(host_memory_budget=256 << 20, fsync=False)
    c.track(opt)
    samples = {}
    for i in range(200):
        c.save(state, tmp_path / f"c{i % 2}.pt").wait()
        if i in (20, 199):
            samples[i] = (proc.memory_info().rss, c.pool.allocated_bytes, proc.num_fds(), threading.active_count())
    c.close()
    (rss0, pool0, fds0, thr0), (rss1, pool1, fds1, thr1) = samples[20], samples[199]
    assert pool1 == pool0, "host buffers grew after warm-up"
    assert fds1 == fds0 and thr1 == thr0
    assert rss1 - rss0 < 64 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB over 180 saves"
    assert not [t for t in threading.enumerate() if t.name.startswith("lazyckpt-")]


@pytest.mark.parametrize("mode", ["exit", "sigint"])
def test_exit_without_close_still_drains(tmp_path, mode):
    child = _launch.python([str(SCRIPTS / "exit_child.py"), str(tmp_path), mode], _env())
    out, _ = child.communicate(timeout=120)
    if mode == "sigint":
        assert "KeyboardInterrupt" in out
    else:
        assert child.returncode == 0, out
    files = _final_files(tmp_path)
    assert [f.name for f in files] == [f"ckpt-{i}.pt" for i in range(5)]
    for i, f in enumerate(files):
        assert torch.load(f)["step"] == i and verify(f).ok
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_keyboard_interrupt_in_loop_keeps_pending_saves(tmp_path):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt), LazyCheckpointer() as c:
        for i in range(3):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            c.save({"i": i, "m": model.state_dict()}, tmp_path / f"{i}.pt")
        raise KeyboardInterrupt
    assert [torch.load(tmp_path / f"{i}.pt")["i"] for i in range(3)] == [0, 1, 2]


@pytest.mark.slow(reason="100,000 tensors saved and read back one by one")
def test_many_tiny_tensors(tmp_path):
    obj = {f"t{i}": torch.full((3,), float(i)) for i in range(100_000)}
    with LazyCheckpointer() as c:
        c.save(obj, tmp_path / "tiny.pt").wait()
    got = torch.load(tmp_path / "tiny.pt", mmap=True)
    assert len(got) == 100_000 and got["t99999"][0] == 99999.0 and got["t5"][2] == 5.0
    assert zipfile.ZipFile(tmp_path / "tiny.pt").testzip() is None


@pytest.mark.slow(reason="a 2 GiB tensor written and read back")
@pytest.mark.timeout(600)
def test_tensor_over_2gib(tmp_path):
    big = torch.empty((2 << 30) + 4096, dtype=torch.uint8)
    big[:: 1 << 20] = 7
    big[-1] = 9
    with LazyCheckpointer(host_memory_budget=256 << 20) as c:
        c.save({"big": big, "small": torch.ones(2)}, tmp_path / "big.pt").wait()
    got = torch.load(tmp_path / "big.pt", mmap=True)
    assert got["big"].shape == big.shape and got["big"][-1] == 9 and got["big"][1 << 20] == 7
    assert torch.equal(got["big"][:: 1 << 20], big[:: 1 << 20])
    assert verify(tmp_path / "big.pt").ok
