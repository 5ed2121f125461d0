"""Run by tests/test_lightning_preemption.py in a fresh process: ``python preempt.py MODE OUT_DIR AT``.

A BoringModel fit with ``LazyCheckpointIO`` and a ModelCheckpoint saving every step is preempted after
step AT, then SIGKILLed the moment the preemption's save returns (a job's end):

- ``slurm``: ``SLURMEnvironment(auto_requeue=True)`` (the parent sets the SLURM variables); SIGUSR1 to this
  process: Lightning's handler saves ``hpc_ckpt_1.ckpt`` inside the signal handler.
- ``slurm-inside``: the same, the signal raised while the main thread holds a lazyckpt lock (the first it
  takes after step AT, inside ModelCheckpoint's save): the handler's save re-enters lazyckpt.
- ``sigterm``: SIGTERM to this process; Lightning raises ``SIGTERMException`` at its next check and
  ``OnExceptionCheckpoint`` saves ``on_exception.ckpt``.

Prints ``SAVED`` once the preemption's save has returned, just before the SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lazyckpt.lightning import LazyCheckpointIO
from lazyckpt.threads import reentry

MODE, OUT, AT = sys.argv[1], sys.argv[2], int(sys.argv[3])
MAIN = threading.main_thread()


def die() -> None:
    print("SAVED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


_acquire, _enter = reentry.Lock.acquire, reentry.Lock.__enter__
armed = [False]


def spring() -> None:
    """Right after the main thread took a lazyckpt lock, once armed: SIGUSR1 while it is held."""
    if armed[0] and threading.current_thread() is MAIN:
        armed[0] = False
        os.kill(os.getpid(), signal.SIGUSR1)  # Lightning's handler runs here, the lock held
        die()


def trap(self, blocking=True, timeout=-1):  # type: ignore[no-untyped-def]
    got = _acquire(self, blocking, timeout)
    if got:
        spring()
    return got


def trap_enter(self):  # type: ignore[no-untyped-def]
    got = _enter(self)
    spring()
    return got


class Preempt(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step != AT:
            return
        if MODE == "slurm":
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler has run (and saved) when this returns
            die()
        elif MODE == "slurm-inside":
            reentry.Lock.acquire = trap  # type: ignore[method-assign]
            reentry.Lock.__enter__ = trap_enter  # type: ignore[method-assign]
            armed[0] = True  # ModelCheckpoint's save (it runs after this callback) takes the locks
        else:
            os.kill(os.getpid(), signal.SIGTERM)


class KilledAfterSave(OnExceptionCheckpoint):
    def on_exception(self, trainer, pl_module, exception):  # type: ignore[no-untyped-def]
        super().on_exception(trainer, pl_module, exception)
        die()


def main() -> None:
    L.seed_everything(0, verbose=False)
    plugins: list = [LazyCheckpointIO()]
    callbacks: list = [
        Preempt(),
        ModelCheckpoint(dirpath=os.path.join(OUT, "ck"), every_n_train_steps=1, save_top_k=-1),
    ]
    if MODE.startswith("slurm"):
        plugins.append(SLURMEnvironment(auto_requeue=True))
    else:
        callbacks.append(KilledAfterSave(dirpath=OUT, filename="on_exception"))
    trainer = L.Trainer(
        default_root_dir=OUT, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, max_steps=50, plugins=plugins, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(BoringModel())
    raise SystemExit("fit returned: the preemption never came")


if __name__ == "__main__":
    main()
