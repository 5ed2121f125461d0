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
