#!/usr/bin/env python
"""Distributed benchmark: checkpoint sharded training state at EVERY step, several ways, in one run.

N processes (gloo, CPU; or one per GPU with --device cuda) train an FSDP2 GPT (``--size 100m``: about
100M parameters) with AdamW and save ``{model, optim, step}`` after every step with:

- ``none``: no checkpoint (the baseline step time);
- ``dcp``: ``torch.distributed.checkpoint.save`` (synchronous);
- ``dcp_async``: ``dcp.async_save`` with ``DefaultStager`` (``staging_completion`` waited for before
  the next optimizer step, the previous ``upload_completion`` before the next save);
- ``dcp_async_process``: the same with ``AsyncCheckpointerType.PROCESS`` (skipped if it fails);
- ``lazyckpt``: ``lazyckpt.distributed.DistributedCheckpointer``.

Modes run interleaved, ``--rounds`` times, so drift hits all of them. The stall per checkpoint is a
mode's time for ``--steps`` steps plus its final drain, minus the baseline's, divided by the steps.
The storage floor is the least stall any checkpointer pays with a checkpoint every step and the final
drain counted: the disk's write+fsync time for one checkpoint (measured here once) divided by the steps,
plus the part of it a step cannot hide. ``--ddp`` replicates the model instead of sharding it, and prints the bytes each
rank wrote (about 1/N each, thanks to DCP's deduplication).

Usage: python -m benchmarks.bench_distributed [--nproc 2] [--size 100m] [--steps 6] [--rounds 3]
       [--threads N] [--out-dir DIR] [--json FILE] [--ddp] [--modes none,dcp,dcp_async,lazyckpt]

Figures are medians over the rounds. Each mode also shows the CPU seconds per step, summed over the
ranks, of the training threads, of lazyckpt's threads and of the rest (torch's pool, gloo, DCP's
async thread): on a machine whose cores the training already fills, a background save's CPU time
is taken from training, and the stall can be no lower than that share.
Not for the shared 2-core development machine: run it where nothing else runs.
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
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import gpt

MODES = ["none", "dcp", "dcp_async", "dcp_async_process", "lazyckpt"]


def _model(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = gpt.build(args.size, device=device)
    if not args.ddp:
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    return model, gpt.make_optimizer(model)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


_ASYNC_GROUP: list[dist.ProcessGroup] = []


def _async_group() -> dist.ProcessGroup:
    """The gloo group torch's docs ask async_save to use: on the training's group, its background
    gather/scatter interleaves with FSDP's all-gathers and gloo aborts on the size mismatch."""
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


def _thread_cpu(own: dict[str, str] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by role: the training (main) thread,
    lazyckpt's threads, and the rest (torch's intra-op pool, gloo, DCP's async thread); ``own``:
    {thread name: role} for threads counted apart."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    own = own or {}
    out = {"train": 0.0, **dict.fromkeys(own.values(), 0.0), "lazyckpt": 0.0, "other": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        name = names.get(int(tid), "")
        role = (
            "train" if int(tid) == main else own.get(name) or ("lazyckpt" if name.startswith("lazyckpt") else "other")
        )
        out[role] += cpu
    return out


def _run_mode(mode: str, args: argparse.Namespace, model, opt, batches, out: Path) -> tuple[float, dict[str, float]]:
    """Seconds for ``args.steps`` steps with a checkpoint after each, final drain included, and the
    CPU seconds each role's threads spent meanwhile."""
    import torch.distributed.checkpoint as dcp

    ckpt = pending = staging = upload = None
    if mode == "lazyckpt":
        from lazyckpt.distributed import DistributedCheckpointer

        ckpt = DistributedCheckpointer()
    dist.barrier()
    cpu0 = _thread_cpu()
    t0 = time.perf_counter()
    for i in range(args.steps):
        gpt.train_step(model, opt, next(batches), before_step=None if staging is None else staging.result)
        path = str(out / f"{mode}-{i}")
        if mode == "dcp":
            dcp.save(_state(model, opt, i), checkpoint_id=path)
        elif mode.startswith("dcp_async"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if upload is not None:
                upload.result()
            kind = AsyncCheckpointerType.PROCESS if mode.endswith("process") else AsyncCheckpointerType.THREAD
            cuda = torch.cuda.is_available()
            stager = DefaultStager(StagingOptions(cuda, cuda, cuda, cuda))
            response = dcp.async_save(
                _state(model, opt, i), checkpoint_id=path, async_checkpointer_type=kind, async_stager=stager,
                process_group=_async_group(),  # its background collectives must not share the training's group
            )  # fmt: skip
            # Without CUDA, DefaultStager stages inside async_save and only the upload future comes back.
            staging = getattr(response, "staging_completion", None)
            upload = getattr(response, "upload_completion", response)
        elif mode == "lazyckpt":
            pending = ckpt.save(_state(model, opt, i), path)
    if upload is not None:
        upload.result()
    if pending is not None:
        ckpt.wait()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    cpu1 = _thread_cpu()
    if ckpt is not None:
        ckpt.close()
    return elapsed, {k: cpu1[k] - cpu0[k] for k in cpu0}


def _rank_bytes(out: Path, mode: str, steps: int) -> dict[str, int]:
    folder = out / f"{mode}-{steps - 1}"
    return {p.name: p.stat().st_size for p in sorted(folder.glob("__*.distcp"))}


def _global_bytes(obj) -> int:
    """Tensor bytes of a state dict; a DTensor counts its global size (every rank's shards)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_global_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_global_bytes(v) for v in obj)
    return 0


def _floor_gbps(out: Path, nbytes: int = 256 << 20) -> float:
    """Fsynced sequential write bandwidth of this filesystem."""
    path = out / "floor.bin"
    block = os.urandom(1 << 20) * 16
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(nbytes // len(block)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    gbps = nbytes / (time.perf_counter() - t) / 1e9
    path.unlink()
    return gbps


def _worker(rank: int, args: argparse.Namespace, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=args.nproc)
    model, opt = _model(args, device)
    batches = gpt.BatchStream(
        model.cfg if hasattr(model, "cfg") else gpt.config_for(args.size), seed=rank, device=device
    )
    _async_group()  # every rank creates it at the same point (new_group is collective)
    for _ in range(2):  # warm-up: optimizer state exists, the guard knows the optimizer
        gpt.train_step(model, opt, next(batches))
    times: dict[str, list[float]] = {m: [] for m in args.modes}
    cpus: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for _ in range(args.rounds):
        for mode in list(times):
            try:
                elapsed, cpu = _run_mode(mode, args, model, opt, batches, out)
                times[mode].append(elapsed)
                cpus[mode].append(cpu)
            except Exception as exc:  # e.g. the PROCESS checkpointer on a platform without it
                if rank == 0:
                    print(f"{mode}: skipped ({type(exc).__name__}: {exc})", flush=True)
                times.pop(mode)
            if rank == 0:
                if args.ddp and mode in ("dcp", "lazyckpt") and mode in times:
                    print(f"{mode}: bytes per rank file {_rank_bytes(out, mode, args.steps)}", flush=True)
                for path in out.glob("*-*"):
                    shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    gathered: list[Any] = [None] * args.nproc
    dist.all_gather_object(gathered, cpus)
    if rank == 0:
        _report(args, times, gathered, model, opt, out)
    dist.destroy_process_group()


def _report(args: argparse.Namespace, times: dict[str, list[float]], cpus: list[Any], model, opt, out: Path) -> None:
    """Medians over rounds. CPU: per checkpoint, summed over ranks, by thread role."""
    base = statistics.median(times.get("none", [0.0]))
    ckpt_bytes = _global_bytes(_state(model, opt, 0))
    gbps = _floor_gbps(out)
    disk = ckpt_bytes / (gbps * 1e9)  # the disk's own write+fsync time for one checkpoint
    n, step = args.steps, base / args.steps
    # The least stall per checkpoint any checkpointer pays with a checkpoint every step and the final
    # drain counted: the last write once per run, plus the disk time a step cannot hide (as bench_core).
    floor = disk / n + (n - 1) / n * max(0.0, disk - step)
    rows = {m: (statistics.median(ts) - base) / args.steps for m, ts in times.items() if m != "none"}
    cpu = {
        m: {k: statistics.median(sum(r[m][i][k] for r in cpus) for i in range(len(times[m]))) / args.steps
            for k in ("train", "lazyckpt", "other")}
        for m in times
    }  # fmt: skip
    regime = f"torch threads per rank: {torch.get_num_threads()}, cores: {os.cpu_count()}"
    kind = "DDP" if args.ddp else "FSDP2"
    print(f"{args.nproc} ranks, {args.size}, {kind}: {ckpt_bytes / 1e9:.2f} GB/checkpoint; {regime}")
    print(
        f"baseline {step:.3f} s/step; disk write+fsync {gbps:.2f} GB/s: {disk:.3f} s per checkpoint; storage floor "
        f"(that / {n} steps + the part a step cannot hide) {floor:.3f} s/checkpoint; medians of {args.rounds} rounds"
    )
    head = f"  {'mode':20s} {'stall s/ckpt':>12s} {'x dcp':>6s} {'x async':>7s}"
    print(f"{head}   CPU s/step (all ranks): train  lazyckpt  other")
    for mode in times:
        stall = rows.get(mode, 0.0)
        x_dcp, x_async = (f"{stall / rows[ref]:.2f}" if rows.get(ref) else "-" for ref in ("dcp", "dcp_async"))
        c = cpu[mode]
        print(
            f"  {mode:20s} {stall:12.3f} {x_dcp:>6s} {x_async:>7s}"
            f"   {c['train']:28.2f} {c['lazyckpt']:9.2f} {c['other']:6.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "times": times, "cpu": cpu, "stall_s": rows, "floor_s": floor, "disk_s": disk}
            )
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--size", default="100m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: torch's own)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ddp", action="store_true", help="replicate the model instead of sharding it")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-dist-"))
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port, out), nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
