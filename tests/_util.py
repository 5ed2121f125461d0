"""Shared helpers for the tests."""

from __future__ import annotations

import copy
import math
import threading
from typing import Any

import torch


def assert_same(got: Any, want: Any, where: str = "", loose: bool = False) -> None:
    """Deep equality, bitwise for tensors (dtype, shape, stride-independent values, NaNs equal).

    The one comparison of the test suite: dict keys in the same order, lists and tuples of the same
    type, float NaNs equal to each other, numpy arrays by value and dtype, anything else by ``==``.

    ``loose=True`` (state read back through DCP, whose keys may come back as strings and in another
    order): tensors by dtype, shape and ``torch.equal``, no ``requires_grad`` check; dict keys
    compared as sets of ``str``; lists and tuples by length only; anything else by ``==``.
    """
    if loose:
        _assert_loose(got, want, where)
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)} is not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{tuple(got.shape)}"
        assert got.requires_grad == want.requires_grad, f"{where}: requires_grad differs"
        a, b = got.detach().cpu(), want.detach().cpu()
        if a.is_complex():
            a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
        a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
        if a.dtype != torch.bool:  # bitwise, so NaNs and -0.0 compare exactly
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"{where}: values differ"
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
        return
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {type(got)} len {len(got)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
        return
    if isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), f"{where}: {got!r} is not NaN"
        return
    if type(want).__module__ == "numpy" and hasattr(want, "dtype"):  # ndarray / scalar (numpy not imported here)
        assert type(got) is type(want) and got.dtype == want.dtype, f"{where}: {type(got)} vs {type(want)}"
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), f"{where}: arrays differ"
        return
    assert got == want, f"{where}: {got!r} != {want!r}"


def _assert_loose(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(map(str, a)) == set(map(str, b)), f"{where}: {sorted(map(str, a))} vs {sorted(map(str, b))}"
        bb = {str(k): v for k, v in b.items()}
        for k, v in a.items():
            _assert_loose(v, bb[str(k)], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_loose(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def snapshot(obj: Any) -> Any:
    """What torch.save would have captured right now (deep copy, tensors cloned)."""
    return copy.deepcopy(obj)


class Tiny(torch.nn.Module):
    """A small model with parameters and forward-mutated buffers (BatchNorm)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int = 64) -> None:
    x = torch.randn(16, width)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


class WriteGate:
    """Holds every write until ``release()``: makes "staging not done yet" deterministic."""

    def __init__(self, monkeypatch) -> None:
        import threading

        from lazyckpt.storage import fs as _fs

        self.opened = threading.Event()
        self._real = _fs.pwrite_all
        monkeypatch.setattr(_fs, "pwrite_all", self._write)

    def _write(self, fd, data, offset):
        self.opened.wait()
        return self._real(fd, data, offset)

    def release(self) -> None:
        self.opened.set()


def hold_staging(monkeypatch, hold_s: float = 20) -> threading.Event:
    """Hold every save's staging until something waits for a save (the guard, a handle, the
    checkpointer): the copies are provably still pending right after ``save()``. Returns the gate
    (set: released). Bounded: a mutator that does not wait fails its test instead of hanging it."""
    import lazyckpt.core.engine as _engine
    import lazyckpt.core.job as _job

    gate = threading.Event()
    real_stage = _engine.Engine._stage

    def held_stage(self, job):
        gate.wait(hold_s)
        real_stage(self, job)

    def opening(name):
        real = getattr(_job.Job, name)

        def opens_then_waits(self, *args):
            gate.set()
            return real(self, *args)

        monkeypatch.setattr(_job.Job, name, opens_then_waits)

    monkeypatch.setattr(_engine.Engine, "_stage", held_stage)
    for name in ("release_guard", "_settle_for_wait", "_confirm_for_wait"):
        opening(name)
    return gate
