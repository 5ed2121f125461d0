"""Models and helpers for the MultiLevelCheckpoint tests and scripts (tests/test_lightning_levels.py).

``StepGPT`` draws each training batch from (epoch, batch index), both restored exactly by a stock
resume, so a run resumed mid-epoch sees the data an uninterrupted run sees (a plain DataLoader is not
resumable; the batches it yields are ignored). ``TwoOptimizerGPT`` steps two optimizers per batch
(manual optimization: ``global_step`` advances by 2 per batch).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import lightning as L
import torch

from lazyckpt.lightning import _compat
from lightning_scripts.tiny_gpt import TinyGPT, trainer_kwargs

__all__ = ["StepGPT", "TwoOptimizerGPT", "StockSaves", "digest", "level_trainer", "state_of"]


class StepGPT(TinyGPT):
    def batch_for(self, batch_idx: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.current_epoch + batch_idx)
        h = self.hparams
        return (torch.randint(0, h.vocab, (h.batch_size, h.seq + 1), generator=g),)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.batch_for(batch_idx))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))


class TwoOptimizerGPT(StepGPT):
    """Manual optimization, two optimizers (embeddings / the rest), both stepped every batch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self.batch_for(batch_idx))
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss

    def configure_optimizers(self) -> Any:
        emb = [p for n, p in self.named_parameters() if "wte" in n or "wpe" in n]
        rest = [p for n, p in self.named_parameters() if not ("wte" in n or "wpe" in n)]
        return [torch.optim.AdamW(emb, lr=3e-3), torch.optim.SGD(rest, lr=1e-2, momentum=0.9)]


class StockSaves(L.Callback):
    """At every batch end that stepped, ``trainer.save_checkpoint`` (with the Trainer's plugin: use it
    in a run with the stock ``TorchCheckpointIO``) to ``<folder>/step-<n>.ckpt``: the reference."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.seen = -1

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step != self.seen:
            self.seen = trainer.global_step
            trainer.save_checkpoint(os.path.join(self.folder, f"step-{trainer.global_step:08d}.ckpt"))


def level_trainer(callbacks: list[Any], plugins: list[Any], **overrides: Any) -> L.Trainer:
    kwargs = trainer_kwargs(**{"max_epochs": None, "enable_checkpointing": False, **overrides})
    return L.Trainer(callbacks=callbacks, plugins=plugins, **kwargs)


def state_of(trainer: L.Trainer) -> dict[str, Any]:
    """What a checkpoint of this Trainer would hold now, less the callbacks' states (paths)."""
    dump = _compat.dump_checkpoint(trainer)
    dump.pop("callbacks", None)
    return dump


PARTS = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step", "epoch")


def digest(checkpoint: dict[str, Any], parts: tuple[str, ...] = PARTS) -> str:
    """A hash of the training state in a Lightning checkpoint (weights, optimizers, schedulers, loops)."""
    h = hashlib.sha256()
    for key, value in _flat({k: checkpoint[k] for k in parts}):
        h.update(key.encode())
        if torch.is_tensor(value):
            h.update(str(value.dtype).encode() + str(tuple(value.shape)).encode())
            h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _flat(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k in sorted(obj, key=str) for kv in _flat(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _flat(v, f"{prefix}/{i}")]
    return [(prefix, obj)]
