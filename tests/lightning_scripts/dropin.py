"""Run by tests/test_lightning_dropin.py in a fresh process: ``python dropin.py MODE OUT_DIR``.

Modes: ``spawn`` (ddp_spawn with 2 gloo processes: fit must return with the workers' result),
``sigint`` (SIGINT during fit: the process must exit through Lightning's interrupt handling),
``load_only`` (a Trainer that only loads: no lazyckpt thread afterwards), ``exit_drain`` (a lazy
Fabric save left pending at interpreter exit: the file must be complete). Each writes
``OUT_DIR/report.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from _util import run_then_exit
from lazyckpt.lightning import LazyCheckpointIO

if __name__ == "__mp_main__":  # a ddp_spawn worker: this module is imported before its target is unpickled
    import importlib

    # the module, not the function torch.multiprocessing.spawn
    _spawn = importlib.import_module("torch.multiprocessing.spawn")
    _wrap = _spawn._wrap  # the worker's target: no interpreter finalization after it (a gloo thread may abort it)
    _spawn._wrap = lambda *args: run_then_exit(lambda: _wrap(*args))


def kwargs(out: str, **overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        default_root_dir=out, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    kw.update(overrides)
    return kw


def lazyckpt_threads() -> list[dict[str, Any]]:
    return [{"name": t.name, "daemon": t.daemon} for t in threading.enumerate() if t.name.startswith("lazyckpt-")]


def report(out: str, **fields: Any) -> None:
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(fields, f)


def spawn(out: str) -> None:
    L.seed_everything(0, verbose=False)
    model = BoringModel()
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ck"), every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        plugins=[LazyCheckpointIO()], callbacks=[ckpt],
        **kwargs(out, devices=2, strategy="ddp_spawn", max_steps=3),
    )  # fmt: skip
    trainer.fit(model)
    # ddp_spawn sends rank 0's final weights back through a save in the worker and a load here.
    last = torch.load(os.path.join(out, "ck", "epoch=0-step=3.ckpt"), weights_only=False)
    same = all(torch.equal(v, last["state_dict"][k]) for k, v in model.state_dict().items())
    report(out, files=sorted(os.listdir(os.path.join(out, "ck"))), global_step=trainer.global_step,
           weights_returned=same, threads=lazyckpt_threads())  # fmt: skip


class Interrupt(Callback):
    """Sends SIGINT to this process while the step-3 save is pending (before the next step)."""

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 3:
            with open(os.path.join(trainer.default_root_dir, "interrupting"), "w"):
                pass
            signal.raise_signal(signal.SIGINT)


def sigint(out: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a parent may have ignored SIGINT
    # Every 2 steps, and the exception checkpoint at step 3 (Lightning saves it on KeyboardInterrupt too).
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ck"), every_n_train_steps=2, save_top_k=-1,
                           save_on_exception=True)  # fmt: skip
    trainer = L.Trainer(plugins=[LazyCheckpointIO()], callbacks=[ckpt, Interrupt()], **kwargs(out, max_steps=50))
    try:
        trainer.fit(BoringModel())
    finally:
        report(out, files=sorted(os.listdir(os.path.join(out, "ck"))), threads=lazyckpt_threads())


def load_only(out: str) -> None:
    path = os.path.join(out, "model.ckpt")
    trainer = L.Trainer(**kwargs(out, max_steps=2, enable_checkpointing=False))
    trainer.fit(BoringModel())
    trainer.save_checkpoint(path)  # stock plugin: the file to load
    io = LazyCheckpointIO()
    loader = L.Trainer(plugins=[io], **kwargs(out, max_steps=2, enable_checkpointing=False))
    model = BoringModel()
    model.trainer = loader
    loader.strategy.connect(model)
    loader.strategy.setup_optimizers(loader)  # what fit does before it restores
    loaded = loader.strategy.load_checkpoint(path)  # what fit's resume calls first
    report(out, threads=lazyckpt_threads(), loaded_step=loaded["global_step"])


def exit_drain(out: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LazyCheckpointIO()])
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()  # the optimizer is known: its tensors are copied lazily
    fabric.save(os.path.join(out, "fabric.ckpt"), {"model": model, "optimizer": opt})
    torch.save(model.state_dict(), os.path.join(out, "expected.pt"))
    report(out, threads=lazyckpt_threads())
    # No wait: interpreter exit must drain the pending save.


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    {"spawn": spawn, "sigint": sigint, "load_only": load_only, "exit_drain": exit_drain}[mode](out)
