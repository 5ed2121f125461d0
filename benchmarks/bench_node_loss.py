#!/usr/bin/env python
"""Node loss benchmark: a replicated memory level (``Level(replicas=1)``) vs the plain one, and a lost
node's restore from a peer's replica vs from the disk level, side by side in one run.

``--nproc`` gloo processes (default 4) stand for ``--nproc / --per-node`` nodes (default 2 ranks
each: separate memory folders ``<mem>/node<n>``). They train an FSDP2 GPT (``--size``) with AdamW
and save ``{model, optim, step}`` after every step with a ``DistributedCheckpointer`` whose levels
are a node memory level every step (keep 2) and a disk level every ``--steps`` steps:

- ``none``: no checkpoint (the baseline step time);
- ``memory``: the memory level with ``replicas=0``;
- ``memory+replica``: the same with ``replicas=1`` (each node's files also sent to the next node).

Modes run interleaved, ``--rounds`` times. The in-loop stall per step is a mode's time for the
steps (drain excluded: a user's run is long) minus the baseline's, over the steps; the drain
(what is still queued when the loop ends: the last commits, the last replications) is printed
apart. Bytes sent per step are this benchmark's rank 0's replicated bytes over the steps.

Restore (after the last round's ``memory+replica`` run, its last step also on disk): node 1's memory
is wiped (a replaced node), the page cache dropped (root only; else said), then on every rank, timed:
``lazyckpt.latest(levels)`` (which restores node 1's step from node 0's replica), stock ``dcp.load``
into a fresh model and optimizer, and one optimizer step; the slowest rank's time is the restore
time. Then the same with node 0's replicas wiped too: node 1 loads the disk level's copy.

Usage: python -m benchmarks.bench_node_loss [--nproc 4] [--per-node 2] [--size small] [--steps 6]
       [--rounds 2] [--threads 1] [--mem /dev/shm/...] [--disk DIR] [--json FILE]
On a 2-core machine, 4 training processes leave no core spare: the replica's cost is then taken
from training; the figures say so, and the regime where a core is spare needs a larger machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import bench_distributed, gpt
from benchmarks._resume import drop_page_cache

MODES = ["none", "memory", "memory+replica"]


def _model(size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """bench_distributed's FSDP2 GPT + AdamW."""
    return bench_distributed._model(argparse.Namespace(size=size, ddp=False), torch.device("cpu"))


def _levels(args: argparse.Namespace, rank: int, replicas: int, tag: str) -> list:
    from lazyckpt import Level

    node = rank // args.per_node
    return [
        Level(os.path.join(args.mem, tag, f"node{node}"), every=1, keep=2, replicas=replicas),
        Level(os.path.join(args.disk, tag), every=args.steps, keep=1),
    ]


def _run(args: argparse.Namespace, mode: str, rank: int, model, opt, batches, tag: str) -> dict[str, Any]:
    from lazyckpt.distributed import DistributedCheckpointer

    ckpt = None
    if mode != "none":
        ckpt = DistributedCheckpointer(levels=_levels(args, rank, int(mode.endswith("replica")), tag))
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        gpt.train_step(model, opt, next(batches))
        if ckpt is not None:
            ckpt.save(bench_distributed._state(model, opt, i), step=i)
    dist.barrier()
    loop = time.perf_counter() - t0
    sent = 0
    if ckpt is not None:
        ckpt.wait()
        stats = ckpt.replication
        sent = 0 if stats is None else stats.bytes_sent
        ckpt.close()
    dist.barrier()
    return {"loop_s": loop, "drain_s": time.perf_counter() - t0 - loop, "sent": sent}


def _restore(args: argparse.Namespace, rank: int, tag: str, size: str) -> dict[str, Any]:
    """latest() (+ the replica restore) + dcp.load + one optimizer step, timed on this rank."""
    import torch.distributed.checkpoint as dcp

    import lazyckpt

    model, opt = _model(size)
    batches = gpt.BatchStream(gpt.config_for(size), seed=rank + 100)
    gpt.train_step(model, opt, next(batches))  # the optimizer state exists, as in a fresh job's first
    dist.barrier()
    t0 = time.perf_counter()
    found = lazyckpt.latest(_levels(args, rank, 1, tag))
    t_latest = time.perf_counter() - t0
    assert found is not None
    state = bench_distributed._state(model, opt, -1)
    dcp.load(state, checkpoint_id=found.path)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    t_load = time.perf_counter() - t0
    gpt.train_step(model, opt, next(batches))
    total = time.perf_counter() - t0
    return {"step": found.step, "level": found.level, "latest_s": t_latest, "load_s": t_load, "total_s": total}


def _worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    model, opt = _model(args.size)
    batches = gpt.BatchStream(gpt.config_for(args.size), seed=rank)
    for _ in range(2):
        gpt.train_step(model, opt, next(batches))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            runs[mode].append(_run(args, mode, rank, model, opt, batches, f"r{r}-{mode}"))
    tag = f"r{args.rounds - 1}-memory+replica"
    restores: dict[str, Any] = {}
    node1 = os.path.join(args.mem, tag, "node1")
    for case in ("replica", "disk"):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(node1, ignore_errors=True)
            os.makedirs(node1)
            if case == "disk":
                shutil.rmtree(os.path.join(args.mem, tag, "node0", "replicas"), ignore_errors=True)
            restores["page_cache_dropped"] = drop_page_cache()
        dist.barrier()
        restores[case] = _restore(args, rank, tag, args.size)
    queue.put((rank, {"runs": runs, "restores": restores}))
    dist.barrier()
    dist.destroy_process_group()


def _summary(args: argparse.Namespace, per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    runs = per_rank[0]["runs"]
    base = statistics.median(x["loop_s"] for x in runs["none"])
    out: dict[str, Any] = {"nproc": args.nproc, "per_node": args.per_node, "size": args.size, "steps": args.steps,
                           "rounds": args.rounds, "threads": args.threads, "modes": {}}  # fmt: skip
    for mode in MODES:
        loop = statistics.median(x["loop_s"] for x in runs[mode])
        out["modes"][mode] = {
            "step_s": loop / args.steps,
            "stall_per_step_s": (loop - base) / args.steps,
            "drain_s": statistics.median(x["drain_s"] for x in runs[mode]),
            "sent_per_step_bytes": statistics.median(x["sent"] for x in runs[mode]) / args.steps,
        }
    for case in ("replica", "disk"):
        ranks = [per_rank[r]["restores"][case] for r in sorted(per_rank)]
        out[f"restore_{case}"] = {
            "step": ranks[0]["step"],
            "levels": [x["level"] for x in ranks],
            "slowest_total_s": max(x["total_s"] for x in ranks),
            "slowest_latest_s": max(x["latest_s"] for x in ranks),
            "slowest_load_s": max(x["load_s"] for x in ranks),
        }
    out["page_cache_dropped"] = per_rank[0]["restores"].get("page_cache_dropped")
    return out


def _print(s: dict[str, Any]) -> None:
    m = s["modes"]
    print(f"node loss: {s['nproc']} gloo processes as {s['nproc'] // s['per_node']} nodes, GPT {s['size']} FSDP2 + "
          f"AdamW, {s['steps']} steps x {s['rounds']} rounds, torch threads {s['threads'] or 'default'}")  # fmt: skip
    print(f"{'mode':<16}{'step s':>10}{'stall/step s':>14}{'drain s':>10}{'sent/step MB':>14}")
    for mode in MODES:
        x = m[mode]
        print(f"{mode:<16}{x['step_s']:>10.3f}{x['stall_per_step_s']:>14.3f}{x['drain_s']:>10.3f}"
              f"{x['sent_per_step_bytes'] / 1e6:>14.1f}")  # fmt: skip
    mem, rep = m["memory"]["stall_per_step_s"], m["memory+replica"]["stall_per_step_s"]
    if mem > 0:
        print(f"replica adds {100 * (rep - mem) / mem:+.0f}% to the memory level's in-loop stall per step")
    r, d = s["restore_replica"], s["restore_disk"]
    print(f"restore of the lost node (latest + dcp.load + 1 step, slowest rank; page cache "
          f"{'dropped' if s['page_cache_dropped'] else 'NOT dropped'}): from the replica {r['slowest_total_s']:.2f} s "
          f"(step {r['step']}, levels {r['levels']}; latest {r['slowest_latest_s']:.2f} s), from the disk level "
          f"{d['slowest_total_s']:.2f} s (step {d['step']}, levels {d['levels']}): "
          f"disk/replica {d['slowest_total_s'] / r['slowest_total_s']:.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--size", default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mem", default=None, help="memory folder base (default: a new /dev/shm folder)")
    p.add_argument("--disk", default=None, help="disk level base (default: a new folder under the cwd)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    made = []
    if args.mem is None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        args.mem = tempfile.mkdtemp(prefix="lazyckpt-bench-node-", dir=shm)
        made.append(args.mem)
    if args.disk is None:
        args.disk = tempfile.mkdtemp(prefix=".bench-node-disk-", dir=os.getcwd())
        made.append(args.disk)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(args, port, queue), nprocs=args.nproc, start_method="spawn")
        per_rank = dict(queue.get() for _ in range(args.nproc))
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    summary = _summary(args, per_rank)
    _print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
