"""Stall per checkpoint of Lightning checkpoint plugins, side by side in one process.

    python benchmarks/bench_lightning.py                       # ~100M-parameter GPT (12 x 768)
    python benchmarks/bench_lightning.py --layers 4 --dim 512  # quicker

Trainer.fit with ModelCheckpoint(every_n_train_steps=1, save_top_k=1) under: no checkpointing,
TorchCheckpointIO, AsyncCheckpointIO, LazyCheckpointIO. Stall per checkpoint =
(fit time - no-checkpoint fit time) / checkpoints; fit time includes teardown, where the async
plugins drain their last saves. After an uncounted warm-up fit, the no-checkpoint run is done first
and last, and the faster of the two is the baseline; os.sync() runs (untimed) between runs.
Targets (issue 3): Lazy <= 0.1 x Torch and <= 0.15 x Async.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from lightning_gpt import GPT  # noqa: E402

from lazyckpt.lightning import LazyCheckpointIO  # noqa: E402


def fit(plugin: Any, directory: str, args: argparse.Namespace) -> tuple[float, int]:
    L.seed_everything(0, verbose=False)
    model = GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.dim // 64, seq=args.seq,
                batch_size=args.batch, steps=args.steps)  # fmt: skip
    saving = plugin is not None
    ckpt = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1) if saving else None
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=saving, callbacks=[ckpt] if ckpt else [],
        plugins=[plugin] if saving else [],
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model)
    return time.perf_counter() - t0, (args.steps if saving else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    params = sum(x.numel() for x in GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.dim // 64,
                                        seq=args.seq).parameters())  # fmt: skip
    print(f"GPT {args.layers} x {args.dim}, {params / 1e6:.1f}M parameters, {args.steps} steps, "
          f"checkpoint every step, torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)  # fmt: skip

    warm = argparse.Namespace(**{**vars(args), "steps": 2})
    print(f"  warm-up            fit {fit(None, '', warm)[0]:7.1f} s (not counted)", flush=True)
    runs: dict[str, tuple[float, int]] = {}
    lazy = LazyCheckpointIO()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        plugins = [
            ("none", None),
            ("TorchCheckpointIO", TorchCheckpointIO()),
            ("AsyncCheckpointIO", AsyncCheckpointIO()),
            ("LazyCheckpointIO", lazy),
            ("none#2", None),
        ]
        for name, plugin in plugins:
            runs[name] = fit(plugin, os.path.join(tmp, name), args)
            os.sync()  # untimed: the stock plugins' unsynced writeback must not slow the next run
            print(f"  {name:<18} fit {runs[name][0]:7.1f} s", flush=True)

    base = min(runs["none"][0], runs["none#2"][0])  # the faster baseline: conservative for every plugin
    stall = {n: (t - base) / c for n, (t, c) in runs.items() if c}
    print("\n| plugin | fit time (s) | stall per checkpoint (s) | vs Torch | vs Async |\n|---|---|---|---|---|")
    print(f"| no checkpointing | {base:.1f} | - | - | - |")
    for name in ("TorchCheckpointIO", "AsyncCheckpointIO", "LazyCheckpointIO"):
        t, _ = runs[name]
        rel_t, rel_a = stall[name] / stall["TorchCheckpointIO"], stall[name] / stall["AsyncCheckpointIO"]
        print(f"| {name} | {t:.1f} | {stall[name]:.3f} | {rel_t:.2f}x | {rel_a:.2f}x |")
    inner = [s.blocked_s + s.guard_wait_s for s in lazy.stats]
    gbps = [s.write_gbps for s in lazy.stats]
    print(f"\nLazyCheckpointIO per-save telemetry: stall (in save + step wait) mean {sum(inner) / len(inner):.3f} s, "
          f"max {max(inner):.3f} s; write {sum(gbps) / len(gbps):.2f} GB/s; "
          f"{lazy.stats[0].file_bytes / 1e9:.2f} GB per checkpoint")  # fmt: skip
    ok = (
        stall["LazyCheckpointIO"] <= 0.1 * stall["TorchCheckpointIO"]
        and stall["LazyCheckpointIO"] <= 0.15 * stall["AsyncCheckpointIO"]
    )
    print("targets (<= 0.1x Torch, <= 0.15x Async):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
