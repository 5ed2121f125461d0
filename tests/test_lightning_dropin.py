"""LazyCheckpointIO as a drop-in for the stock plugin where Lightning saves outside a running fit
(issue 20, items 1, 2, 3, 6): real Trainers on CPU, files read back with torch.load.

Saves outside a running ``fit`` (after it, before it, from validate, the exception checkpoint,
ddp_spawn's result collection) must return with the file durable and never wait for themselves;
saves from hooks inside ``fit`` stay lazy. Runs that could hang or must exit run in a subprocess
with a timeout (tests/lightning_scripts/dropin.py); the in-process ones carry a short timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from lazyckpt.lightning import LazyCheckpointIO  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "lightning_scripts", "dropin.py")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def trainer(tmp_path: Any, io: Any, **kw: Any) -> L.Trainer:
    kw = {
        **dict(default_root_dir=tmp_path, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0, max_steps=3, enable_checkpointing=False),
        **kw,
    }  # fmt: skip
    return L.Trainer(plugins=[io] if io is not None else [], **kw)


def assert_state_of(path: Any, model: torch.nn.Module) -> None:
    saved = torch.load(path, weights_only=False)["state_dict"]
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name


def run_script(mode: str, tmp_path: Any, timeout: float = 150) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [TESTS, os.environ.get("PYTHONPATH", "")] if p))
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=timeout
    )
    report = tmp_path / "report.json"
    return proc, json.loads(report.read_text()) if report.exists() else {}


# -- item 1: trainer.save_checkpoint outside fit -----------------------------------------------------


def test_save_after_fit_returns_durable(tmp_path: Any) -> None:
    io = LazyCheckpointIO()
    t = trainer(tmp_path, io)
    model = BoringModel()
    t.fit(model)
    t.save_checkpoint(tmp_path / "after.ckpt")  # the optimizer's tensors are lazy: must confirm itself
    assert_state_of(tmp_path / "after.ckpt", model)
    assert io.checkpointer is None  # released: no thread outlives a save outside fit


def test_save_before_fit_returns_durable(tmp_path: Any) -> None:
    io = LazyCheckpointIO()
    t = trainer(tmp_path, io)
    model = BoringModel()
    t.strategy.connect(model)  # attached, not fitting: the module knows no Trainer yet
    t.save_checkpoint(tmp_path / "before.ckpt")
    assert os.path.isfile(tmp_path / "before.ckpt")
    assert_state_of(tmp_path / "before.ckpt", model)
    t.fit(model)  # the same strategy is adapted once fit attaches the module
    assert t.global_step == 3


def test_save_from_validate_hook_returns_durable(tmp_path: Any) -> None:
    seen: list[bool] = []

    class SaveInValidation(Callback):
        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            path = os.path.join(trainer.default_root_dir, "val.ckpt")
            trainer.save_checkpoint(path)
            seen.append(os.path.isfile(path))

    io = LazyCheckpointIO()
    t = trainer(tmp_path, io, callbacks=[SaveInValidation()])
    model = BoringModel()
    t.fit(model)  # the optimizer is tracked from here on
    t.validate(model)
    assert seen[-1] is True
    assert_state_of(tmp_path / "val.ckpt", model)


def test_hook_saves_inside_fit_stay_lazy(tmp_path: Any) -> None:
    pending: list[bool] = []

    class SaveInHooks(Callback):
        def __init__(self, io: LazyCheckpointIO) -> None:
            self.io = io

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                path = os.path.join(trainer.default_root_dir, "batch.ckpt")
                trainer.save_checkpoint(path)
                # Committed only once the next optimizer step confirms it: still pending here.
                pending.append(os.path.abspath(path) in self.io.pending_paths())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            trainer.save_checkpoint(os.path.join(trainer.default_root_dir, "end.ckpt"))

    io = LazyCheckpointIO()
    model = BoringModel()
    t = trainer(tmp_path, io, callbacks=[SaveInHooks(io)])
    t.fit(model)
    assert pending == [True]
    assert torch.load(tmp_path / "batch.ckpt", weights_only=False)["global_step"] == 2
    assert_state_of(tmp_path / "end.ckpt", model)  # on_train_end: drained by teardown


# -- item 2: save_on_exception ------------------------------------------------------------------------


class FailsAtStep3(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 3:
            raise RuntimeError("user error at step 3")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("io_factory", [lambda: None, LazyCheckpointIO], ids=["stock", "lazy"])
def test_save_on_exception_raises_the_user_error_and_leaves_the_checkpoint(tmp_path: Any, io_factory: Any) -> None:
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, save_on_exception=True)
    t = trainer(tmp_path, io_factory(), callbacks=[ck], enable_checkpointing=True, max_steps=6)
    with pytest.raises(RuntimeError, match="user error at step 3"):
        t.fit(FailsAtStep3())
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert torch.load(tmp_path / "ck" / "epoch=0-step=3.ckpt", weights_only=False)["global_step"] == 3


# -- item 3: ddp_spawn ----------------------------------------------------------------------------------


@pytest.mark.slow(reason="Lightning's ddp_spawn starts two fresh interpreters (spawn, not fork)")
@pytest.mark.timeout(240)
def test_ddp_spawn_two_gloo_processes_returns_with_the_result(tmp_path: Any) -> None:
    proc, report = run_script("spawn", tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert report["files"] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert report["weights_returned"] is True  # the worker's save, loaded by the parent
    assert report["threads"] == []


# -- item 6: threads and exit ----------------------------------------------------------------------


@pytest.mark.slow(reason="a Lightning fit in a child process, interrupted by SIGINT")
@pytest.mark.timeout(150)
def test_sigint_during_fit_exits_with_the_saves_complete(tmp_path: Any) -> None:
    proc, report = run_script("sigint", tmp_path, timeout=120)
    assert (tmp_path / "interrupting").exists()
    assert "Detected KeyboardInterrupt" in proc.stdout + proc.stderr
    assert proc.returncode == 1  # Lightning's interrupt handling: teardown, then exit(1)
    # the step-2 save was pending at the interrupt, step 3 is the exception checkpoint
    assert report["files"] == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    for name, step in (("epoch=0-step=2.ckpt", 2), ("epoch=0-step=3.ckpt", 3)):
        assert torch.load(tmp_path / "ck" / name, weights_only=False)["global_step"] == step
    assert report["threads"] == []


@pytest.mark.slow(reason="a Lightning fit and a load in child processes")
@pytest.mark.timeout(150)
def test_a_trainer_that_only_loads_starts_no_thread(tmp_path: Any) -> None:
    proc, report = run_script("load_only", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert report == {"threads": [], "loaded_step": 2}


@pytest.mark.timeout(150)
def test_interpreter_exit_drains_a_pending_save(tmp_path: Any) -> None:
    proc, report = run_script("exit_drain", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert report["threads"] and all(t["daemon"] for t in report["threads"])  # none keeps the process alive
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=False)["model"]
    expected = torch.load(tmp_path / "expected.pt", weights_only=False)
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
