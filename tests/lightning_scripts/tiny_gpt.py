"""A tiny GPT-like LightningModule and checkpoint helpers shared by the Lightning tests and scripts."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import lightning as L
import torch
from torch import nn

from lazyckpt import LazyCheckpointer, SaveHandle
from lazyckpt.lightning import LazyCheckpointIO


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    """GPT-like: token + position embeddings, causal blocks, tied head. ``seen`` is a buffer that the
    forward pass changes in place (like BatchNorm statistics), so buffers are exercised too."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16, lr: float = 3e-3,
        batches: int = 8, batch_size: int = 4, val_batches: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += idx.numel()
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()

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


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """Exact structural equality; tensors bit for bit, dtype and shape included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{where}: tensor values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a)} len {len(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def load(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_files_match_expected(io: RecordingLazyIO) -> int:
    """Every file still on disk holds the last checkpoint saved to its path. Returns how many were checked."""
    checked = 0
    for path, dumps in io.expected.items():
        if os.path.exists(path) and not os.path.islink(path):
            assert_same(dumps[-1], load(path), os.path.basename(path))
            checked += 1
    return checked


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
        self._held: list[tuple[SaveHandle, SaveHandle, str]] = []

    def save(self, obj: Any, path: Any, format: str = "torch", metadata: Any = None) -> SaveHandle:
        self._release()
        final = os.path.abspath(os.fspath(path))
        real = super().save(obj, final + ".held", format)
        fake = SaveHandle(final)
        self._held.append((real, fake, final + ".held"))
        return fake

    def _release(self) -> None:
        held, self._held = self._held, []
        for real, fake, tmp in held:
            try:
                stats = real.wait()
                os.replace(tmp, fake.path)
                fake._finish(stats, None)
            except BaseException as exc:
                fake._finish(None, exc)

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
