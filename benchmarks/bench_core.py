"""Core benchmark: the cost of checkpointing {model, optim, step} at EVERY training step, side by side.

Run from the repository root (``lazyckpt bench ARGS`` runs the same when this folder is present)::

    python -m benchmarks.bench_core --size 100m [--steps 8] [--rounds 3] [--out-dir DIR] [--json FILE] [--plot PNG]

Modes (same GPT model, same AdamW optimizer, same batches, interleaved in rounds whose order rotates):

  none        no checkpoint (the baseline)
  torch.save  synchronous torch.save to a temporary file + flush + fsync + atomic rename
  dcp         torch.distributed.checkpoint.async_save(no_dist=True) with a reused DefaultStager
  lazyckpt    LazyCheckpointer(fsync=True, crc=True): copies run during the next forward/backward

stall per checkpoint = (segment time of the mode - segment time of "none") / checkpoints, median
over rounds. The table compares every mode with every peer, and write speeds with a raw
sequential write (+fsync) of the same bytes. ``--plot`` draws where the time of each step goes.
Peers this torch lacks are skipped with a note.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lazyckpt.cli._format import GB, fmt, human_bytes, table

from ._baselines import floor_parts, storage_floor
from ._progress import ProgressBar
from ._run import DEFAULT_MODES, MODES, Bench, BenchOptions, add_json_argument, add_loop_arguments, cli, emit_json


def main(argv: list[str] | None = None) -> int:
    return cli("python -m benchmarks.bench_core", __doc__, add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_loop_arguments(p, MODES, DEFAULT_MODES)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out-dir", default=None, help="where checkpoints go (default: a fresh temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    add_json_argument(p)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw a timeline per mode (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    opts = options_from(args)
    problem = _precheck(args, opts)
    if problem:
        print(f"bench_core: {problem}", file=sys.stderr)
        return 1
    bench = Bench(opts, lambda done, what: None)
    bar = ProgressBar(bench.total_units, enabled=not args.no_progress)
    bench.progress = bar.update
    try:
        doc = bench.run()
    finally:
        bar.close()
    if args.plot:
        from ._plot import plot_timelines

        plot_timelines(doc, args.plot)
    if emit_json(doc, args.json):
        return 0
    print_report(doc)
    if args.plot:
        print(f"timeline: {args.plot}")
    return 0


def options_from(args: argparse.Namespace) -> BenchOptions:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return BenchOptions(size=args.size, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                        batch_size=args.batch_size, modes=modes, writer_threads=args.writer_threads,
                        device=args.device, out_dir=args.out_dir, keep=args.keep)  # fmt: skip


def _precheck(args: argparse.Namespace, opts: BenchOptions) -> str | None:
    """Reasons not to start at all (each with what to do), before minutes of measuring."""
    unknown = sorted(set(opts.modes) - set(MODES))
    if unknown:
        return f"unknown mode(s) {unknown}; choose from {','.join(MODES)}"
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return (
                "--device cuda: no CUDA GPU is visible to torch; run `lazyckpt doctor` to see why, or use --device cpu"
            )
    if args.plot:
        from ._plot import matplotlib_missing

        return matplotlib_missing()
    return None


# terminal output ----------------------------------------------------------------------------------


def print_report(doc: dict[str, Any]) -> None:
    cfg, summary, modes = doc["config"], doc["summary"], doc["modes"]
    model = f"{doc['params'] / 1e6:.1f}M params, {cfg['n_layer']} layers x {cfg['n_embd']}"
    print(f"checkpoint every step: {doc['options']['size']} GPT ({model}, {human_bytes(doc['ckpt_tensor_bytes'])} "
          f"of tensors) on {doc['facts']['device']}, {doc['facts']['torch_threads']} torch thread(s) on "
          f"{doc['facts']['cpus']} CPUs, {doc['steps']} checkpoints x {doc['rounds']} rounds, "
          "median over rounds")  # fmt: skip
    peers = [m for m in modes if m != "none"]
    headers = ["mode", "step s", "stall/ckpt s", "in save() s", "final drain s", "train CPU s", "runqueue s",
               "write GB/s", "of raw disk"]  # fmt: skip
    headers += [f"vs {p}" for p in peers]
    rows = []
    for m in modes:
        s = summary[m]
        ratios = [("" if p == m or m == "none" else _ratio(s["stall_s"], doc["ratios"][m].get(p))) for p in peers]
        vs_raw = "" if s["write_vs_raw"] is None else f"{s['write_vs_raw']:.0%}"
        rows.append([m, fmt(s["step_s"]), fmt(s["stall_s"], 3), fmt(s["save_call_s"], 3), fmt(s["drain_s"]),
                     fmt(s.get("train_cpu_s")), fmt(s.get("train_runqueue_s"), 3),
                     "" if m == "none" else fmt(s["write_gbps"]), vs_raw, *ratios])  # fmt: skip
    table(headers, rows)
    print()
    _print_throughput(doc)
    for mode, why in doc["skipped"].items():
        print(f"note: {mode} skipped: {why}")
    print("# stall/ckpt: extra time per checkpoint vs no checkpointing; vs X: this stall / X's stall (lower is "
          "better); train CPU s / runqueue s: per step, the training thread's CPU seconds and seconds it was "
          "runnable but waited for a CPU (/proc/thread-self/schedstat; saves included); write GB/s: bytes / time "
          "spent writing, during training; write-only: not a checkpointer, the same bytes written and fsynced "
          "in the background from an untouched buffer (the storage floor, measured in place)")  # fmt: skip


def _ratio(stall: float | None, x: float | None) -> str:
    if stall is not None and stall <= 0:
        return "~0"  # no measurable stall (within noise)
    return "n/a" if x is None else f"{x:.2f}x"


def _print_throughput(doc: dict[str, Any]) -> None:
    summary, raw = doc["summary"], doc["summary"]["raw_write_gbps"]
    print(f"raw disk: sequential write + fsync of one checkpoint's bytes: {fmt(raw)} GB/s "
          f"({doc['facts']['filesystem']})")  # fmt: skip
    lazy = summary.get("lazyckpt")
    if lazy and lazy.get("isolated_e2e_gbps") and raw:
        print(f"lazyckpt alone (nothing else running), save() -> durable: {lazy['isolated_e2e_gbps']:.2f} GB/s "
              f"= {lazy['isolated_e2e_gbps'] / raw:.0%} of raw disk")  # fmt: skip
    crc = doc.get("crc_gbps") or {}
    print(f"CRC32: zlib {fmt(crc.get('zlib'))} GB/s, ISA-L {fmt(crc.get('isal'))} GB/s; "
          f"lazyckpt uses {crc.get('lazyckpt_backend')}")  # fmt: skip
    d2h = doc.get("d2h")
    if d2h:
        print(f"device-to-host: raw pinned copy {d2h['raw_pinned']['gbps']:.1f} GB/s")
    pressure = doc["facts"].get("cpu_pressure")
    if pressure is not None and pressure > 0.2:
        print(f"warning: some task waited for a CPU {pressure:.0%} of the time: a busy machine, noisy numbers")
    step = doc["summary"]["none"]["step_s"]
    if step and raw:
        disk = doc["raw_write"][0]["bytes"] / (raw * GB)
        drain, per_ckpt = floor_parts(disk, step, doc["steps"])
        floor = storage_floor(disk, step, doc["steps"])
        print(f"storage floor: the disk writes+fsyncs one checkpoint in {disk:.2f} s, a step takes {step:.2f} s; "
              f"with {doc['steps']} checkpoints and the final drain counted, any checkpointer stalls >= "
              f"{floor:.3f} s per checkpoint ({drain / doc['steps']:.3f} s: the last write, once per run; "
              f"{per_ckpt:.3f} s: disk time a step cannot hide)")  # fmt: skip
        lazy = summary.get("lazyckpt")
        if lazy and lazy.get("stall_s") is not None:
            print(
                f"lazyckpt's stall {lazy['stall_s']:.3f} s = floor + {lazy['stall_s'] - floor:.3f} s of engine cost "
                "and of what the write itself takes from training here (the write-only mode measures that)"
            )
        wo = summary.get("write-only")
        if wo and wo.get("stall_s") is not None:
            print(f"write-only (the disk's write in the background, nothing else) stalls {wo['stall_s']:.3f} s = "
                  f"floor + {wo['stall_s'] - floor:.3f} s: what writing itself takes from training here")  # fmt: skip
            if lazy and lazy.get("stall_s") is not None:
                print(f"lazyckpt's stall = write-only's + {lazy['stall_s'] - wo['stall_s']:.3f} s of engine cost")


if __name__ == "__main__":
    sys.exit(main())
