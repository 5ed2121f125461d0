"""Paired blocks in one process: the spare-core stall of each saver against no checkpoint, with
the machine's drift cancelled.

    python -m benchmarks.bench_paired --size 100m --threads 1 --rounds 6       # ~17 min

``bench_levels`` runs each mode as one segment of 20+ steps with its own model; on this project's
2-vCPU VM a no-checkpoint step drifts by 0.07-0.19 s between its rounds (runs O and P,
docs/benchmarks.md), more than the 0.05 s that issue 22's "<= 0.2x DCP" leaves. Here ONE model and
optimizer train throughout, and the modes take turns in short blocks (``--block`` steps, the first
two of each not counted: the switch), the order reversed every other round; each round's stall of a
mode is its block's mean step minus the same round's no-checkpoint block's. Reported: per round and
their median, and each saver's ratio to DCP's; beside it the same from each block's median step.
Every block ends by draining its saver (not counted).

The mean, not the median, is the stall: the disk level's copy comes once every 10 steps, and a
block's median step leaves that step out (runs S and T, docs/benchmarks.md, used the median). The
default block, 12 steps (10 counted), holds exactly one step due at the disk level in its counted
steps whatever the block's position.

Modes: ``none``; ``dcp`` (``async_save`` to disk, ``benchmarks._modes.DCPAsync``); ``lazy-mem``
(``Level(/dev/shm/.., every=1, keep=2)``); ``lazy-mem+disk`` (plus ``Level(disk, every=10, keep=2)``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import gpt as _gpt
from ._modes import DCPAsync, Mode
from ._run import cli, thread_sched
from .bench_levels import Levels

MODES = ("none", "dcp", "lazy-mem", "lazy-mem+disk")


def main(argv: list[str] | None = None) -> int:
    return cli("bench_paired", __doc__, add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="100m", help="tiny | small | 100m (benchmarks/gpt.py)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a core to spare)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=12, help="steps per block; the first 2 are not counted")
    p.add_argument("--modes", default=",".join(MODES), help=f"from {','.join(MODES)}; none is always run")
    p.add_argument("--dir", default=None, help="disk folder (default: a temporary one in the current folder)")
    p.add_argument("--memory-dir", default="/dev/shm", help="where the memory level's folder goes")


def _runqueue_s() -> float:
    """This thread's time waiting for a core so far (``_run.thread_sched``); 0 where the kernel has none."""
    sched = thread_sched()
    return sched[1] if sched is not None else 0.0


def run(args: argparse.Namespace) -> int:
    modes = ["none", *(m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "none")]
    if unknown := sorted(set(modes) - set(MODES)):
        print(f"bench_paired: unknown mode(s) {unknown}; choose from {','.join(MODES)}")
        return 1
    if args.block < 3:
        print("bench_paired: --block must be >= 3 (the first 2 steps of a block are not counted)")
        return 1
    from lazyckpt import Level

    torch.set_num_threads(args.threads)
    cfg = _gpt.config_for(args.size)
    model, batches = _gpt.build(cfg, seed=0), _gpt.BatchStream(cfg, seed=0)
    opt = _gpt.make_optimizer(model)
    _gpt.train_step(model, opt, batches.next())
    nbytes = _gpt.state_bytes({"model": model.state_dict(), "optim": opt.state_dict()})
    disk = Path(tempfile.mkdtemp(prefix="bench_paired-", dir=args.dir or "."))
    memory = Path(tempfile.mkdtemp(prefix="bench_paired-", dir=args.memory_dir))
    savers: dict[str, Mode | None] = {"none": None}
    try:
        for name in list(modes[1:]):
            if name == "dcp":
                (disk / "dcp").mkdir()
                try:
                    savers[name] = DCPAsync(disk / "dcp", torch.device("cpu"))
                except ImportError as exc:  # torch < 2.9: no DefaultStager
                    print(f"note: dcp skipped: torch {torch.__version__} has no DCP async_save stager ({exc})")
                    modes.remove(name)
            else:
                levels = [Level(str(memory / name), every=1, keep=2)]
                if name == "lazy-mem+disk":
                    levels.append(Level(str(disk / name), every=10, keep=2))
                savers[name] = Levels(name, disk, levels, opt, 4)

        def block(name: str, steps: int) -> tuple[float, float, float]:
            saver = savers[name]
            times, waits = [], []
            for _ in range(steps):
                q0, t0 = _runqueue_s(), time.perf_counter()
                _gpt.train_step(model, opt, batches.next(), before_step=saver.before_step if saver else None)
                if saver is not None:
                    saver.save({"model": model.state_dict(), "optim": opt.state_dict()}, nbytes)
                times.append(time.perf_counter() - t0)
                waits.append(_runqueue_s() - q0)
            if saver is not None:
                saver.drain()
            return statistics.mean(times[2:]), statistics.median(times[2:]), statistics.mean(waits[2:])

        print(f"bench_paired: {args.size} GPT, {nbytes / 1e9:.2f} GB of state, {torch.get_num_threads()} torch "
              f"thread(s) on {os.cpu_count()} CPUs; {args.rounds} rounds of {args.block}-step blocks "
              f"({args.block - 2} counted)", flush=True)  # fmt: skip
        for name in modes[1:]:  # warm-up: new tmpfs files, DCP's buffers
            block(name, 4)
        steps: dict[str, list[float]] = {m: [] for m in modes}
        medians: dict[str, list[float]] = {m: [] for m in modes}
        rq: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for name in modes if r % 2 == 0 else modes[::-1]:
                s, md, q = block(name, args.block)
                steps[name].append(s)
                medians[name].append(md)
                rq[name].append(q)
                print(f"  round {r + 1}: {name:<14} step {s:.3f} s (median {md:.3f})  run-queue wait {q:.4f} s/step",
                      flush=True)  # fmt: skip
        _report(modes, steps, rq, medians)
    finally:
        for saver in savers.values():
            if saver is not None:
                saver.close()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    return 0


def _report(
    modes: list[str], steps: dict[str, list[float]], rq: dict[str, list[float]], medians: dict[str, list[float]]
) -> dict[str, Any]:
    def stalls(per_block: dict[str, list[float]]) -> dict[str, list[float]]:
        return {m: [a - b for a, b in zip(per_block[m], per_block["none"], strict=True)] for m in modes}

    stall, by_median = stalls(steps), stalls(medians)
    med = {m: statistics.median(v) for m, v in stall.items()}
    med_of_medians = {m: statistics.median(v) for m, v in by_median.items()}

    def ratio(m: str, of: dict[str, float]) -> str:
        return f"{of[m] / of['dcp']:.3f}x" if "dcp" in of and of["dcp"] > 0 and m != "none" else ""

    print(f"{'mode':<15} {'step s':>6}  {'stall/step s (median of rounds)':>31}  {'per round':<31} "
          f"{'run-queue s/step':>16}  {'vs dcp':>7}  {'from medians':>12}  {'vs dcp':>7}")  # fmt: skip
    for m in modes:
        rounds = " ".join(f"{x:+.3f}" for x in stall[m])
        print(f"{m:<15} {statistics.median(steps[m]):6.3f}  {med[m]:+31.3f}  {rounds:<31} "
              f"{statistics.mean(rq[m]):16.4f}  {ratio(m, med):>7}  {med_of_medians[m]:+12.3f}  "
              f"{ratio(m, med_of_medians):>7}")  # fmt: skip
    print(
        "# stall/step: each round's block mean (the counted steps) minus the same round's no-checkpoint block's; "
        "from medians: the same from each block's median step (leaves out a step due every 10); drains not counted"
    )
    return {"stall": stall, "median": med, "from_medians": med_of_medians}


if __name__ == "__main__":
    raise SystemExit(main())
