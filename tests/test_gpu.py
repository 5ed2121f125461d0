"""CUDA path: copy stream, per-piece events, pinned pool, GPU-side guard. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from _util import WriteGate, assert_same
from lazyckpt import LazyCheckpointer, StaleTensorError

pytestmark = pytest.mark.gpu


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


class Net(torch.nn.Module):
    def __init__(self, width=1024):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _step(model, opt, width=1024):
    model(torch.randn(64, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_cuda_tensors_round_trip_with_device_tags(tmp_path):
    base = torch.arange(24.0, device="cuda").reshape(4, 6)
    obj = {"view": base[1:3], "base": base, "t": base.t(), "bf16": torch.randn(5, device="cuda").bfloat16(), "n": 3}
    with LazyCheckpointer() as c:
        c.save(obj, tmp_path / "c.pt").wait()
    got = torch.load(tmp_path / "c.pt")
    assert got["base"].device.type == "cuda"
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert_same(_cpu(got), _cpu(obj))
    assert_same(_cpu(torch.load(tmp_path / "c.pt", map_location="cpu", mmap=True)), _cpu(obj))


@pytest.mark.parametrize("budget", [1 << 30, 2 << 20], ids=["fits", "streams"])
def test_cuda_step_right_after_save(tmp_path, budget):
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with LazyCheckpointer(host_memory_budget=budget, chunk_bytes=1 << 20) as c:
        _step(model, opt)
        pending = []
        for i in range(5):
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
            want = _cpu(state)  # synchronises: the reference is exact
            pending.append((c.save(state, tmp_path / f"c{i}.pt"), want))
            _step(model, opt)  # kernels queued right away; the guard makes the compute stream wait
        for h, want in pending:
            h.wait()
            assert_same(_cpu(torch.load(h.path, map_location="cpu")), want)


def test_cuda_forward_mutated_buffers(tmp_path):
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    with LazyCheckpointer() as c:
        state = model.state_dict()
        want = _cpu(state)
        h = c.save(state, tmp_path / "c.pt")
        model(torch.randn(64, 1024, device="cuda"))  # BN running stats change on the compute stream
        h.wait()
    assert_same(_cpu(torch.load(tmp_path / "c.pt", map_location="cpu")), want)


def test_cuda_in_place_change_outside_optimizer_fails_loudly(tmp_path, monkeypatch):
    gate = WriteGate(monkeypatch)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=512 << 10) as c:
        c.track(opt)
        h = c.save(model.state_dict(), tmp_path / "c.pt")
        with torch.no_grad():
            model.weight.mul_(2)
        gate.release()
        with pytest.raises(StaleTensorError):
            h.wait()
    assert not (tmp_path / "c.pt").exists()


def test_no_device_memory_overhead_and_pinned_pool_reused(tmp_path):
    model = Net(2048).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, 2048)
    with LazyCheckpointer() as c:
        assert c.pool.pin_memory
        sizes = []
        for _i in range(4):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            h = c.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c.pt")
            assert torch.cuda.memory_allocated() == before  # no device-side clone
            _step(model, opt, 2048)
            h.wait()
            sizes.append(c.pool.allocated_bytes)
        assert sizes[1:] == sizes[:-1] == [sizes[0]] * 3  # warm after the first save: nothing new


# -- forced races (issue 11, GPU part); written against the torch docs and source, see the report ----

_SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep spins this many GPU clock cycles: ~1 s at ~2 GHz


def _delay_copy_stream(monkeypatch, cycles=_SLEEP_CYCLES):
    """Queue a long sleep on the copy stream before a job's device-to-host copies: nothing on the
    host waits for it, so anything racing the copies gets a ~1 s window for sure."""
    from lazyckpt.core import engine as _engine

    real = _engine.Engine._copy_source
    delayed = set()

    def copy_source(self, job, src, stream):
        if stream is not None and id(job) not in delayed and stream != torch.cuda.current_stream(src.device):
            delayed.add(id(job))
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
        return real(self, job, src, stream)

    monkeypatch.setattr(_engine.Engine, "_copy_source", copy_source)


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "guard_removed"])
def test_step_right_after_save_with_delayed_copies_saves_the_pre_step_state(tmp_path, monkeypatch, guard):
    """The copies wait ~1 s on the copy stream; the optimizer steps at once. With the guard, the
    compute stream waits for the copy events, so the file holds the pre-step state. With the guard's
    GPU-side wait removed (``guard_removed``, the negative control: ``Stream.wait_event`` made a
    no-op; the state was synchronised before save(), so the copy stream's own wait is not needed),
    the step's kernels run during the sleep and the copies read post-step values: that case must
    differ, or this test proves nothing."""
    _delay_copy_stream(monkeypatch)
    if not guard:
        monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: None)
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with LazyCheckpointer() as c:
        _step(model, opt)
        c.track(opt)
        want = _cpu(model.state_dict())
        h = c.save(model.state_dict(), tmp_path / "c.pt")
        _step(model, opt)
        torch.cuda.synchronize()
        h.wait()  # the guard checked versions before the step: no StaleTensorError either way
    got = _cpu(torch.load(tmp_path / "c.pt", map_location="cpu"))
    if guard:
        assert_same(got, want)
    else:
        assert not torch.equal(got["fc1.weight"], want["fc1.weight"])


def test_freed_and_reused_source_memory_while_copy_is_delayed(tmp_path, monkeypatch):
    """Drop every reference to the saved tensors and allocate and fill same-sized tensors while the
    copies still wait on the copy stream: the caching allocator must not hand their blocks out (the
    job holds the storages until the copies are done), so the file holds the original values."""
    _delay_copy_stream(monkeypatch)
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _step(model, opt)
    with LazyCheckpointer() as c:
        c.track(opt)
        want = _cpu(model.state_dict())
        h = c.save(model.state_dict(), tmp_path / "c.pt")
        shapes = [p.shape for p in model.parameters()]
        del model, opt
        garbage = [torch.full(s, 7.0, device="cuda") for s in shapes for _ in range(4)]
        h.wait()
        del garbage
    assert_same(_cpu(torch.load(tmp_path / "c.pt", map_location="cpu")), want)


def _host_stat(stats, name):
    value = stats.get(name, stats.get(name.split(".")[0], 0))
    return value.get("current", 0) if isinstance(value, dict) else value


def test_pinned_bytes_match_the_budget_and_host_allocator_is_untouched(tmp_path):
    """Chunks are registered memory: exactly chunk_bytes each, never more than the budget, none of
    it in torch's caching host allocator (which would round 64 MiB + alignment up to 128 MiB and keep
    the blocks after close()), and unpinned by close()."""
    model = Net(2048).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, 2048)
    torch.cuda.synchronize()
    before = _host_stat(torch.cuda.host_memory_stats(), "allocated_bytes.current")
    budget, chunk = 64 << 20, 16 << 20
    c = LazyCheckpointer(host_memory_budget=budget, chunk_bytes=chunk)
    try:
        for i in range(3):
            h = c.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / f"c{i}.pt")
            _step(model, opt, 2048)
            h.wait()
        assert 0 < c.pool.pinned_bytes == c.pool.allocated_bytes <= budget
        assert c.pool.pinned_bytes % chunk == 0
        chunk_tensor = c.pool._chunks[0].tensor
        assert chunk_tensor.is_pinned()
        after = _host_stat(torch.cuda.host_memory_stats(), "allocated_bytes.current")
        assert after - before < chunk  # our chunks are not the caching host allocator's
    finally:
        c.close()
    assert not chunk_tensor.is_pinned()  # unregistered (the mapping lives while this view does)


def test_waiting_for_a_long_copy_does_not_spin_the_cpu(tmp_path, monkeypatch):
    """A ~2 s copy (sleep on the copy stream) waited for by the stager and every writer: with
    blocking events they sleep in cudaEventSynchronize. Non-blocking events spin one core per
    waiting thread, i.e. CPU time >= wall time."""
    import time

    _delay_copy_stream(monkeypatch, 2 * _SLEEP_CYCLES)
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _step(model, opt)
    torch.cuda.synchronize()
    with LazyCheckpointer(writer_threads=4, chunk_bytes=1 << 20) as c:
        c.track(opt)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        c.save(model.state_dict(), tmp_path / "c.pt").wait()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert wall > 0.5, "the copy stream sleep did not delay the copies"
    assert cpu < 0.5 * wall, f"{cpu:.2f} s CPU over {wall:.2f} s wall: waiting threads spin"


_SECOND_GPU_SCRIPT = """
import sys, torch
from lazyckpt import LazyCheckpointer
torch.cuda.set_device(1)  # the training thread never touches GPU 0
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 1024, device="cuda")).sum().backward(); opt.step()
with LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=8 << 20) as c:
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    h = c.save(model.state_dict(), sys.argv[1])
    model(torch.randn(8, 1024, device="cuda")).sum().backward(); opt.step()
    h.wait()
got = torch.load(sys.argv[1], map_location="cpu")
assert all(torch.equal(got[k], want[k]) for k in want)
assert torch.load(sys.argv[1])["weight"].device == torch.device("cuda", 1)
assert not torch._C._cuda_hasPrimaryContext(0), "a context appeared on GPU 0"
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_on_second_gpu_creates_no_context_on_the_first(tmp_path):
    """In a fresh process (so GPU 0 has no context yet): lazyckpt's threads set the device before
    every CUDA call, so saving tensors of cuda:1 leaves GPU 0 without a context."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _SECOND_GPU_SCRIPT, str(tmp_path / "c.pt")], check=True, timeout=300)


def test_capture_in_save_orders_copies_before_a_graph_replay(tmp_path, monkeypatch):
    """capture_in_save=True: the copies go on the current stream inside save(), so a replayed CUDA
    graph that updates the parameters (no Optimizer.step(), no guard) runs after them."""
    p = torch.ones(1 << 22, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p.mul_(1.0)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.mul_(3.0)
    torch.cuda.synchronize()
    with LazyCheckpointer(capture_in_save=True) as c:
        torch.cuda._sleep(_SLEEP_CYCLES)  # the current stream is busy: the copies queue behind it
        h = c.save({"p": p}, tmp_path / "c.pt")
        graph.replay()
        h.wait()
    assert torch.equal(torch.load(tmp_path / "c.pt", map_location="cpu")["p"], torch.ones(1 << 22))


def test_cuda_save_with_cpu_pieces_step_waits_for_the_cpu_staging(tmp_path, monkeypatch):
    """One save holding CUDA tensors (copy stream) and large CPU tensors: the planner takes no CPU
    piece from live memory when a CUDA copy is in the save (zero copy is for CPU-only saves), so
    the CPU tensors are staged on the host, and a step must wait for that staging, not only for
    the CUDA copies to be queued. The staging copy of the first CPU tensor is held until the step
    has run (or a bound): without the guard's host wait, the step changes the CPU weights before
    they are copied and the file holds post-step bytes.

    (Until 2026-12-04 this test expected live CPU pieces beside CUDA copies, which the planner
    never makes: on an H200 it failed at its first wait.)"""
    import copy
    import threading

    from lazyckpt.core import engine as _engine
    from test_zero_copy import _Writes

    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(1024, 1024)  # 4 MiB weight: a zero-copy candidate in a CPU-only save
    gpu_model = torch.nn.Linear(64, 64).cuda()
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.5)
    gpu_opt = torch.optim.SGD(gpu_model.parameters(), lr=0.5)

    def train():
        cpu_model(torch.randn(8, 1024)).square().mean().backward()
        gpu_model(torch.randn(8, 64, device="cuda")).square().mean().backward()
        cpu_opt.step()
        gpu_opt.step()

    train()
    writes = _Writes(monkeypatch)
    held, stepped = threading.Event(), threading.Event()
    real_copy = _engine.Engine._copy_source

    def held_copy(self, job, src, stream):
        if src.device.type == "cpu" and src.nbytes >= 1 << 20 and not held.is_set():
            held.set()
            stepped.wait(5.0)  # bounded: with the protection the step waits for this copy
        return real_copy(self, job, src, stream)

    monkeypatch.setattr(_engine.Engine, "_copy_source", held_copy)

    def state():
        return {"cpu": cpu_model.state_dict(), "gpu": gpu_model.state_dict()}

    with LazyCheckpointer(direct_io=True, writer_threads=1) as ckpt:
        want = _cpu(copy.deepcopy(state()))
        handle = ckpt.save(state(), tmp_path / "mixed.pt")
        assert held.wait(30)
        train()  # the guard runs here
        stepped.set()
        handle.wait()
    assert writes.live == 0, "a save with CUDA copies took CPU pieces from live memory"
    assert_same(_cpu(torch.load(tmp_path / "mixed.pt")), want)


def test_lightning_deepspeed_strategy_with_the_plugin_is_refused(tmp_path):
    pytest.importorskip("deepspeed")
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lazyckpt import SaveRefusedError
    from lazyckpt.lightning import LazyCheckpointIO

    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=DeepSpeedStrategy(stage=2), plugins=[LazyCheckpointIO()],
        max_steps=2, logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(SaveRefusedError, match="DeepSpeed"):
        trainer.fit(BoringModel())


def test_deepspeed_engine_on_cuda_saves_what_stock_saves(tmp_path):
    """One process, ZeRO-2 on CUDA: the lazy engine's folder (device-to-host copies) equals stock's."""
    pytest.importorskip("deepspeed")
    import os

    import deepspeed
    import torch.distributed as dist

    import lazyckpt.deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    cfg = {
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 10**9,
    }  # fmt: skip
    saved = {}
    for mode in ("stock", "lazy"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        handle = lazyckpt.deepspeed.install(engine) if mode == "lazy" else None
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(4, 256, generator=g).cuda().bfloat16()
            engine.backward(engine(x).float().square().mean())
            engine.step()
            if step == 1:
                engine.save_checkpoint(str(tmp_path / mode))
        if handle is not None:
            handle.uninstall()
        saved[mode] = torch.load(tmp_path / mode / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert_same(_cpu(saved["lazy"]["module"]), _cpu(saved["stock"]["module"]))
