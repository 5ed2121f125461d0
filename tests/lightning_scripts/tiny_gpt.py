"""A tiny GPT-like LightningModule and checkpoint helpers shared by the Lightning tests and scripts."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import lightning as L
import torch
from torch import nn

from _util import assert_same
from benchmarks import gpt
from lazyckpt import LazyCheckpointer, SaveHandle
from lazyckpt.core.handle import Completion
from lazyckpt.lightning import LazyCheckpointIO

__all__ = [
    "TinyGPT", "RecordingLazyIO", "DeferredCommitCheckpointer", "assert_same", "fabric_with_tiny_gpt", "load",
    "trainer_kwargs",
]  # fmt: skip


class TinyGPT(L.LightningModule):
    """The repository's GPT (benchmarks/gpt.py: tied head, so two state_dict keys share a storage), small.

    ``seen`` is a buffer that the forward pass changes in place (like BatchNorm statistics), so buffers
    are exercised too."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16, lr: float = 3e-3,
        batches: int = 8, batch_size: int = 4, val_batches: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.gpt = gpt.GPT(gpt.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    @property
    def tok(self) -> nn.Embedding:
        """The token embedding (tied to the output head)."""
        return self.gpt.wte

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += idx.numel()
        return self.gpt(idx)[0]

    def loss(self, batch: Any) -> torch.Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * math.exp(-0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _tokens(self, n: int, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, self.hparams.vocab, (n * self.hparams.batch_size, self.hparams.seq + 1), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=self.hparams.batch_size)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(self.hparams.batches, 0)

    def val_dataloader(self) -> Any:
        return self._tokens(self.hparams.val_batches, 1) if self.hparams.val_batches else []


class RecordingLazyIO(LazyCheckpointIO):
    """Keeps a deep copy of every checkpoint exactly as dump_checkpoint handed it over."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expected: dict[str, list[dict[str, Any]]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.expected.setdefault(os.fspath(path), []).append(copy.deepcopy(checkpoint))
        super().save_checkpoint(checkpoint, path, storage_options)


def load(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_files_match_expected(io: RecordingLazyIO) -> int:
    """Every file still on disk holds the last checkpoint saved to its path. Returns how many were checked."""
    checked = 0
    for path, dumps in io.expected.items():
        if os.path.exists(path) and not os.path.islink(path):
            assert_same(load(path), dumps[-1], os.path.basename(path))
            checked += 1
    return checked


def fabric_with_tiny_gpt(io: LazyCheckpointIO, dim: int = 128) -> tuple[L.Fabric, Any, Any]:
    """A CPU Fabric with ``io``, seeded, and a ``TinyGPT(dim)`` with AdamW set up on it."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    L.seed_everything(0, verbose=False)
    model = TinyGPT(dim=dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    return fabric, model, opt


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )  # fmt: skip
    kwargs.update(overrides)
    return kwargs


class DeferredCommitCheckpointer(LazyCheckpointer):
    """Fault injection: each save becomes visible at its path only when the next save starts (or at
    wait/close), as with storage slower than a training step. Deterministic, unlike racing a real write."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._held: list[tuple[SaveHandle, Completion, str]] = []

    def save(self, obj: Any, path: Any, format: str = "torch", metadata: Any = None) -> SaveHandle:
        self._release()
        final = os.path.abspath(os.fspath(path))
        real = super().save(obj, final + ".held", format)
        fake = Completion(final)
        self._held.append((real, fake, final + ".held"))
        return fake.handle

    def _release(self) -> None:
        held, self._held = self._held, []
        for real, fake, tmp in held:
            try:
                stats = real.wait()
                os.replace(tmp, fake.handle.path)
                fake.finish(stats, None)
            except BaseException as exc:
                fake.finish(None, exc)

    def wait(self, timeout: float | None = None) -> None:
        self._release()
        super().wait(timeout)

    def remove(self, path: Any, **kwargs: Any) -> Any:
        # The core orders a delete after pending saves to the path; the held saves are pending only
        # here, so they land first (as at the next save), then the core deletes.
        self._release()
        return super().remove(path, **kwargs)

    def close(self) -> None:
        self._release()
        super().close()
