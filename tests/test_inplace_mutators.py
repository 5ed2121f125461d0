"""In-place changes of saved state right after a save (issue 20, defect 5).

Stock calls that overwrite saved tensors in place outside ``optimizer.step()`` (``Module.load_state_dict``,
``Optimizer.load_state_dict`` and its hooks, ``torch.nn.utils.vector_to_parameters``, and what Lightning's
restores end up in) must first wait for the pending copies, so that the file holds the state at save();
a change the rule does not cover (``p.mul_()`` under ``no_grad``) still fails the save, naming the tensor.

Every test forces the window: the stager is held until something waits for the save (the guard, a handle
or checkpointer wait), so the copies are provably still pending when the mutator runs.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _util import assert_same, hold_staging
from lazyckpt import LazyCheckpointer
from lazyckpt.errors import StaleTensorError

HOLD_S = 20  # bound of the held stager: a test whose mutator does not wait fails instead of hanging


@pytest.fixture
def held_staging(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every save's staging until someone waits for a save; returns the gate (set: released)."""
    return hold_staging(monkeypatch, HOLD_S)


def _trained(seed: int, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, width)).pow(2).mean().backward()
    opt.step()  # the guard knows the optimizer: params and state are copied lazily
    opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _save_pending(ckpt: LazyCheckpointer, obj: Any, path: Any) -> Any:
    handle = ckpt.save(obj, path)
    assert not handle.staged(), "the copies must still be pending for this test to mean anything"
    return handle


@contextlib.contextmanager
def _saved_state_stays(tmp_path: Any, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Iterator[Any]:
    """The body runs while a lazy save of (model, opt) is pending; then the file must hold the
    state at the save."""
    want = copy.deepcopy(_state(model, opt))
    with LazyCheckpointer() as ckpt:
        h = _save_pending(ckpt, _state(model, opt), tmp_path / "c.pt")
        yield h
        h.wait()
    assert_same(torch.load(tmp_path / "c.pt"), want)


def test_module_load_state_dict_right_after_save_keeps_the_saved_state(tmp_path: Any, held_staging: Any) -> None:
    model, opt = _trained(0)
    other, _ = _trained(1)
    with _saved_state_stays(tmp_path, model, opt):
        model.load_state_dict(other.state_dict())  # param.copy_() under no_grad: waits for the copies first
    assert_same(model.state_dict(), other.state_dict())  # and the load itself took effect


def test_optimizer_load_state_dict_right_after_save_keeps_the_saved_state(tmp_path: Any, held_staging: Any) -> None:
    # torch's own Optimizer.load_state_dict replaces the state tensors rather than writing into them;
    # an optimizer that keeps its state buffers (pre-allocated, pinned, paged ...) copies the loaded
    # values into them, here through torch's load_state_dict hooks.
    model, opt = _trained(0)
    _, other = _trained(1)
    kept: dict[str, Any] = {}

    def keep_buffers(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        kept["state"] = {p: dict(s) for p, s in optimizer.state.items()}

    def copy_into_kept_buffers(optimizer: torch.optim.Optimizer) -> None:
        for p, old in kept["state"].items():
            for k, buf in old.items():
                if isinstance(buf, torch.Tensor):
                    buf.copy_(optimizer.state[p][k])
                    optimizer.state[p][k] = buf

    opt.register_load_state_dict_pre_hook(keep_buffers)
    opt.register_load_state_dict_post_hook(copy_into_kept_buffers)
    with _saved_state_stays(tmp_path, model, opt):
        opt.load_state_dict(other.state_dict())
    assert_same(opt.state_dict()["state"], other.state_dict()["state"])


def test_stock_optimizer_load_state_dict_right_after_save(tmp_path: Any, held_staging: Any) -> None:
    model, opt = _trained(0)
    _, other = _trained(1)
    with _saved_state_stays(tmp_path, model, opt):
        opt.load_state_dict(other.state_dict())


def test_vector_to_parameters_right_after_save_keeps_the_saved_state(tmp_path: Any, held_staging: Any) -> None:
    model, opt = _trained(0)
    other, _ = _trained(1)
    with _saved_state_stays(tmp_path, model, opt):
        vec = torch.nn.utils.parameters_to_vector(other.parameters())
        torch.nn.utils.vector_to_parameters(vec, model.parameters())
    assert_same(torch.nn.utils.parameters_to_vector(model.parameters()), vec)


def test_the_mutators_wait_only_with_saves_pending(tmp_path: Any) -> None:
    """The wrappers are the stock calls once nothing is pending (no wait, same results)."""
    model, opt = _trained(0)
    other, other_opt = _trained(1)
    with LazyCheckpointer() as ckpt:
        ckpt.save(_state(model, opt), tmp_path / "c.pt").wait()
        assert torch.nn.Module.load_state_dict.__lazyckpt_waits__  # installed by the first lazy save
        model.load_state_dict(other.state_dict())
        opt.load_state_dict(other_opt.state_dict())
    assert_same(model.state_dict(), other.state_dict())
    assert_same(opt.state_dict(), other_opt.state_dict())
    assert torch.nn.Module.load_state_dict.__wrapped__.__name__ == "load_state_dict"


def test_in_place_change_outside_the_rule_still_fails_the_save_naming_the_tensor(
    tmp_path: Any, held_staging: threading.Event
) -> None:
    model, opt = _trained(0)
    with LazyCheckpointer() as ckpt:
        h = _save_pending(ckpt, _state(model, opt), tmp_path / "c.pt")
        with torch.no_grad():
            model[0].weight.mul_(2)  # no stock mutator: nothing waits, the version check catches it
        held_staging.set()
        with pytest.raises(StaleTensorError, match=r"'model\.0\.weight' was modified in place") as info:
            h.wait()
    assert info.value.tensor_name == "model.0.weight"
    assert not (tmp_path / "c.pt").exists()


# -- Lightning: restores and user code that reload weights right after a save --------------------------


# Lightning 2.6 warns itself (on torch 2.13; a fit without validation data): not ours
@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning", "ignore:Total length of:UserWarning")
def test_lightning_reload_of_weights_right_after_a_save(tmp_path: Any, held_staging: Any) -> None:
    """A callback that rolls the weights back with ``pl_module.load_state_dict`` in the batch right
    after a ModelCheckpoint save (the pattern of ModelCheckpoint's own manual-optimization path, with
    names it does not know): every file holds the state at its save."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_scripts.tiny_gpt import RecordingLazyIO, TinyGPT, assert_files_match_expected, trainer_kwargs

    class RollBack(L.Callback):
        def __init__(self) -> None:
            self.snapshot: dict[str, torch.Tensor] | None = None
            self.rolled = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                self.snapshot = copy.deepcopy(pl_module.state_dict())
            elif batch_idx in (3, 5):  # a save of the previous batch is pending right now
                pl_module.load_state_dict(self.snapshot)
                self.rolled += 1

    io, roll = RecordingLazyIO(), RollBack()
    L.seed_everything(0, verbose=False)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    kwargs = trainer_kwargs(max_epochs=1)
    trainer = L.Trainer(default_root_dir=tmp_path, plugins=[io], callbacks=[roll, ckpt_cb], **kwargs)
    trainer.fit(TinyGPT(dim=128))
    assert roll.rolled == 2
    assert assert_files_match_expected(io) == 8


def test_fabric_save_then_load_into_the_same_model(tmp_path: Any, held_staging: Any) -> None:
    pytest.importorskip("lightning")

    from lazyckpt.lightning import LazyCheckpointIO
    from lightning_scripts.tiny_gpt import fabric_with_tiny_gpt, load

    io = LazyCheckpointIO()
    fabric, model, opt = fabric_with_tiny_gpt(io)
    batches = list(model.module.train_dataloader())
    for batch in batches[:2]:
        fabric.backward(model.module.loss(batch))
        opt.step()
        opt.zero_grad()
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
    want = copy.deepcopy({"model": model.module.state_dict(), "optimizer": opt.optimizer.state_dict()})
    fabric.backward(model.module.loss(batches[2]))
    opt.step()
    want_b = copy.deepcopy(model.module.state_dict())
    fabric.save(tmp_path / "b.ckpt", {"model": model, "optimizer": opt})  # pending while a.ckpt is loaded
    fabric.load(tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
    assert_same(model.module.state_dict(), want["model"])
    assert_same(opt.optimizer.state_dict(), want["optimizer"])
    io.teardown()
    assert_same(load(str(tmp_path / "a.ckpt"))["model"], want["model"])
    assert_same(load(str(tmp_path / "b.ckpt"))["model"], want_b)
