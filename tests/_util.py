"""Shared helpers for the tests."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch


def _same_key(k: Any) -> Any:
    return k


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
    walk_state(a, b, where, loose_tensors, key=str)


def walk_state(a: Any, b: Any, where: str, tensors: Callable[[Any, Any, str], bool], key: Callable = _same_key) -> None:
    """The structural comparison behind the loose and the rank-side helpers: ``tensors(a, b, where)``
    compares what it takes for tensors (True when it took them); dicts by their sets of keys (each
    mapped by ``key`` first), lists and tuples by length; anything else by ``==``."""
    if tensors(a, b, where):
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(map(key, a)) == set(map(key, b)), (
            f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        )
        bb = {key(k): v for k, v in b.items()}
        for k, v in a.items():
            walk_state(v, bb[key(k)], f"{where}.{k}", tensors, key)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            walk_state(x, y, f"{where}.{i}", tensors, key)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def loose_tensors(a: Any, b: Any, where: str) -> bool:
    """``a`` a tensor: ``b`` one too, same dtype and shape, ``torch.equal``."""
    if not isinstance(a, torch.Tensor):
        return False
    assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
    assert torch.equal(a, b), where
    return True


def bitwise_tensors(a: Any, b: Any, where: str) -> bool:
    """Either a tensor: both are, DTensors gathered whole (a collective), same dtype and shape, same bytes."""
    if not (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return False
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = b.full_tensor() if hasattr(b, "full_tensor") else b
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(_bytes(a), _bytes(b)), where
    return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_state(a: Any, b: Any) -> bool:
    """True when ``walk_state`` with ``loose_tensors`` and the keys as they are finds no difference."""
    try:
        walk_state(a, b, "", loose_tensors)
    except AssertionError:
        return False
    return True


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


def mlp(width: int = 16, depth: int = 3, device: str = "cpu") -> torch.nn.Sequential:
    """``depth`` Linear layers with ReLUs between them, seeded: the rank processes' model."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


def fsdp_model(width: int = 16, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``mlp(width)`` with every Linear and the whole model ``fully_shard``ed (FSDP2), and AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = mlp(width, device=device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def rank_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, width: int = 16, device: str = "cpu"
) -> None:
    """One training step of a rank process on a batch seeded by ``seed`` and the rank."""
    g = torch.Generator().manual_seed(seed * 100 + torch.distributed.get_rank())
    model(torch.randn(4, width, generator=g).to(device)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full_dump(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole state at this moment, gathered (a collective), cloned to the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return clone({"model": msd, "optim": osd})


def clone(obj: Any) -> Any:
    """Tensors in nested dicts and lists detached and cloned to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    return obj


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


def data_writers(monkeypatch) -> list[str]:
    """Names of the threads that write tensor data (pieces of at least 64 KiB) from now on."""
    from lazyckpt.storage import fs as _fs

    writers: list[str] = []
    real = _fs.pwrite_all

    def pwrite_all(fd, data, offset):  # type: ignore[no-untyped-def]
        if len(memoryview(data)) >= 64 << 10:
            writers.append(threading.current_thread().name)
        real(fd, data, offset)

    monkeypatch.setattr(_fs, "pwrite_all", pwrite_all)
    return writers


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run a multi-process script's ``main()``, then end the process without finalizing the
    interpreter: lazyckpt's exit drain (what its ``atexit`` hook would run), multiprocessing's exit
    function (a ddp_spawn worker's result queue is written by a feeder thread), output flushed,
    ``os._exit`` with main's exit code (1, traceback printed, on an exception).

    Why: torch's gloo worker threads may still drop their last collective's work objects (tensors
    with Python references) while the interpreter finalizes; taking the GIL there ends the thread,
    and unwinding through a noexcept destructor aborts the process (SIGABRT, "terminate called
    without an active exception"; pytorch/pytorch#190489). Seen here in about 1 launch of 25 of the
    2-process Accelerate restore, after an ``all_gather_object`` and a barrier (the core dump's
    stack: ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` ->
    ``take_gil`` -> ``pthread_exit``). ``destroy_process_group()`` does not prevent it: those threads
    end only when the group object is freed, and a DDP module keeps it alive in C++ after the module
    itself is gone (measured: 6 threads before and after ``del ddp; destroy_process_group()``)."""
    import os
    import sys
    import traceback

    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit code
        traceback.print_exc()
        code = 1
    from multiprocessing import util as _mp_util

    from lazyckpt.core import exit as _exit

    _exit.drain()
    _mp_util._exit_function()  # a multiprocessing child's own ending: its queues' feeder threads flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class DiesOnRead:
    """Stands for a ``cluster._wire.OutFile`` about to be sent: the process SIGKILLs itself when the
    sender reads its descriptor (a kill forced at that exact point of a transfer)."""

    def __init__(self, real: Any) -> None:
        self.real, self.name, self.size, self.crc = real, real.name, real.size, real.crc

    @property
    def fd(self) -> int:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.real.close()


def register_node_pid(pids: str, rank: int) -> None:
    """This process's pid in ``pids`` (a folder per lost node), before the job's first collective."""
    import os

    os.makedirs(pids, exist_ok=True)
    with open(os.path.join(pids, str(rank)), "w") as f:
        f.write(str(os.getpid()))


def kill_node(pids: str) -> NoReturn:
    """SIGKILL every process registered in ``pids`` (``register_node_pid``), this one last: the node's
    processes die together, as on a lost machine (each killing only itself left a race in the tests)."""
    import os
    import signal

    for name in os.listdir(pids):
        with open(os.path.join(pids, name)) as f:
            pid = int(f.read())
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover - it got there first
                pass
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILLed")


def hold_copies(until: threading.Event, setattr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Hold every copy of a caller's tensor that a lazyckpt thread makes (the stager's ``memmove``) until
    ``until`` is set (bounded: 60 s). ``setattr``: pytest's ``monkeypatch.setattr`` to undo it after the test."""
    import ctypes

    from lazyckpt.core import engine as _engine

    real_memmove = ctypes.memmove

    class _Ctypes:
        def __getattr__(self, name: str) -> Any:
            return getattr(ctypes, name)

        @staticmethod
        def memmove(dst: Any, src: Any, n: int) -> Any:
            if threading.current_thread().name.startswith("lazyckpt-"):
                assert until.wait(60)
            return real_memmove(dst, src, n)

    setattr(_engine, "ctypes", _Ctypes())
