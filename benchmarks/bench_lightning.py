"""Stall per checkpoint of Lightning checkpoint plugins, side by side in one process.

    python -m benchmarks.bench_lightning                       # ~100M-parameter GPT (12 x 768)
    python -m benchmarks.bench_lightning --layers 4 --dim 512 --repeats 1   # quicker

(from the repository root, with lazyckpt installed: ``pip install -e .[lightning]``)

Trainer.fit with ModelCheckpoint(every_n_train_steps=1, save_top_k=1) under: no checkpointing,
TorchCheckpointIO, AsyncCheckpointIO, LazyCheckpointIO. Stall per checkpoint =
(fit time - no-checkpoint fit time) / checkpoints; fit time includes teardown, where the async
plugins drain their last saves (so that drain weighs 1/steps: a long run has it once). After an
uncounted warm-up fit, the four configurations run ``--repeats`` times, in an order rotated every
repeat so machine drift hits all of them; a plugin's stall in a repeat is measured against that
repeat's no-checkpoint fit, and the table gives the median over repeats (per repeat too).
os.sync() runs (untimed) after every fit. ``--threads 1`` leaves one of 2 host cores to the checkpointer
(the spare-core regime, as on a GPU host); the default is torch's (the busy regime).

The run also prints the disk's own write+fsync time for one checkpoint's bytes (in the same folder) and
the storage floor: the least stall per checkpoint any plugin pays at that disk speed with a checkpoint
every step and the teardown drain counted, split into the one-time drain and the per-checkpoint part.
LazyCheckpointIO's teardown (its final drain) is timed on its own, so its stall splits the same way.
Targets (issue 15, spare-core regime): Lazy <= 0.05 x Torch, <= 0.1 x Async.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from benchmarks._baselines import disk_write_s, floor_parts, storage_floor
from examples.lightning_gpt import GPT
from lazyckpt.lightning import LazyCheckpointIO


class _TimedLazy(LazyCheckpointIO):
    """LazyCheckpointIO that records the time of its teardown (the final drain) and in save_checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.teardown_s = 0.0
        self.save_call_s = 0.0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        t = time.perf_counter()
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        finally:
            self.save_call_s += time.perf_counter() - t

    def teardown(self) -> None:
        t = time.perf_counter()
        try:
            super().teardown()
        finally:
            self.teardown_s += time.perf_counter() - t


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
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the four fits")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (1 on 2 cores: the spare-core regime; default: torch's)",
    )
    p.add_argument("--strategy", choices=["single", "model_parallel"], default="single",
                   help="model_parallel: ModelParallelStrategy (FSDP2), 2 ranks, stock sharded vs lazy")  # fmt: skip
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.strategy == "model_parallel":
        from benchmarks._lightning_sharded import run

        run(args)
        return
    params = sum(x.numel() for x in GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.dim // 64,
                                        seq=args.seq).parameters())  # fmt: skip
    print(f"GPT {args.layers} x {args.dim}, {params / 1e6:.1f}M parameters, {args.steps} steps, "
          f"checkpoint every step, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s) on "
          f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip

    warm = argparse.Namespace(**{**vars(args), "steps": 2})
    print(f"  warm-up            fit {fit(None, '', warm)[0]:7.1f} s (not counted)", flush=True)
    names = ["none", "TorchCheckpointIO", "AsyncCheckpointIO", "LazyCheckpointIO"]
    runs: dict[str, list[float]] = {n: [] for n in names}
    lazy_stats = []
    lazy_drain: list[float] = []
    lazy_call: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotated: drift hits all
                plugin = {
                    "none": None,
                    "TorchCheckpointIO": TorchCheckpointIO(),
                    "AsyncCheckpointIO": AsyncCheckpointIO(),
                    "LazyCheckpointIO": _TimedLazy(),
                }[name]
                t, _ = fit(plugin, os.path.join(tmp, f"{name}-{rep}"), args)
                runs[name].append(t)
                if isinstance(plugin, _TimedLazy):
                    lazy_stats += plugin.stats
                    lazy_drain.append(plugin.teardown_s)
                    lazy_call.append(plugin.save_call_s / args.steps)
                os.sync()  # untimed: the stock plugins' unsynced writeback must not slow the next run
                print(f"  [{rep}] {name:<18} fit {t:7.1f} s", flush=True)

    # stall of a plugin in one repeat: against the no-checkpoint fit of the same repeat
    per_rep = {n: [(t - b) / args.steps for t, b in zip(runs[n], runs["none"], strict=True)] for n in names[1:]}
    stall = {n: statistics.median(v) for n, v in per_rep.items()}
    fits = "; ".join(f"{n}: " + ", ".join(f"{t:.1f}" for t in ts) for n, ts in runs.items())
    print(f"\nfit times (s) per repeat: {fits}")
    print(f"\n| plugin | fit time, median of {args.repeats} (s) | stall per checkpoint, median (s) | vs Torch "
          "| vs Async | stall per repeat (s) |\n|---|---|---|---|---|---|")  # fmt: skip
    print(f"| no checkpointing | {statistics.median(runs['none']):.1f} | - | - | - | - |")
    for name in names[1:]:
        rel_t, rel_a = stall[name] / stall["TorchCheckpointIO"], stall[name] / stall["AsyncCheckpointIO"]
        reps = ", ".join(f"{x:.3f}" for x in per_rep[name])
        print(f"| {name} | {statistics.median(runs[name]):.1f} | {stall[name]:.3f} | {rel_t:.2f}x | {rel_a:.2f}x "
              f"| {reps} |")  # fmt: skip
    ratios_t = [a / b for a, b in zip(per_rep["LazyCheckpointIO"], per_rep["TorchCheckpointIO"], strict=True)]
    ratios_a = [a / b for a, b in zip(per_rep["LazyCheckpointIO"], per_rep["AsyncCheckpointIO"], strict=True)]
    print("Lazy/Torch per repeat: " + ", ".join(f"{r:.2f}x" for r in ratios_t)
          + "; Lazy/Async per repeat: " + ", ".join(f"{r:.2f}x" for r in ratios_a))  # fmt: skip
    inner = [s.blocked_s + s.guard_wait_s for s in lazy_stats]
    gbps = [s.write_gbps for s in lazy_stats]
    print(f"\nLazyCheckpointIO per-save telemetry: stall (in save + step wait) mean {sum(inner) / len(inner):.3f} s, "
          f"max {max(inner):.3f} s; write {sum(gbps) / len(gbps):.2f} GB/s; "
          f"{lazy_stats[0].file_bytes / 1e9:.2f} GB per checkpoint")  # fmt: skip
    drain = statistics.median(lazy_drain)
    print(f"LazyCheckpointIO: in save_checkpoint {statistics.median(lazy_call):.3f} s per checkpoint; teardown "
          f"(final drain) {drain:.2f} s per fit = {drain / args.steps:.3f} s of the stall per checkpoint (one-time), "
          f"the rest {stall['LazyCheckpointIO'] - drain / args.steps:.3f} s per checkpoint")  # fmt: skip
    step = statistics.median(runs["none"]) / args.steps
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        disk = disk_write_s(Path(tmp), lazy_stats[0].file_bytes)
    one_time, per_ckpt = floor_parts(disk["s"], step, args.steps)
    floor = storage_floor(disk["s"], step, args.steps)
    print(
        f"disk ({disk['filesystem']}): write + fsync of one checkpoint's {lazy_stats[0].file_bytes / 1e9:.2f} GB "
        f"{disk['s']:.2f} s ({disk['gbps']:.2f} GB/s; runs " + ", ".join(f"{x:.2f}" for x in disk["runs"]) + ")"
    )
    print(f"storage floor with {args.steps} checkpoints, fit step {step:.2f} s: {floor:.3f} s per checkpoint "
          f"({one_time / args.steps:.3f} one-time drain + {per_ckpt:.3f} per checkpoint); LazyCheckpointIO = floor + "
          f"{stall['LazyCheckpointIO'] - floor:.3f} s")  # fmt: skip
    ok = (
        stall["LazyCheckpointIO"] <= 0.05 * stall["TorchCheckpointIO"]
        and stall["LazyCheckpointIO"] <= 0.1 * stall["AsyncCheckpointIO"]
    )
    print("targets (<= 0.05x Torch, <= 0.1x Async):", "met" if ok else "NOT met")
    if args.json:
        import json
        import platform
        import sys

        import lightning

        doc = {
            "command": "python -m benchmarks.bench_lightning " + " ".join(sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
            "threads": torch.get_num_threads(), "params": params, "steps": args.steps, "repeats": args.repeats,
            "checkpoint_bytes": lazy_stats[0].file_bytes, "fit_s": runs, "stall_s": stall, "per_repeat_s": per_rep,
            "storage_floor_s": floor, "disk_s": disk["s"],
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
