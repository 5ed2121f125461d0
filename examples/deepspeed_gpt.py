"""Lazy ``engine.save_checkpoint`` in a DeepSpeed ZeRO training loop (CPU is fine: ``DS_ACCELERATOR=cpu``).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m examples.deepspeed_gpt            # ~14M-param GPT, ZeRO-2
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m examples.deepspeed_gpt --size 100m --stage 3
    torchrun --nproc_per_node 8 -m examples.deepspeed_gpt --size 100m                    # GPUs (bf16)

It trains a small GPT (benchmarks/gpt.py) under ZeRO, calls ``save_checkpoint`` after every step, first with
DeepSpeed's own engine and then with lazyckpt installed, prints the stall per checkpoint of each next to
steps without checkpoints, then loads the newest tag back with stock ``load_checkpoint`` and checks that it
holds the state at its save. The only lines lazyckpt adds to a training script are marked ``# <- lazyckpt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import deepspeed
import torch
import torch.distributed as dist

import lazyckpt.deepspeed  # <- lazyckpt
from benchmarks import gpt as _gpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", help="tiny | small | 100m")
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage (0-3)")
    ap.add_argument("--steps", type=int, default=4, help="steps per phase")
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    deepspeed.init_distributed("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    box = [args.dir or (tempfile.mkdtemp(prefix="lazyckpt_deepspeed_") if rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)  # every rank saves into the same folder
    save_dir = str(box[0])
    cfg = _gpt.config_for(args.size)
    model = _gpt.build(cfg, seed=0)
    n_params = _gpt.num_params(model)  # (ZeRO-3 partitions them away from the module)
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": cuda},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    batches = _gpt.BatchStream(cfg, seed=rank, device=engine.device)

    def train(steps: int, save: bool) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            x, y = batches.next()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()  # with lazyckpt: commits the last tag here, waiting only for its copies
            if save:
                engine.save_checkpoint(save_dir)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times[1:] if len(times) > 1 else times  # the first step of a phase warms things up

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    say(f"{n_params / 1e6:.1f}M parameters, ZeRO-{args.stage}, {dist.get_world_size()} ranks, {save_dir}")
    train(1, save=False)
    base = statistics.median(train(args.steps, save=False))
    stock = statistics.median(train(args.steps, save=True))

    handle = lazyckpt.deepspeed.install(engine)  # <- lazyckpt: every rank
    lazy = statistics.median(train(args.steps, save=True))
    x = batches.next()[0][:1]
    with torch.no_grad():
        want = engine(x)[0].float()  # the model as the newest tag saved it (no step since)
    handle.wait()  # <- lazyckpt: every tag durable and latest written, or DistributedSaveError
    train(1, save=False)  # the weights move on...
    engine.load_checkpoint(save_dir)  # ...and stock load_checkpoint brings back the newest tag
    with torch.no_grad():
        same = torch.equal(engine(x)[0].float(), want)
    handle.uninstall()  # <- lazyckpt: back to DeepSpeed's engine (optional)

    say(f"step without checkpoint              {base:7.3f} s")
    say(f"stall per save_checkpoint, stock     {stock - base:+7.3f} s   (TorchCheckpointEngine, no fsync)")
    say(f"stall per save_checkpoint, lazyckpt  {lazy - base:+7.3f} s   (fsync, atomic tag folders)")
    say(f"newest tag loaded back equal to the state at its save: {same}")
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
