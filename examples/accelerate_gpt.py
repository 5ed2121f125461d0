"""Lazy ``accelerator.save_state`` in a plain Accelerate training loop (CPU is fine).

    python -m examples.accelerate_gpt                 # from the repository root; ~14M-param GPT, 6 steps per phase
    python -m examples.accelerate_gpt --size 100m     # ~98M params, ~1.2 GB per checkpoint
    accelerate launch --multi_gpu --num_processes 2 -m examples.accelerate_gpt --cpu   # 2 processes (gloo)

It trains a small GPT (benchmarks/gpt.py) with AdamW and a scheduler, calls ``save_state()`` after every
step, first with stock Accelerate and then with lazyckpt installed, and prints the stall per checkpoint
of each next to a run without checkpoints. The only lines lazyckpt adds to a training script are marked
``# <- lazyckpt``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, broadcast_object_list

import lazyckpt.accelerate  # <- lazyckpt
from benchmarks import gpt as _gpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", help="tiny | small | 100m")
    ap.add_argument("--steps", type=int, default=6, help="steps per phase")
    ap.add_argument("--dir", default=None, help="project folder (default: a temporary one)")
    ap.add_argument("--cpu", action="store_true", help="force CPU (needed for multi-process CPU runs)")
    args = ap.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu, project_config=ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    )
    # every process must use the same folder: the main process picks it
    project_dir = [
        args.dir or (tempfile.mkdtemp(prefix="lazyckpt_accelerate_") if accelerator.is_main_process else None)
    ]
    project_dir = broadcast_object_list(project_dir)[0]
    accelerator.project_configuration.set_directories(project_dir)
    cfg = _gpt.config_for(args.size)
    model = _gpt.build(cfg, seed=0)
    optimizer = _gpt.make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batches = _gpt.BatchStream(cfg, seed=accelerator.process_index, device=accelerator.device)

    def train(steps: int, save: bool) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            x, y = batches.next()
            _, loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()  # with lazyckpt: waits here only if the last checkpoint's copies still run
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if save:
                accelerator.save_state()
            times.append(time.perf_counter() - t0)
        return times[1:] if len(times) > 1 else times  # the first step of a phase warms things up

    say = accelerator.print
    say(
        f"{_gpt.num_params(model) / 1e6:.1f}M parameters, {accelerator.num_processes} process(es), "
        f"checkpoints in {project_dir}/checkpoints"
    )
    train(1, save=False)
    base = statistics.median(train(args.steps, save=False))
    stock = statistics.median(train(args.steps, save=True))

    handle = lazyckpt.accelerate.install(accelerator)  # <- lazyckpt
    lazy = statistics.median(train(args.steps, save=True))
    handle.wait()  # <- lazyckpt: every checkpoint durable
    accelerator.load_state()  # newest checkpoint, exactly as saved
    handle.uninstall()  # <- lazyckpt: back to stock (optional)

    say(f"step without checkpoint            {base:7.3f} s")
    say(f"stall per save_state, stock        {stock - base:+7.3f} s   (no fsync)")
    say(f"stall per save_state, lazyckpt     {lazy - base:+7.3f} s   (fsync + atomic rename)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
