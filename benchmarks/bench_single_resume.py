#!/usr/bin/env python
"""Resume of a lost node from another node's memory when ONE rank writes (DDP; issue 37 items 6 and 8):
``LazyCheckpointer(levels=[Level(<mem>/node<r>, replicas=1), Level(<disk>)])`` built on every rank,
global rank 0 saving. 2 gloo processes stand for 2 nodes (one rank each, separate memory folders).

Setup (one launch): both ranks build the GPT (``--size``) and AdamW and train one step; rank 0 saves
``{model, optim, step}`` at step 1 to both levels; node 1's first rank receives its copy.

Cases, each in fresh processes (``torch.multiprocessing`` spawn), the page cache dropped before
timing (root only; else said), timed on rank 0 (node 0, the node that lost its memory where a
case says so) from after its model is built: ``lazyckpt.latest(levels)`` (collective; restoring
node 0's folder from node 1 where it is empty) + ``lazyckpt.load`` + ``load_state_dict`` (model,
AdamW), then 4 training steps; the cost counts to the end of the first step less the median of the
others ("to step", as ``benchmarks/_resume.py``). Node 1 takes its part in ``latest()`` (its check
of its own newest file; in ``replica``, sending the copy) and then waits: on its own host it would
load too, here it would take node 0's cores. Both "nodes" share this machine's cores, so node 1's
part of ``latest()`` still competes with node 0's.

- ``memory``: nothing lost, each node from its own memory;
- ``replica``: node 0's memory emptied (a replaced node): node 1 sends step 1 back, then node 0 reads it;
- ``disk``: both memories emptied: the disk level;
- ``torch.load disk``: one process, stock ``torch.load`` of the disk level's file (``_resume.py``).

Usage: python -m benchmarks.bench_single_resume [--size 100m] [--rounds 2] [--mem DIR] [--disk DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import _resume
from benchmarks import gpt as _gpt

STEPS_AFTER = 4


def _levels(mem: str, disk: str, rank: int) -> list[Any]:
    from lazyckpt import Level

    return [Level(os.path.join(mem, f"node{rank}"), every=1, keep=2, replicas=1), Level(disk, every=1, keep=2)]


def _init(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))  # fmt: skip


def _setup(rank: int, port: int, size: str, mem: str, disk: str) -> None:
    from lazyckpt import LazyCheckpointer

    torch.set_num_threads(1)
    _init(rank, port)
    cfg = _gpt.config_for(size)
    model = _gpt.build(cfg, seed=0)
    opt = _gpt.make_optimizer(model)
    _gpt.train_step(model, opt, _gpt.BatchStream(cfg, seed=0).next())
    with LazyCheckpointer(levels=_levels(mem, disk, rank), fsync=True) as ck:
        if rank == 0:
            ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, step=1).wait()
            ck.wait()
        dist.barrier()
    dist.destroy_process_group()


def _case(rank: int, port: int, size: str, mem: str, disk: str, out: Any) -> None:
    import lazyckpt

    torch.set_num_threads(1)
    _init(rank, port)
    cfg = _gpt.config_for(size)
    model = _gpt.build(cfg, seed=1)
    opt = _gpt.make_optimizer(model)
    batches = _gpt.BatchStream(cfg, seed=0)
    dist.barrier()
    dropped = _resume.drop_page_cache() if rank == 0 else False
    dist.barrier()
    t0 = time.perf_counter()
    found = lazyckpt.latest(_levels(mem, disk, rank))
    t_latest = time.perf_counter()
    assert found is not None
    if rank != 0:  # node 1 took its part in the collective (and sent the copy); on its own host it would
        dist.barrier()  # load too, here it would take node 0's cores: it waits
        dist.destroy_process_group()
        return
    state = lazyckpt.load(found)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    del state
    t_loaded = time.perf_counter()
    steps = []
    for _ in range(STEPS_AFTER):
        t = time.perf_counter()
        _gpt.train_step(model, opt, batches.next())
        steps.append(time.perf_counter() - t)
    extra = steps[0] - statistics.median(steps[1:])
    out.put({"latest_s": t_latest - t0, "resume_s": t_loaded - t0, "first_step_extra_s": extra,
             "to_step_s": t_loaded - t0 + extra, "level": found.level, "dropped": dropped})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, *args: Any) -> None:
    mp.start_processes(fn, args=(_free_port(), *args), nprocs=2, start_method="spawn", join=True)


def _empty(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="100m")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mem", default=None, help="the memory folders' parent (default: one in /dev/shm)")
    p.add_argument("--disk", default=None, help="the disk level (default: a temporary folder here)")
    args = p.parse_args(argv)
    mem = args.mem or tempfile.mkdtemp(prefix="lazyckpt-single-", dir="/dev/shm")
    disk_root = args.disk or tempfile.mkdtemp(prefix="lazyckpt-single-disk-", dir=os.getcwd())
    disk = os.path.join(disk_root, "disk")
    keep = {}
    try:
        _spawn(_setup, args.size, mem, disk)
        node0, node1 = os.path.join(mem, "node0"), os.path.join(mem, "node1")
        for node in (node0, node1):  # what each node holds after the job, to put back before each case
            keep[node] = os.path.join(mem, f"kept-{os.path.basename(node)}")
            shutil.copytree(node, keep[node])
        disk_file = os.path.join(disk, "step-00000001.pt")
        wiped = {"memory": (), "replica": (node0,), "disk": (node0, node1)}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in [*wiped, "torch.load disk"]}
        ctx = mp.get_context("spawn")
        for r in range(args.rounds):
            for name, lost in wiped.items():
                for node in (node0, node1):
                    _empty(node)
                    if node not in lost:
                        shutil.rmtree(node)
                        shutil.copytree(keep[node], node)
                queue = ctx.Queue()
                mp.start_processes(_case, args=(_free_port(), args.size, mem, disk, queue), nprocs=2,
                                   start_method="spawn", join=True)  # fmt: skip
                results[name].append(queue.get(timeout=10))
            case = _resume.Case("torch.load disk", "torch.load", path=disk_file)
            run = _resume._child(args.size, 1, case, True)
            results["torch.load disk"].append({**run, "to_step_s": run["resume_s"] + run["first_step_extra_s"]})
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        base = statistics.median(x["to_step_s"] for x in results["torch.load disk"])
        nbytes = os.path.getsize(disk_file)
        dropped = all(x.get("dropped", x.get("page_cache_dropped")) for v in results.values() for x in v)
        print(f"one writer, 2 processes as 2 nodes, {args.size} GPT + AdamW, {nbytes / 1e9:.2f} GB per checkpoint; "
              f"rank 0 (node 0) timed from after its model is built; medians of {args.rounds} rounds; "
              f"page cache dropped: {dropped}")  # fmt: skip
        print(f"{'case':18s} {'level':>5s} {'latest s':>9s} {'resume s':>9s} {'1st step extra s':>17s} "
              f"{'to step s':>10s} {'vs torch.load disk':>19s}")  # fmt: skip
        for name, rs in results.items():
            med = {k: statistics.median(x[k] for x in rs) for k in ("resume_s", "first_step_extra_s", "to_step_s")}
            lat = statistics.median(x.get("latest_s", 0.0) for x in rs)
            level = rs[0].get("level", "")
            print(f"{name:18s} {level!s:>5s} {lat:9.3f} {med['resume_s']:9.3f} {med['first_step_extra_s']:17.3f} "
                  f"{med['to_step_s']:10.3f} {base / med['to_step_s']:18.2f}x")  # fmt: skip
    finally:
        shutil.rmtree(mem, ignore_errors=True)
        if args.disk is None:
            shutil.rmtree(disk_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
