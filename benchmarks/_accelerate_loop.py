"""The Accelerate training loop of the benchmarks (``bench_accelerate``, ``profile_stall --loop
accelerate``): the repository's GPT with AdamW and a warm-up scheduler, prepared by one CPU Accelerator
that saves with automatic checkpoint naming and ``total_limit=2`` (old folders deleted), as stock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import gpt as _gpt


@dataclass
class AccelerateLoop:
    acc: Any  # accelerate.Accelerator
    model: torch.nn.Module  # prepared
    opt: Any  # prepared (AcceleratedOptimizer)
    step: Callable[[], None]  # batch, forward, backward, optimizer.step, scheduler.step, zero_grad


def prepared_gpt(size: str, project_dir: str) -> AccelerateLoop:
    """The GPT of ``size`` (benchmarks/gpt.py) prepared by an Accelerator saving into ``project_dir``."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cfg = _gpt.config_for(size)
    project = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=project)
    model = _gpt.build(cfg, seed=0)
    opt = _gpt.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    model, opt, sched = acc.prepare(model, opt, sched)
    batches = _gpt.BatchStream(cfg, seed=0)

    def step() -> None:
        x, y = batches.next()
        _, loss = model(x, y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return AccelerateLoop(acc, model, opt, step)
