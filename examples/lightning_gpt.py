"""Train a small GPT with a checkpoint after every step: Lightning's stock plugin, lazyckpt to one
folder, and lazyckpt multi-level (a memory level every step, a disk level every few), side by side;
then the time to resume from each level.

    python -m examples.lightning_gpt              # from the repository root; ~1.5-3 minutes on a laptop CPU
    python -m examples.lightning_gpt --steps 10 --layers 4 --dim 256   # quicker

Prints, for each checkpoint, how long training stalled for it: with the stock TorchCheckpointIO the
whole torch.save + fsync happens inside the training loop; with LazyCheckpointIO (one folder, through
ModelCheckpoint) and MultiLevelCheckpoint the stall is the time inside the save call plus any wait of
the next optimizer step for host copies (the disk level copies the memory level's file on its own
thread; a memory level on tmpfs is written inside the save when training uses every core, where a
background copy would cost the training more: ``--threads 1`` on 2 cores shows the spare-core regime).
Then, for each level: ``lazyckpt.latest()`` + ``lazyckpt.load()`` (both check every CRC)
against stock ``torch.load`` of the same file (page cache warm: the files were just written).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lazyckpt
from benchmarks import gpt
from lazyckpt import Level
from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint


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


def fit(plugin: Any, directory: str, args: argparse.Namespace, levels: list[Level] | None = None) -> float:
    """One fit; a checkpoint every step through ModelCheckpoint (``plugin``), through
    MultiLevelCheckpoint (``plugin`` and ``levels``), or none (no plugin)."""
    L.seed_everything(0, verbose=False)
    model = GPT(dim=args.dim, layers=args.layers, heads=max(1, args.dim // 64), steps=args.steps)
    callbacks: list[Any] = []
    if levels is not None:
        callbacks = [MultiLevelCheckpoint(levels)]
    elif plugin is not None:
        callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1)]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=levels is None and plugin is not None,
        callbacks=callbacks, plugins=[plugin] if plugin is not None else [],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model)  # includes the teardown, where LazyCheckpointIO drains its last saves
    return time.perf_counter() - t0


def resume_times(levels: list[Level], rounds: int = 3) -> list[tuple[int, int, float, float, float]]:
    """Per level: (level, step, latest() s, lazyckpt.load s, torch.load s of the same file), medians of
    ``rounds`` alternating rounds. Each level alone, as if the faster ones were gone."""
    out = []
    for index, level in enumerate(levels):
        t_latest, t_load, t_torch = [], [], []
        found = None
        for _ in range(rounds):
            t0 = time.perf_counter()
            found = lazyckpt.latest([level])
            t1 = time.perf_counter()
            if found is None:
                raise SystemExit(f"no complete checkpoint at level {index} ({level.path})")
            state = lazyckpt.load(found, map_location="cpu")
            t2 = time.perf_counter()
            stock = torch.load(found.path, map_location="cpu")
            t3 = time.perf_counter()
            assert state["global_step"] == stock["global_step"] == found.step
            del state, stock
            t_latest.append(t1 - t0)
            t_load.append(t2 - t1)
            t_torch.append(t3 - t2)
        assert found is not None
        med = statistics.median
        out.append((index, found.step, med(t_latest), med(t_load), med(t_torch)))
    return out


def memory_folder(tmp: str) -> str:
    """A memory level's folder: /dev/shm (tmpfs) where there is one, else a temporary folder."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(prefix="lazyckpt-main-job-", dir="/dev/shm")
    return os.path.join(tmp, "memory")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--disk-every", type=int, default=5, help="the disk level's interval, in steps")
    parser.add_argument("--threads", type=int, default=0, help="training threads (0: every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    params = sum(p.numel() for p in GPT(dim=args.dim, layers=args.layers, heads=max(1, args.dim // 64)).parameters())
    print(f"GPT with {params / 1e6:.1f}M parameters, {args.steps} steps, a checkpoint after every step")

    with tempfile.TemporaryDirectory() as tmp:
        mem = memory_folder(tmp)
        try:
            levels = [Level(mem, every=1, keep=2), Level(os.path.join(tmp, "disk"), every=args.disk_every, keep=2)]
            fit(None, os.path.join(tmp, "warmup"), argparse.Namespace(**{**vars(args), "steps": 3}))  # untimed
            base = fit(None, os.path.join(tmp, "none"), args)
            stock = TimedTorchCheckpointIO()
            t_stock = fit(stock, os.path.join(tmp, "stock"), args)
            lazy = LazyCheckpointIO()
            t_lazy = fit(lazy, os.path.join(tmp, "lazy"), args)
            multi = LazyCheckpointIO()
            t_multi = fit(multi, "", args, levels)
            base = min(base, fit(None, os.path.join(tmp, "none2"), args))  # first and last: drift hits both
            resumes = resume_times(levels)
        finally:
            shutil.rmtree(mem, ignore_errors=True)

    lazy_stalls = [s.blocked_s + s.guard_wait_s for s in lazy.stats]
    multi_stalls = [s.blocked_s + s.guard_wait_s for s in multi.stats]
    print(f"\n{'ckpt':>4}  {'stock stall s':>13}  {'lazy stall s':>12}  {'multi-level stall s':>19}")
    for i, (a, b, c) in enumerate(zip(stock.stalls, lazy_stalls, multi_stalls, strict=False)):
        print(f"{i:>4}  {a:>13.3f}  {b:>12.3f}  {c:>19.3f}")
    n = max(1, len(stock.stalls))
    print(
        f"\nfit time: no checkpoints {base:.1f}s, stock {t_stock:.1f}s, lazy {t_lazy:.1f}s, multi-level {t_multi:.1f}s"
    )
    print(
        f"stall per checkpoint from fit times (teardown included): stock {(t_stock - base) / n:.3f}s, "
        f"lazy {(t_lazy - base) / n:.3f}s, multi-level {(t_multi - base) / n:.3f}s; "
        f"checkpoint size {lazy.stats[0].file_bytes / 1e6:.0f} MB"
    )
    kind = "tmpfs" if mem.startswith("/dev/shm") else "a temporary folder"
    print(
        f"multi-level: memory level ({kind}) every step keep 2, disk level every {args.disk_every} steps keep 2; "
        f"{len(multi.stats)} saves (one staging each), the disk copies made from the memory files"
    )
    print("\ntime to resume from each level alone (medians of 3; page cache warm):")
    print(
        f"{'level':>12}  {'step':>4}  {'latest() s':>10}  {'lazyckpt.load s':>15}  {'total s':>7}  {'torch.load s':>12}"
    )
    for index, step, t_latest, t_load, t_torch in resumes:
        name = ("memory", "disk")[index]
        print(f"{name:>12}  {step:>4}  {t_latest:>10.3f}  {t_load:>15.3f}  {t_latest + t_load:>7.3f}  {t_torch:>12.3f}")
    print("resume with stock Lightning: trainer.fit(model, ckpt_path=lazyckpt.latest(levels, preload=False).path)")
    if not (math.isfinite(t_lazy) and math.isfinite(t_multi)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
