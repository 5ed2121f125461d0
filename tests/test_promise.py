"""The promise: a checkpoint holds exactly the state at save(), whatever training does next,
or the save fails loudly. Never a silently wrong file."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from _util import Tiny, WriteGate, assert_same, snapshot, train_step
from lazyckpt import LazyCheckpointer, StaleTensorError


def _state(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


@pytest.mark.parametrize("budget", [256 << 20, 96 << 10], ids=["fits", "streams-through-small-budget"])
def test_step_right_after_save(tmp_path, budget):
    torch.manual_seed(0)
    model = Tiny(128)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with LazyCheckpointer(host_memory_budget=budget, chunk_bytes=32 << 10) as ckpt:
        train_step(model, opt, 128)
        expected = []
        for i in range(6):
            state = {**_state(model, opt, i), "sched": sched.state_dict()}
            expected.append((ckpt.save(state, tmp_path / f"c{i}.pt"), snapshot(state)))
            train_step(model, opt, 128)  # params, Adam moments and BN buffers all change now
            sched.step()
        for handle, want in expected:
            handle.wait()
            assert_same(torch.load(handle.path), want)


def test_first_save_before_any_step_is_correct(tmp_path, ckpt):
    """The optimizer is not known yet: everything is captured inside save()."""
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = _state(model, opt, 0)
    want = snapshot(state)
    h = ckpt.save(state, tmp_path / "c.pt")
    train_step(model, opt)
    h.wait()
    assert_same(torch.load(h.path), want)


def test_forward_mutated_buffers_are_captured_at_save(tmp_path, ckpt):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt)  # the optimizer is now tracked: params are staged lazily
    state = _state(model, opt, 1)
    want = snapshot(state)
    h = ckpt.save(state, tmp_path / "c.pt")
    model(torch.randn(16, 64))  # BatchNorm running stats change in forward, no step involved
    assert not torch.equal(model.bn.running_mean, want["model"]["bn.running_mean"])
    h.wait()
    assert_same(torch.load(h.path), want)


def test_unguarded_tensors_may_change_right_after_save(tmp_path, ckpt):
    t = torch.arange(1000.0)
    h = ckpt.save({"t": t, "meta": {"lr": [0.1]}}, tmp_path / "c.pt")
    t.add_(1)
    h.wait()
    assert torch.equal(torch.load(h.path)["t"], torch.arange(1000.0))


def test_python_containers_are_snapshotted(tmp_path, ckpt):
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, opt)
    state = _state(model, opt, 3)
    h = ckpt.save(state, tmp_path / "c.pt")
    opt.param_groups[0]["lr"] = 123.0  # an LR scheduler does this
    state["step"] = 4
    h.wait()
    got = torch.load(h.path)
    assert got["optim"]["param_groups"][0]["lr"] == 0.1 and got["step"] == 3


def test_save_returns_before_copies_and_step_waits(tmp_path, monkeypatch):
    gate = WriteGate(monkeypatch)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with LazyCheckpointer(host_memory_budget=64 << 10, chunk_bytes=32 << 10) as ckpt:
        ckpt.track(opt)
        want = snapshot(model.state_dict())
        h = ckpt.save(model.state_dict(), tmp_path / "c.pt")
        assert not h.staged()  # 256 KiB of weights cannot stage through 64 KiB while writes are held
        model(torch.randn(4, 256)).sum().backward()
        stepped = threading.Event()

        def step():
            opt.step()
            stepped.set()

        t = threading.Thread(target=step)
        t.start()
        assert not stepped.wait(0.2)  # the step is held by the guard
        gate.release()
        t.join()
        h.wait()
        assert_same(torch.load(h.path), want)
        assert h.wait().guard_wait_s > 0


def test_in_place_change_outside_optimizer_fails_loudly(tmp_path, monkeypatch):
    gate = WriteGate(monkeypatch)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    (tmp_path / "c.pt").write_bytes(b"previous")
    with LazyCheckpointer(host_memory_budget=64 << 10, chunk_bytes=32 << 10) as ckpt:
        ckpt.track(opt)
        h = ckpt.save(model.state_dict(), tmp_path / "c.pt")
        with torch.no_grad():
            model.weight.mul_(2)  # e.g. an EMA swap, before the copy was safe
        gate.release()
        with pytest.raises(StaleTensorError) as info:
            h.wait()
        assert info.value.tensor_name == "weight"
        assert "weight" in str(info.value)
    assert (tmp_path / "c.pt").read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["c.pt"]


def test_mutation_after_wait_staged_is_fine(tmp_path, ckpt):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ckpt.track(opt)
    want = snapshot(model.state_dict())
    h = ckpt.save(model.state_dict(), tmp_path / "c.pt")
    h.wait_staged()
    with torch.no_grad():
        model.weight.zero_()
    h.wait()
    assert_same(torch.load(h.path), want)


def test_same_path_many_times_last_wins(tmp_path, ckpt):
    handles = [ckpt.save({"i": i, "t": torch.full((1000,), float(i))}, tmp_path / "last.pt") for i in range(20)]
    ckpt.wait()
    assert all(h.done() for h in handles)
    got = torch.load(tmp_path / "last.pt")
    assert got["i"] == 19 and torch.equal(got["t"], torch.full((1000,), 19.0))
    assert os.listdir(tmp_path) == ["last.pt"]


def test_closure_runs_before_the_wait(tmp_path, monkeypatch):
    """Lightning's pattern: step(closure) -> the wait happens after forward/backward."""
    gate = WriteGate(monkeypatch)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = {}
    with LazyCheckpointer(host_memory_budget=64 << 10, chunk_bytes=32 << 10) as ckpt:
        ckpt.track(opt)
        want = snapshot(model.state_dict())
        h = ckpt.save(model.state_dict(), tmp_path / "c.pt")

        def closure():
            loss = model(torch.randn(4, 256)).sum()
            loss.backward()
            seen["staged_during_closure"] = h.staged()
            gate.release()  # storage catches up while "the update" waits
            return loss

        opt.step(closure)
        assert seen["staged_during_closure"] is False
        h.wait()
        assert_same(torch.load(h.path), want)


def test_lbfgs_repeated_closure(tmp_path, ckpt):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    want = snapshot({"model": model.state_dict(), "optim": opt.state_dict()})
    h = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c.pt")
    opt.step(closure)
    h.wait()
    assert_same(torch.load(h.path), want)


def test_two_optimizers_and_grad_accumulation(tmp_path, ckpt):
    model = Tiny()
    opt_a = torch.optim.Adam(model.fc1.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(list(model.fc2.parameters()) + list(model.bn.parameters()), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        opt_a.step(), opt_b.step()
    state = {"m": model.state_dict(), "a": opt_a.state_dict(), "b": opt_b.state_dict()}
    want = snapshot(state)
    h = ckpt.save(state, tmp_path / "c.pt")
    for _ in range(3):  # accumulate, then step both
        model(torch.randn(8, 64)).sum().backward()
    opt_a.step()
    opt_b.step()
    h.wait()
    assert_same(torch.load(h.path), want)


def test_saves_from_two_threads(tmp_path, ckpt):
    errors = []

    def worker(k):
        try:
            for i in range(10):
                t = torch.full((5000,), float(k * 100 + i))
                ckpt.save({"t": t}, tmp_path / f"w{k}-{i}.pt").wait()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(2):
        for i in range(10):
            assert torch.load(tmp_path / f"w{k}-{i}.pt")["t"][0] == k * 100 + i


def test_two_checkpointers_in_one_process(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    train_step(model, opt)
    with LazyCheckpointer() as a, LazyCheckpointer() as b:
        want = snapshot(model.state_dict())
        ha = a.save(model.state_dict(), tmp_path / "a.pt")
        hb = b.save(model.state_dict(), tmp_path / "b.pt", format="safetensors")
        train_step(model, opt)
        ha.wait(), hb.wait()
    from safetensors.torch import load_file

    assert_same(torch.load(tmp_path / "a.pt"), want)
    assert_same(dict(sorted(load_file(tmp_path / "b.pt").items())), dict(sorted(want.items())))


def test_save_leaves_python_rng_alone(tmp_path, ckpt):
    """Accelerate pickles random.getstate() after saving models: a save must not advance it."""
    import random

    state = random.getstate()
    ckpt.save({"w": torch.ones(3)}, tmp_path / "c.pt").wait()
    assert random.getstate() == state
