"""Accelerate: training stall per checkpoint with save_state every step, stock vs lazyckpt, in one run.

    python -m benchmarks.bench_accelerate                    # ~98M-param GPT, AdamW + scheduler, CPU
    python -m benchmarks.bench_accelerate --size small --steps 4 --rounds 1   # quick look

(from the repository root, with lazyckpt installed: ``pip install -e .[accelerate]``)

One process, one model, one optimizer, one scheduler (prepared once by one Accelerator), three phases
that run the same training steps:

* ``none``      no checkpoint
* ``stock``     ``accelerator.save_state()`` every step (stock Accelerate: synchronous, no fsync)
* ``lazyckpt``  the same call after ``lazyckpt.accelerate.install(accelerator)`` (fsync + atomic rename)
* ``lazyckpt-copy`` (only with ``--phases``): the same with ``LazyCheckpointer(zero_copy=False)``, which
  stages every tensor through a host copy instead of writing large ones straight from memory
* ``lazyckpt-nofsync`` (only with ``--phases``): ``LazyCheckpointer(fsync=False, direct_io=False)``, stock's
  durability (the page cache, no fsync; atomic renames kept): the same I/O as stock, off the training thread
* ``lazyckpt-mem`` (only with ``--phases``): ``install(accelerator, levels=[Level(<--mem-dir>/..., every=1,
  keep=2)])``: every step to a memory level (tmpfs), whose step folders' files are written over the pages of
  the folder retention dropped; ``lazyckpt-mem-noreuse``: the same with ``Level(reuse_pages=False)`` (every
  folder's files allocated anew, the dropped folder deleted)

All phases save with automatic checkpoint naming and ``total_limit=2`` (old folders deleted), into their
own project folder (the memory-level phases: ``<level>/step-<n>``, ``keep=2``).
The phases are interleaved ``--rounds`` times (none, stock, lazyckpt, none, ...) so
machine drift hits all of them. The first ``--warmup`` steps of every phase are not timed (lazyckpt's warm-up
saves are drained before the timed steps); lazyckpt uses one LazyCheckpointer for the whole run, so its host
buffers stay allocated as in a long run. After each phase ``os.sync()`` flushes dirty pages, so no phase's
writeback slows the next one (stock never fsyncs; lazyckpt has already); it is timed apart, and the last
column counts it: the stall of a checkpoint as durable as lazyckpt's.

step time of a phase in a round = (its timed steps + the time to drain lazyckpt's last pending save) / steps
(a step = batch, forward, backward, optimizer.step, scheduler.step, zero_grad, and save_state);
stall per checkpoint = median over rounds of (step time of the phase - step time of ``none``).
"timed steps only" = median step of the phase - median step of ``none``, without lazyckpt's final drain
(the drain-inclusive figure is pessimistic: it treats one save in ``--steps`` as not overlapped at all; in a
long run only the very last save is).
For lazyckpt that includes the time inside save_state, the wait at the next optimizer.step, the CPU the
background copy/write threads take from training, and the part of the writing that did not overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import accelerate
import torch

from . import gpt as _gpt
from ._accelerate_loop import prepared_gpt
from ._baselines import disk_write_s, floor_parts, storage_floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", help="tiny | small | 100m | 1b (benchmarks/gpt.py)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per phase and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of every phase")
    ap.add_argument("--rounds", type=int, default=4, help="times the three phases are repeated (interleaved)")
    ap.add_argument("--phases", default="none,stock,lazyckpt")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--mem-dir", default="/dev/shm", help="where the memory-level phases' levels go (tmpfs)")
    args = ap.parse_args()

    import lazyckpt.accelerate
    from lazyckpt import LazyCheckpointer, Level

    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_accelerate_"))
    root.mkdir(parents=True, exist_ok=True)

    loop = prepared_gpt(args.size, str(root / "none"))
    acc, model, opt, train_step = loop.acc, loop.model, loop.opt, loop.step
    nparams = _gpt.num_params(model)

    # one untimed step: optimizer state exists, so checkpoints have their full size from the start
    train_step()
    ckpt_bytes = _gpt.state_bytes(acc.unwrap_model(model).state_dict()) + _gpt.state_bytes(opt.state_dict())
    print(
        f"# size={args.size} params={nparams / 1e6:.1f}M checkpoint~{ckpt_bytes / 1e9:.2f} GB "
        f"torch_threads={torch.get_num_threads()} cpus={os.cpu_count()} dir={root}",
        flush=True,
    )

    # One checkpointer for the whole run, so its host buffers stay allocated between lazyckpt phases, as
    # in a long training run; install(checkpointer=...) / remove() around each phase leave it open.
    ckpt = LazyCheckpointer()
    ckpt_copy = LazyCheckpointer(zero_copy=False) if "lazyckpt-copy" in args.phases else None
    # stock's durability: through the page cache, no fsync (atomic renames kept): the same I/O as stock, off the step
    ckpt_nofsync = LazyCheckpointer(fsync=False, direct_io=False) if "lazyckpt-nofsync" in args.phases else None
    by_phase = {"lazyckpt": ckpt, "lazyckpt-copy": ckpt_copy, "lazyckpt-nofsync": ckpt_nofsync}
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    mem_root = Path(tempfile.mkdtemp(prefix="bench_accelerate_", dir=args.mem_dir))
    levels = {  # the memory-level phases: their own checkpointer each, open for the whole run
        p: [Level(str(mem_root / p), every=1, keep=2, reuse_pages=p == "lazyckpt-mem")]
        for p in ("lazyckpt-mem", "lazyckpt-mem-noreuse")
        if p in phases
    }
    for p in levels:
        by_phase[p] = LazyCheckpointer()
    times: dict[str, list[float]] = {p: [] for p in phases}
    blocked: dict[str, list[float]] = {p: [] for p in phases}
    # per round: (sum of the timed steps + the drain of lazyckpt's last pending save) / steps, so background
    # work that did not overlap training is counted too
    per_round: dict[str, list[float]] = {p: [] for p in phases}
    cpu_round: dict[str, list[float]] = {p: [] for p in phases}  # process CPU seconds (all threads) per step
    synced: dict[str, list[float]] = {p: [] for p in phases}  # seconds of the os.sync() after the phase
    for rnd in range(args.rounds):
        for phase in phases:
            folder = root / phase
            shutil.rmtree(folder, ignore_errors=True)
            acc.project_configuration.set_directories(str(folder))
            acc.project_configuration.iteration = 0
            acc.project_configuration.automatic_checkpoint_naming = phase not in levels  # levels name their own
            handle = None
            if phase in levels:
                shutil.rmtree(levels[phase][0].path, ignore_errors=True)
                handle = lazyckpt.accelerate.install(acc, checkpointer=by_phase[phase], levels=levels[phase])
            elif phase.startswith("lazyckpt"):
                handle = lazyckpt.accelerate.install(acc, checkpointer=by_phase[phase])
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    if handle is not None:
                        handle.wait()  # warm-up saves do not spill into the timed steps
                    cpu0 = time.process_time()
                t0 = time.perf_counter()
                train_step()
                tb = time.perf_counter()
                if phase != "none":
                    acc.save_state()
                t1 = time.perf_counter()
                if i >= args.warmup:
                    times[phase].append(t1 - t0)
                    blocked[phase].append(t1 - tb)
            t0 = time.perf_counter()
            if handle is not None:
                handle.wait()  # every save durable
            drain = time.perf_counter() - t0
            if handle is not None:
                handle.uninstall()
            t0 = time.perf_counter()
            os.sync()  # nothing of this phase spills into the next one (stock's page cache included)
            synced[phase].append(time.perf_counter() - t0)  # what stock leaves to the kernel to write
            per_round[phase].append((sum(times[phase][-args.steps :]) + drain) / args.steps)
            cpu_round[phase].append((time.process_time() - cpu0) / args.steps)
            print(
                f"round {rnd} {phase:16s} step {per_round[phase][-1]:.3f} s (final drain {drain:.2f} s), "
                f"cpu {cpu_round[phase][-1]:.2f} s/step",
                flush=True,
            )
    for c in by_phase.values():
        if c is not None:
            c.close()
    shutil.rmtree(mem_root, ignore_errors=True)

    rows = []
    for phase in phases:
        paired = [a - b for a, b in zip(per_round[phase], per_round.get("none", [0.0] * args.rounds), strict=True)]
        rows.append(
            {
                "phase": phase,
                "step_s": statistics.fmean(per_round[phase]),
                "stall_s": statistics.median(paired),  # median over rounds of (phase - none) in that round
                # the same from the timed steps only (the last save's unoverlapped drain not counted)
                "stall_steps_s": statistics.median(times[phase]) - statistics.median(times.get("none", [0.0])),
                "stall_rounds_s": paired,
                "save_state_call_s": statistics.median(blocked[phase]) if phase != "none" else 0.0,
                "cpu_s_per_step": statistics.fmean(cpu_round[phase]),
                # durable as lazyckpt's files are: the os.sync() after the phase counted too
                "stall_synced_s": statistics.median(
                    [
                        a + s / args.steps - b
                        for a, s, b in zip(
                            per_round[phase], synced[phase], per_round.get("none", [0.0] * args.rounds), strict=True
                        )
                    ]  # fmt: skip
                ),
                "n": len(times[phase]),
            }
        )
    stock = next((r for r in rows if r["phase"] == "stock"), None)
    print()
    print(
        "| phase | step (s) | stall per checkpoint (s) | stall vs stock | stall, timed steps only (s) | vs stock "
        "| inside save_state (s) | CPU per step (s) | stall, os.sync() after the phase counted (s) | vs stock |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = ratio2 = ratio3 = ""
        if stock and stock["stall_synced_s"] > 0 and r["phase"] != "none":
            ratio3 = f"{r['stall_synced_s'] / stock['stall_synced_s']:.2f}x"
        if stock and stock["stall_s"] > 0 and r["phase"] != "none":
            ratio = f"{r['stall_s'] / stock['stall_s']:.2f}x"
        if stock and stock["stall_steps_s"] > 0 and r["phase"] != "none":
            ratio2 = f"{r['stall_steps_s'] / stock['stall_steps_s']:.2f}x"
        print(
            f"| {r['phase']} | {r['step_s']:.3f} | {r['stall_s']:+.3f} | {ratio} "
            f"| {r['stall_steps_s']:+.3f} | {ratio2} | {r['save_state_call_s']:.3f} | {r['cpu_s_per_step']:.2f} "
            f"| {r['stall_synced_s']:+.3f} | {ratio3} |"
        )
    print(
        "stall per round (s): "
        + "; ".join(
            f"{r['phase']}: " + ", ".join(f"{x:+.2f}" for x in r["stall_rounds_s"])
            for r in rows
            if r["phase"] != "none"
        )
    )
    # The disk's own speed for the bytes one save_state writes with lazyckpt (its files are fsynced), in the
    # same folder: a stall at the storage floor is a disk limit, not an engine cost.
    lazy_rows = [r for r in rows if r["phase"] == "lazyckpt"]
    if lazy_rows and "none" in per_round:
        disk = disk_write_s(root, ckpt_bytes)
        step = statistics.median(per_round["none"])
        one_time, per_ckpt = floor_parts(disk["s"], step, args.steps)
        floor = storage_floor(disk["s"], step, args.steps)
        print(
            f"disk ({disk['filesystem']}): write + fsync of one checkpoint's {ckpt_bytes / 1e9:.2f} GB "
            f"{disk['s']:.2f} s ({disk['gbps']:.2f} GB/s); storage floor with {args.steps} checkpoints "
            f"and a {step:.2f} s step: "
            f"{floor:.3f} s per checkpoint ({one_time / args.steps:.3f} one-time drain + {per_ckpt:.3f} per "
            f"checkpoint); lazyckpt = floor {lazy_rows[0]['stall_s'] - floor:+.3f} s"
        )
        rows.append({"phase": "storage-floor", "disk": disk, "stall_s": floor})
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": "python -m benchmarks.bench_accelerate " + " ".join(sys.argv[1:]),
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "versions": {"torch": torch.__version__, "accelerate": accelerate.__version__},
                    "threads": torch.get_num_threads(),
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "size": args.size,
                    "params": nparams,
                    "checkpoint_bytes": ckpt_bytes,
                    "rows": rows,
                    "times": times,
                },
                indent=1,
            )
        )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
