"""Train a small GPT with a checkpoint after every step, with lazyckpt and with Lightning's stock plugin.

    python -m examples.lightning_gpt              # from the repository root; ~2-3 minutes on a laptop CPU
    python -m examples.lightning_gpt --steps 10 --layers 4 --dim 256   # quicker

Prints, for each checkpoint, how long training stalled for it: with the stock TorchCheckpointIO the
whole torch.save + fsync happens inside the training loop; with LazyCheckpointIO the stall is the
time inside save_checkpoint plus any wait of the next optimizer step for host copies.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from benchmarks import gpt
from lazyckpt.lightning import LazyCheckpointIO


class GPT(L.LightningModule):
    """The repository's GPT (benchmarks/gpt.py) as a LightningModule: AdamW, warm-up, random tokens."""

    def __init__(self, vocab: int = 8192, dim: int = 384, layers: int = 6, heads: int = 6, seq: int = 128,
                 batch_size: int = 8, steps: int = 20) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        cfg = gpt.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim)
        self.gpt = gpt.GPT(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)[0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-4)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        h = self.hparams
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, h.vocab, (h.steps * h.batch_size, h.seq + 1), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=h.batch_size)


class TimedTorchCheckpointIO(TorchCheckpointIO):
    """The stock plugin, timing each save (it is synchronous, so this is its stall)."""

    def __init__(self) -> None:
        super().__init__()
        self.stalls: list[float] = []

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        with open(path, "rb") as f:  # fsync like lazyckpt does, so both runs make files durable
            os.fsync(f.fileno())
        self.stalls.append(time.perf_counter() - t0)


def fit(plugin: Any, directory: str, args: argparse.Namespace) -> float:
    L.seed_everything(0, verbose=False)
    model = GPT(dim=args.dim, layers=args.layers, heads=max(1, args.dim // 64), steps=args.steps)
    callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1)] if plugin is not None else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=plugin is not None, callbacks=callbacks,
        plugins=[plugin] if plugin is not None else [],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model)  # includes the teardown, where LazyCheckpointIO drains its last saves
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    params = sum(p.numel() for p in GPT(dim=args.dim, layers=args.layers, heads=max(1, args.dim // 64)).parameters())
    print(f"GPT with {params / 1e6:.1f}M parameters, {args.steps} steps, a checkpoint after every step")

    with tempfile.TemporaryDirectory() as tmp:
        fit(None, os.path.join(tmp, "warmup"), argparse.Namespace(**{**vars(args), "steps": 3}))  # untimed
        base = fit(None, os.path.join(tmp, "none"), args)
        stock = TimedTorchCheckpointIO()
        t_stock = fit(stock, os.path.join(tmp, "stock"), args)
        lazy = LazyCheckpointIO()
        t_lazy = fit(lazy, os.path.join(tmp, "lazy"), args)
        base = min(base, fit(None, os.path.join(tmp, "none2"), args))  # first and last: drift hits both

    lazy_stalls = [s.blocked_s + s.guard_wait_s for s in lazy.stats]
    print(f"\n{'ckpt':>4}  {'stock stall s':>13}  {'lazy stall s':>12}  {'lazy write GB/s':>15}")
    for i, (a, b) in enumerate(zip(stock.stalls, lazy_stalls, strict=False)):
        print(f"{i:>4}  {a:>13.3f}  {b:>12.3f}  {lazy.stats[i].write_gbps:>15.2f}")
    n = max(1, len(stock.stalls))
    print(f"\nfit time: no checkpoints {base:.1f}s, stock {t_stock:.1f}s, lazy {t_lazy:.1f}s")
    print(
        f"stall per checkpoint from fit times (teardown included): stock {(t_stock - base) / n:.3f}s, "
        f"lazy {(t_lazy - base) / n:.3f}s; checkpoint size {lazy.stats[0].file_bytes / 1e6:.0f} MB"
    )
    if not math.isfinite(t_lazy):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
