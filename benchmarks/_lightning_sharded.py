"""``bench_lightning --strategy model_parallel``: stall per checkpoint of ModelParallelStrategy's
stock sharded save vs LazyCheckpointIO, 2 processes (gloo, CPU), the same GPT with FSDP2.

The benchmark starts both ranks itself (LOCAL_RANK/WORLD_SIZE set, so Lightning treats them as
launched externally and every Trainer of a worker joins one process group). Each worker runs an
uncounted warm-up fit, then ``--repeats`` rounds of three fits in rotated order: no checkpoint,
the stock strategy (DCP ``save`` with fsync, ``meta.pt`` on rank 0), and
``plugins=[LazyCheckpointIO()]``; ModelCheckpoint(every_n_train_steps=1, save_top_k=1). Stall
per checkpoint = (fit time, teardown drain included, - the round's no-checkpoint fit) / steps,
measured on rank 0; median over rounds. Target (issue 14): lazy <= 0.3x stock.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODES = ["none", "stock", "lazy"]


def run(args: argparse.Namespace) -> None:
    """Parent: start the 2 ranks, print rank 0's table."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
        cmd = [sys.executable, "-m", "benchmarks._lightning_sharded", tmp, json.dumps(vars(args))]
        procs = [subprocess.Popen(cmd, env=dict(env, LOCAL_RANK=str(r), RANK=str(r))) for r in (0, 1)]
        codes = [p.wait() for p in procs]
        if codes != [0, 0]:
            raise SystemExit(f"benchmark workers failed: exit codes {codes}")
        with open(os.path.join(tmp, "result.json")) as f:
            report(json.load(f), args)


def report(runs: dict[str, list[float]], args: argparse.Namespace) -> None:
    per_rep = {m: [(t - b) / args.steps for t, b in zip(runs[m], runs["none"], strict=True)] for m in MODES[1:]}
    stall = {m: statistics.median(v) for m, v in per_rep.items()}
    print(f"\n| strategy, plugin | fit, median of {args.repeats} (s) | stall per checkpoint, median (s) "
          "| vs stock | stall per repeat (s) |\n|---|---|---|---|---|")  # fmt: skip
    print(f"| ModelParallelStrategy, no checkpointing | {statistics.median(runs['none']):.1f} | - | - | - |")
    for mode, label in (("stock", "stock DCP save"), ("lazy", "LazyCheckpointIO")):
        reps = ", ".join(f"{x:.3f}" for x in per_rep[mode])
        print(f"| ModelParallelStrategy, {label} | {statistics.median(runs[mode]):.1f} | {stall[mode]:.3f} "
              f"| {stall[mode] / stall['stock']:.2f}x | {reps} |")  # fmt: skip
    if stall["stock"] <= 0 or stall["lazy"] < 0:
        print("target (lazy <= 0.3x stock): not measurable (a stall below zero: the machine's noise exceeds it)")
    else:
        print("target (lazy <= 0.3x stock):", "met" if stall["lazy"] <= 0.3 * stall["stock"] else "NOT met")


def worker(out: str, args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from examples.lightning_gpt import GPT
    from lazyckpt.lightning import LazyCheckpointIO

    class ShardedGPT(GPT):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.gpt.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.gpt, mesh=mesh)

        def train_dataloader(self) -> Any:  # every rank gets `steps` batches
            h = self.hparams
            g = torch.Generator().manual_seed(0)
            data = torch.randint(0, h.vocab, (2 * h.steps * h.batch_size, h.seq + 1), generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=h.batch_size)

    def fit(mode: str, steps: int, directory: str) -> float:
        L.seed_everything(0, verbose=False)
        model = ShardedGPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=max(1, args.dim // 64),
                           seq=args.seq, batch_size=args.batch, steps=steps)  # fmt: skip
        saving = mode != "none"
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_epochs=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=saving,
            callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=1)] if saving else [],
            plugins=[LazyCheckpointIO()] if mode == "lazy" else [],
        )  # fmt: skip
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        t0 = time.perf_counter()
        trainer.fit(model)
        return time.perf_counter() - t0

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    rank = int(os.environ["LOCAL_RANK"])
    warm = fit("lazy", 2, os.path.join(out, "warm"))
    if rank == 0:
        print(f"GPT {args.layers} x {args.dim}, {args.steps} steps, 2 ranks, {torch.get_num_threads()} torch "
              f"thread(s) each on {os.cpu_count()} CPUs; warm-up fit {warm:.1f} s", flush=True)  # fmt: skip
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
            t = fit(mode, args.steps, os.path.join(out, f"{mode}-{rep}"))
            runs[mode].append(t)
            os.sync()
            if rank == 0:
                print(f"  [{rep}] {mode:<6} fit {t:7.1f} s", flush=True)
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    worker(sys.argv[1], argparse.Namespace(**json.loads(sys.argv[2])))
    # No interpreter finalization: a gloo worker thread may abort it (tests/_util.py, run_then_exit).
    from lazyckpt.core import exit as _exit

    _exit.drain()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
