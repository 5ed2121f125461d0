"""Zero-copy writes: large CPU tensors an optimizer owns are written straight from their memory,
through O_DIRECT on a disk, or buffered into a memory filesystem (tmpfs: a write there is one memory
copy, from the tensor as well as from a staging buffer).

The file must hold the state at save() whatever comes first: the writers, an optimizer step (which
copies whatever the writers have not started and waits for what they are writing), wait_staged(),
or an in-place change by other means (which fails the save). Every stock reader must read the file,
including torch >= 2.5's computed-offsets mode, which the layout's padding would fool if the file
claimed the minimal layout.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _util import assert_same
from lazyckpt import LazyCheckpointer, StaleTensorError, WriteError, verify
from lazyckpt.core import engine as _engine
from lazyckpt.core import job as _job
from lazyckpt.core.plan import usable_cpus
from lazyckpt.storage import fs as _fs

SHM = "/dev/shm"


@pytest.fixture(params=["disk", "memory"])
def where(request, tmp_path):
    """(folder, checkpointer options): a disk folder with direct I/O, or a tmpfs folder with a core
    to spare (torch on one thread: otherwise save() writes a tmpfs file itself, from the tensors)."""
    if request.param == "disk":
        yield tmp_path, {"direct_io": True}
        return
    if not (os.path.isdir(SHM) and os.access(SHM, os.W_OK) and _fs.is_memory_filesystem(SHM)):
        pytest.skip("no writable tmpfs at /dev/shm")
    if usable_cpus() < 2:
        pytest.skip("needs 2 CPUs to leave one spare")
    folder = Path(request.getfixturevalue("mem"))  # conftest's: a folder on /dev/shm, removed afterwards
    folder.mkdir()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield folder, {}
    finally:
        torch.set_num_threads(before)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)  # optimizer state exists, and the optimizer is known to the guard
    return model, opt


def _train_step(model, opt):
    model(torch.randn(16, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}


class _Writes:
    """Records every data write as live (from the tensor's memory) or staged; can hold the first
    live write until released."""

    def __init__(self, monkeypatch, hold_first_live=False):
        self.live = 0
        self.staged = 0
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first_live:
            self.release.set()
        real = _engine.Engine._write_data

        def recording(job, piece, data, addr):
            if piece.live and addr == piece.source.data_ptr + piece.start:
                self.live += 1
                if not self.started.is_set():
                    self.started.set()
                    assert self.release.wait(60), "test never released the held write"
            elif piece.source.nbytes >= 1 << 20:  # small tensors are always staged
                self.staged += 1
            return real(job, piece, data, addr)

        monkeypatch.setattr(_engine.Engine, "_write_data", staticmethod(recording))


@contextlib.contextmanager
def _held_save(tmp_path, monkeypatch, **options):
    """A save of a trained model whose first live write (one writer thread) is held until
    ``writes.release`` is set; yields model, opt, ckpt, handle, want (the state at save) and writes."""
    model, opt = _model_and_optimizer()
    writes = _Writes(monkeypatch, hold_first_live=True)
    with LazyCheckpointer(**{"direct_io": True, **options}, writer_threads=1) as ckpt:
        want = copy.deepcopy(_state(model, opt))
        handle = ckpt.save(_state(model, opt), tmp_path / "a.pt")
        assert writes.started.wait(30)
        yield SimpleNamespace(model=model, opt=opt, ckpt=ckpt, handle=handle, want=want, writes=writes)


def _release_after_claim(monkeypatch, writes):
    """Let the held live write go on once a guard (or wait_staged) has claimed the queued pieces."""
    real = _job.Job.claim_live

    def claim_then_release(job):
        claimed = real(job)
        writes.release.set()
        return claimed

    monkeypatch.setattr(_job.Job, "claim_live", claim_then_release)


def _check_file(path, want):
    from torch.utils.serialization import config

    assert_same(torch.load(path), want)
    assert_same(torch.load(path, mmap=True), want)
    old = config.load.calculate_storage_offsets
    config.load.calculate_storage_offsets = True
    try:  # the padded layout must not be taken for torch.save's minimal one
        assert_same(torch.load(path, mmap=True), want)
    finally:
        config.load.calculate_storage_offsets = old
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert verify(path).ok, verify(path).problems


def test_writers_first_file_is_the_state_at_save(where, monkeypatch):
    folder, options = where
    model, opt = _model_and_optimizer()
    writes = _Writes(monkeypatch)
    with LazyCheckpointer(**options) as ckpt:
        want = copy.deepcopy(_state(model, opt))
        handle = ckpt.save(_state(model, opt), folder / "a.pt")
        handle.wait()
        _train_step(model, opt)
    assert writes.live > 0 and writes.staged == 0, "large optimizer-owned tensors go straight from memory"
    _check_file(folder / "a.pt", want)
    with zipfile.ZipFile(folder / "a.pt") as z:
        assert "a/.format_version" not in z.namelist()


def test_optimizer_step_copies_what_writers_have_not_reached(where, monkeypatch):
    tmp_path, options = where
    with _held_save(tmp_path, monkeypatch, **options) as held:
        model, opt, handle, want, writes = held.model, held.opt, held.handle, held.want, held.writes
        # The step's guard copies every piece still queued, then waits for the one being written,
        # which goes on once the others are claimed.
        _release_after_claim(monkeypatch, writes)
        _train_step(model, opt)  # changes every parameter and every optimizer state tensor
        assert handle.staged()
        stats = handle.wait()
    assert writes.live == 1 and writes.staged > 0
    assert stats.guard_wait_s > 0
    _check_file(tmp_path / "a.pt", want)
    assert not torch.equal(model[0].weight, want["model"]["0.weight"])


def test_wait_staged_copies_instead_of_waiting_for_storage(tmp_path, monkeypatch):
    with _held_save(tmp_path, monkeypatch) as held:
        model, ckpt, handle, want, writes = held.model, held.ckpt, held.handle, held.want, held.writes
        with pytest.raises(TimeoutError):  # the held piece is still being read from the tensor
            handle.wait_staged(timeout=0.2)
        pieces = ckpt._pending.jobs()[-1].live_pieces
        assert all(p.state is not _job.PieceState.QUEUED for p in pieces), "the rest was copied"
        writes.release.set()
        handle.wait_staged()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # allowed now: not a stale save
        handle.wait()
    _check_file(tmp_path / "a.pt", want)


def test_in_place_change_while_written_from_memory_fails_loudly(where, monkeypatch):
    tmp_path, options = where
    with _held_save(tmp_path, monkeypatch, **options) as held:
        model, handle, writes = held.model, held.handle, held.writes
        with torch.no_grad():
            model[0].weight.mul_(2.0)  # not an optimizer step: nothing holds it back
        writes.release.set()
        with pytest.raises(StaleTensorError):
            handle.wait()
    assert not (tmp_path / "a.pt").exists()
    assert os.listdir(tmp_path) == []


def test_write_error_on_a_live_piece_fails_the_save_and_releases_the_guard(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    real = _fs.pwrite_all

    def failing(fd, data, offset):
        if len(data) >= 1 << 20:
            raise OSError(5, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", failing)
    with LazyCheckpointer(direct_io=True) as ckpt:
        handle = ckpt.save(_state(model, opt), tmp_path / "a.pt")
        _train_step(model, opt)  # must not hang on the failed save
        with pytest.raises(WriteError):
            handle.wait()
    assert os.listdir(tmp_path) == []


def test_model_deleted_after_save_is_still_written(tmp_path):
    model, opt = _model_and_optimizer()
    want = copy.deepcopy(_state(model, opt))
    with LazyCheckpointer(direct_io=True) as ckpt:
        handle = ckpt.save(_state(model, opt), tmp_path / "a.pt")
        del model, opt  # the save keeps the memory alive until it is written
        handle.wait()
    _check_file(tmp_path / "a.pt", want)


def test_zero_copy_off_keeps_torch_save_layout(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    writes = _Writes(monkeypatch)
    with LazyCheckpointer(direct_io=True, zero_copy=False) as ckpt:
        ckpt.save(_state(model, opt), tmp_path / "a.pt").wait()
    assert writes.live == 0 and writes.staged > 0
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        assert z.read("a/.format_version") == b"1"


def test_many_saves_and_steps_interleaved(tmp_path):
    """Saves, steps and saves again without waiting: each file is its own moment."""
    model, opt = _model_and_optimizer()
    wants = []
    with LazyCheckpointer(direct_io=True) as ckpt:
        for i in range(4):
            wants.append(copy.deepcopy(_state(model, opt)))
            ckpt.save(_state(model, opt), tmp_path / f"{i}.pt")
            _train_step(model, opt)
            if i % 2:
                ckpt.save(_state(model, opt), tmp_path / f"{i}.pt")  # same path again: last one wins
                wants[-1] = copy.deepcopy(_state(model, opt))
                _train_step(model, opt)
        ckpt.wait()
    for i, want in enumerate(wants):
        _check_file(tmp_path / f"{i}.pt", want)


def test_safetensors_tensors_are_ordered_for_zero_copy(tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model, opt = _model_and_optimizer()
    writes = _Writes(monkeypatch)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want["half"] = torch.randn(3, dtype=torch.float16)  # another element size, not owned by the optimizer
    with LazyCheckpointer(direct_io=True) as ckpt:
        state = dict(model.state_dict(), half=want["half"])
        handle = ckpt.save(state, tmp_path / "m.safetensors", format="safetensors", metadata={"format": "pt"})
        handle.wait()
        _train_step(model, opt)
    # the largest weight fixes where the data starts, so it always goes straight from memory; the other
    # does too if its address has the same position within a page (allocator-dependent)
    assert writes.live > 0, "large weights go straight from memory"

    def by_name(d):  # readers list tensors in file order, which zero copy may change
        return dict(sorted(d.items()))

    assert_same(by_name(load_file(tmp_path / "m.safetensors")), by_name(want))
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
        assert_same(by_name({k: f.get_tensor(k) for k in f.keys()}), by_name(want))  # noqa: SIM118
    assert verify(tmp_path / "m.safetensors").ok
    # still safetensors' rule: larger elements first, each tensor aligned to its element size
    import json
    import struct

    raw = (tmp_path / "m.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    spans = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    sizes = [want[k].element_size() for _, k in spans]
    assert sizes == sorted(sizes, reverse=True)
    assert all((8 + n + off) % want[k].element_size() == 0 for off, k in spans)


def test_ctrl_c_in_the_guard_copy_fails_the_save_without_hanging(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    writes = _Writes(monkeypatch, hold_first_live=True)
    _release_after_claim(monkeypatch, writes)
    with LazyCheckpointer(direct_io=True, writer_threads=1) as ckpt:
        real_alloc = ckpt.pool.alloc
        main = threading.current_thread()

        def interrupted(nbytes, phase=0):
            if threading.current_thread() is main:
                raise KeyboardInterrupt
            return real_alloc(nbytes, phase)

        monkeypatch.setattr(ckpt.pool, "alloc", interrupted)
        handle = ckpt.save(_state(model, opt), tmp_path / "a.pt")
        assert writes.started.wait(30)
        with pytest.raises(KeyboardInterrupt):
            _train_step(model, opt)  # the guard's copy is interrupted
        with pytest.raises(WriteError):
            handle.wait(timeout=60)  # every claimed piece was given back: no hang
        _train_step(model, opt)  # the guard is free again
    assert os.listdir(tmp_path) == []


def test_phase_padding_that_would_overflow_the_extra_field_falls_back(monkeypatch):
    from lazyckpt.formats import torch_zip as _torchfmt

    monkeypatch.setattr(_torchfmt, "PAGE", 1 << 16)  # 64 KiB pages: up to 65535 bytes of padding
    name = b"archive/data/" + b"9" * 19  # the data would start at 66: phase 64 needs 65534 bytes of padding
    assert 30 + len(name) + 4 == 66
    header, data_offset = _torchfmt._local_header(name, 1 << 20, 0, 64, phase=64)
    assert data_offset == 128, "torch.save's padding, not an overflowing one"
    header, data_offset = _torchfmt._local_header(name, 1 << 20, 0, 64, phase=4096)
    assert data_offset == 4096
