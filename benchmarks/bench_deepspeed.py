"""DeepSpeed: training stall per checkpoint, lazyckpt vs DeepSpeed's own engines, side by side in one run.

    python -m benchmarks.bench_deepspeed                                 # GPT 100m, ZeRO-2 and 3, 2 processes
    python -m benchmarks.bench_deepspeed --size small --stages 2 --steps 4   # quick look
    python -m benchmarks.bench_deepspeed --json benchmarks/results/deepspeed.json

(from the repository root, with ``pip install -e .[deepspeed]``; CPU: ``DS_ACCELERATOR=cpu``, gloo; ``--device cuda``:
nccl, bf16, one rank per GPU, for a GPU machine: ``scripts/gpu-check.sh`` runs it)

Each run starts 2 rank processes that train the repository's GPT (``benchmarks/gpt.py``) under ZeRO
``stage`` with a checkpoint every step (``engine.save_checkpoint``) into a fresh folder, for each mode:

* ``none``        no checkpoint (the step time the others are measured against)
* ``torch``       DeepSpeed's default ``TorchCheckpointEngine`` (synchronous ``torch.save``, no fsync)
* ``decoupled``   DeepSpeed's ``DecoupledCheckpointEngine`` (``"checkpoint": {"writer": {"type": W,
  "decoupled": true}}``: a writer process per rank; commit at the next step waits for its write)
* ``fast``        DeepSpeed's ``FastCheckpointEngine`` (``"writer": {"type": W}``; synchronous)
* ``datastates``  DeepSpeed's ``DataStatesCheckpointEngine`` (``--modes ... datastates``; needs the ``datastates``
  package and CUDA)
* ``lazy``        ``lazyckpt.deepspeed.install(engine)`` (fsync, atomic tag folders, ``latest`` after)

``W`` is ``--writer`` (``python``: DeepSpeed's buffered Python writer; ``fast`` needs the async_io op built).
Stall per checkpoint = median step interval (step + its save_checkpoint) - median step interval of the same
processes' ``steps`` steps without a checkpoint just before (``none``: the noise of that difference); the final
drain (lazy: ``wait()``; decoupled: ``destroy()``) is reported apart. Blocked per checkpoint = rank 0's time in
``save_checkpoint`` plus in the engine's ``commit`` inside the next ``step()`` (a decoupled engine's wait), median:
the training thread's wait itself, without the step's noise, but also without the slowdown background work
causes in training on shared cores (which the stall includes). Regimes:
``--threads 1`` (one torch thread per rank) and the default threads (``--threads 0``: torch's choice). The
disk's floor: the time to write and fsync one checkpoint's bytes (the ``torch`` mode's folder) sequentially.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._baselines import disk_write_s
from benchmarks._run import add_json_argument, emit_json

MODES = ("none", "torch", "decoupled", "fast", "datastates", "lazy")
DEFAULT_MODES = ("none", "torch", "decoupled", "fast", "lazy")
ROOT = Path(__file__).resolve().parent.parent


def _rank_main() -> None:
    """One rank (argv: rank world port json-config): trains, saves every step, writes its timings."""
    rank, world, port, cfg = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), CROSS_RANK="0", CROSS_SIZE="1")  # fmt: skip
    cuda = cfg["device"] == "cuda"
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    import deepspeed

    from benchmarks import gpt

    mode = cfg["mode"]
    model_cfg = gpt.config_for(cfg["size"])
    model = gpt.build(model_cfg, seed=0)
    ds = {
        "train_micro_batch_size_per_gpu": model_cfg.batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
        "zero_optimization": {"stage": cfg["stage"]},
        "steps_per_print": 10**9,
        "bf16": {"enabled": cuda},
    }
    if mode == "datastates":  # DeepSpeed falls back to its torch engine without the package: refused below
        ds["datastates_ckpt"] = {"host_cache_size": 16}
    if mode in ("decoupled", "fast"):
        # data_parallel set: without it DeepSpeed 0.19.8 fails here with no mpu (UniversalParallelInfo.dp_rank)
        ds["checkpoint"] = {
            "writer": {"type": cfg["writer"], "decoupled": mode == "decoupled", "data_parallel": "replica"}
        }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    if mode == "datastates" and type(engine.checkpoint_engine).__name__ != "DataStatesCheckpointEngine":
        raise RuntimeError("DataStatesCheckpointEngine unavailable (pip install datastates)")
    handle = None
    if mode == "lazy":
        import lazyckpt.deepspeed

        handle = lazyckpt.deepspeed.install(engine)
    batches = gpt.BatchStream(model_cfg, seed=rank)
    out = cfg["out"]
    # the time the training thread spends in the checkpoint engine's calls: save_checkpoint, and the commit
    # DeepSpeed calls inside step() (a decoupled engine's wait); a synchronous engine commits inside the save
    ce, saving, in_commit = engine.checkpoint_engine, [False], [0.0]
    real_commit = ce.commit

    def commit(info: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_commit(info)
        finally:
            if not saving[0]:
                in_commit[0] += time.perf_counter() - t

    ce.commit = commit
    blocked: list[float] = []

    def step(save: bool) -> float:
        t = time.perf_counter()
        in_commit[0] = 0.0
        x, y = batches.next()
        if cuda:
            x, y = x.cuda(), y.cuda()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if save:
            saving[0], ts = True, time.perf_counter()
            engine.save_checkpoint(out)
            saving[0] = False
            if cuda:
                torch.cuda.synchronize()
            blocked.append(in_commit[0] + time.perf_counter() - ts)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(cfg["warmup"]):
        step(False)
    baseline = [step(False) for _ in range(cfg["steps"])]  # this process's own step time, no checkpoint
    intervals = [step(mode != "none") for _ in range(cfg["steps"])]
    t = time.perf_counter()
    if handle is not None:
        handle.wait()
    engine.destroy()
    dist.barrier()
    drain = time.perf_counter() - t
    with open(os.path.join(cfg["results"], f"rank{rank}.json"), "w") as fh:
        json.dump({"intervals": intervals, "baseline": baseline, "drain": drain, "blocked": blocked}, fh)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """2 ranks of one mode; rank 0's timings (the ranks step together) and the folder's bytes."""
    results = tempfile.mkdtemp(prefix="lazyckpt-bench-ds-")
    cfg = dict(cfg, results=results)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    if cfg["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_deepspeed",
                "--rank-main",
                str(r),
                str(cfg["world"]),
                port,
                json.dumps(cfg),
            ],
            cwd=ROOT,
            env=env,
            start_new_session=True,  # its writer processes too are killed with it (a hung peer engine's)
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(cfg["world"])
    ]
    try:
        deadline = time.monotonic() + timeout
        try:
            outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"mode {cfg['mode']}: RuntimeError: no result within {timeout:.0f} s (hung)") from None
        for p, o in zip(procs, outputs, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"mode {cfg['mode']} failed (rc {p.returncode}):\n{o[-3000:]}")
        with open(os.path.join(results, "rank0.json")) as fh:
            got = json.load(fh)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(results, ignore_errors=True)
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            path.unlink(missing_ok=True)  # DeepSpeed's CPU all-reduce buffers, never unlinked by its ranks
    tag_bytes = 0
    folders = sorted(Path(cfg["out"]).glob("global_step*"))
    if folders:
        tag_bytes = sum(f.stat().st_size for f in folders[-1].rglob("*") if f.is_file())
    return {**got, "tag_bytes": tag_bytes}


def run(args: argparse.Namespace) -> int:
    base = Path(args.dir or tempfile.mkdtemp(prefix="lazyckpt-bench-ds-"))
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    floor: dict[str, Any] | None = None
    for threads in args.threads:
        for stage in args.stages:
            per_round: dict[str, list[float]] = {m: [] for m in args.modes}
            drains: dict[str, list[float]] = {m: [] for m in args.modes}
            blocked: dict[str, list[float]] = {m: [] for m in args.modes}
            tag_bytes = 0
            for _ in range(args.rounds):
                medians = {}
                for mode in args.modes:
                    out = base / f"t{threads}-z{stage}-{mode}"
                    shutil.rmtree(out, ignore_errors=True)
                    cfg = {"mode": mode, "stage": stage, "size": args.size, "steps": args.steps, "warmup": args.warmup,
                           "threads": threads, "writer": args.writer, "out": str(out), "device": args.device,
                           "world": args.world}  # fmt: skip
                    try:
                        got = _launch(cfg, args.timeout)
                    except RuntimeError as exc:  # a peer engine that does not run here: said in the table
                        lines = [ln for ln in str(exc).splitlines() if "Error" in ln and "[rank0]" in ln]
                        failed[mode] = (lines or str(exc).strip().splitlines())[-1].removeprefix("[rank0]: ")[:300]
                        shutil.rmtree(out, ignore_errors=True)
                        continue
                    medians[mode] = statistics.median(got["intervals"]) - statistics.median(got["baseline"])
                    drains[mode].append(got["drain"])
                    if got.get("blocked"):
                        blocked[mode].append(statistics.median(got["blocked"]))
                    if mode == "torch":
                        tag_bytes = got["tag_bytes"]
                    shutil.rmtree(out, ignore_errors=True)
                for mode in medians:
                    per_round[mode].append(medians[mode])
            if floor is None and tag_bytes:
                floor = disk_write_s(base, tag_bytes)
            stall = {m: statistics.median(v) for m, v in per_round.items() if v}
            held = {m: statistics.median(v) for m, v in blocked.items() if v}
            for mode in args.modes:
                if mode not in stall:
                    rows.append({"threads": threads or "default", "stage": stage, "mode": mode, "failed": failed[mode]})
                    continue
                rows.append({
                    "threads": threads or "default", "stage": stage, "mode": mode, "stall_s": stall[mode],
                    "x_torch": stall[mode] / stall["torch"] if stall.get("torch") else None,
                    "blocked_s": held.get(mode),
                    "blocked_x_torch": held[mode] / held["torch"] if mode in held and held.get("torch") else None,
                    "drain_s": statistics.median(drains[mode]), "rounds": per_round[mode], "tag_bytes": tag_bytes,
                })  # fmt: skip
    shutil.rmtree(base, ignore_errors=True)
    import deepspeed
    import torch

    doc = {
        "size": args.size, "steps": args.steps, "rounds": args.rounds, "writer": args.writer, "rows": rows,
        "device": args.device, "world": args.world,
        "disk_floor": floor,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
    }  # fmt: skip
    if emit_json(doc, args.json):
        return 0
    head = f"GPT {args.size}, {args.world} rank(s) on {args.device}, checkpoint every step"
    print(f"{head}, median of {args.rounds} round(s) of {args.steps} steps")
    if floor:
        print(f"disk floor: {floor['bytes'] / 1e9:.2f} GB written + fsynced in {floor['s']:.3f} s")
    print(
        f"{'threads':>8} {'ZeRO':>4} {'mode':>10} {'stall/ckpt s':>13} {'x torch':>8} {'blocked s':>10} "
        f"{'x torch':>8} {'drain s':>8}"
    )
    for r in rows:
        if "failed" in r:
            print(f"{r['threads']!s:>8} {r['stage']:>4} {r['mode']:>10}  does not run here: {r['failed']}")
            continue
        x = "" if r["x_torch"] is None else f"{r['x_torch']:.2f}"
        b = "" if r["blocked_s"] is None else f"{r['blocked_s']:.3f}"
        bx = "" if r["blocked_x_torch"] is None else f"{r['blocked_x_torch']:.2f}"
        print(
            f"{r['threads']!s:>8} {r['stage']:>4} {r['mode']:>10} {r['stall_s']:>13.3f} {x:>8} {b:>10} {bx:>8} "
            f"{r['drain_s']:>8.2f}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-main":
        _rank_main()
        return 0
    p = argparse.ArgumentParser(prog="bench_deepspeed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--size", default="100m", help="benchmarks/gpt.py size (default 100m)")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, the GPUs on CUDA)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="torch threads per rank (0: default)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--writer", default="python", help="DeepSpeed's writer type for decoupled/fast (python, fast)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode's run (a hung engine fails)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    add_json_argument(p)
    args = p.parse_args(argv)
    if args.world is None:
        import torch

        args.world = 2 if args.device == "cpu" else max(1, torch.cuda.device_count())
    if "none" not in args.modes:
        args.modes = ["none", *args.modes]
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
