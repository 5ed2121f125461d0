#!/usr/bin/env python
"""Core benchmark: the cost of checkpointing {model, optim, step} at EVERY training step, four ways, in one run.

Modes (same model, same optimizer, same batches, interleaved in rounds whose order rotates):

  none        no checkpoint (the baseline)
  torch.save  synchronous torch.save to a temporary file + flush + fsync + atomic rename (what most loops do)
  dcp         torch.distributed.checkpoint.async_save(no_dist=True) with a reused
              DefaultStager(StagingOptions(...)); waits on the previous upload before the next save (the
              staged buffers are reused), on staging_completion right before the next optimizer.step(), and
              on upload_completion at the end (FileSystemWriter fsyncs its files)
  lazyckpt    LazyCheckpointer(writer_threads=4, fsync=True, crc=True, on_backpressure="block"); the
              optimizer is tracked, so the copies run during the next forward/backward

Each segment = warm-up steps (checkpointing, not counted) + drain, then --steps counted steps, each followed by
a checkpoint, then the final drain (inside the timed window). Per round:

  stall per checkpoint = (segment time of the mode - segment time of "none") / checkpoints

and the table shows the median over rounds. The same run also measures a raw sequential write (+fsync) of as
many bytes as one lazyckpt checkpoint, an isolated lazyckpt save (nothing else running) and CRC32 throughput of
zlib vs ISA-L. With ``--device cuda`` it also compares lazyckpt's device-to-host staging throughput with a raw
copy of the same tensors into one pinned host buffer.

Usage:  python benchmarks/bench_core.py --size 100m [--steps 8] [--rounds 3] [--out-dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
if __package__:
    from . import _gpt  # python -m benchmarks.bench_core
else:
    sys.path.insert(0, str(_HERE))
    import _gpt  # noqa: E402  python benchmarks/bench_core.py

try:
    import lazyckpt  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(_HERE.parent / "src"))

GB = 1e9
MODES = ("none", "torch.save", "dcp", "lazyckpt")
# counted steps, rounds, warm-up steps per segment; sized so that the whole run stays under ~10 min here
DEFAULTS = {"tiny": (10, 3, 2), "small": (6, 4, 1), "100m": (5, 4, 1), "1b": (4, 2, 1)}


def log(*a):
    print(*a, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- checkpointers
class Mode:
    """One way of checkpointing. ``save`` after optimizer.step(); ``before_step`` right before the next one;
    ``drain`` waits until everything asked for is durable."""

    name = "?"

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.call_s: list[float] = []  # time spent inside the save call
        self.wait_s: list[float] = []  # time spent waiting elsewhere (before_step, previous upload)

    def reset_metrics(self):
        self.call_s, self.wait_s = [], []

    def save(self, state: dict, step: int) -> None:
        pass

    def before_step(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def metrics(self) -> dict:
        return {"save_call_s": median(self.call_s), "wait_s_total": sum(self.wait_s)}


class NoCheckpoint(Mode):
    name = "none"


class TorchSave(Mode):
    name = "torch.save"

    def __init__(self, out_dir: Path):
        super().__init__(out_dir)
        self.path = out_dir / "torchsave.pt"
        self.tmp = out_dir / "torchsave.pt.tmp"

    def save(self, state, step):
        t = time.perf_counter()
        with open(self.tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        fsync_dir(self.out_dir)
        self.call_s.append(time.perf_counter() - t)


class DCPAsync(Mode):
    name = "dcp"

    def __init__(self, out_dir: Path, device: torch.device):
        super().__init__(out_dir)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.dcp = dcp
        cuda = device.type == "cuda"
        self.options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        self.stager = DefaultStager(self.options)  # reused: its staged CPU storages are cached and reused
        self.dir = out_dir / "dcp"
        self.resp = None

    def save(self, state, step):
        t = time.perf_counter()
        if self.resp is not None:  # the stager's cached buffers are about to be overwritten
            self.resp.upload_completion.result()
        t1 = time.perf_counter()
        self.resp = self.dcp.async_save(state, checkpoint_id=str(self.dir), async_stager=self.stager, no_dist=True)
        t2 = time.perf_counter()
        self.wait_s.append(t1 - t)
        self.call_s.append(t2 - t1)

    def before_step(self):
        if self.resp is not None and not self.resp.staging_completion.done():
            t = time.perf_counter()
            self.resp.staging_completion.result()
            self.wait_s.append(time.perf_counter() - t)

    def drain(self):
        if self.resp is not None:
            self.resp.staging_completion.result()
            self.resp.upload_completion.result()
            self.resp = None

    def close(self):
        self.drain()
        self.stager.close()


class Lazy(Mode):
    name = "lazyckpt"

    def __init__(self, out_dir: Path, optimizer, writer_threads: int):
        super().__init__(out_dir)
        from lazyckpt import LazyCheckpointer

        self.ckpt = LazyCheckpointer(
            host_memory_budget=None,
            writer_threads=writer_threads,
            fsync=True,
            on_backpressure="block",
            crc=True,
            chunk_bytes=64 << 20,
        )
        self.ckpt.track(optimizer)
        self.path = out_dir / "lazy.pt"
        self.handles = []
        self.stats = []

    def reset_metrics(self):
        super().reset_metrics()
        self.handles, self.stats = [], []

    def save(self, state, step):
        t = time.perf_counter()
        self.handles.append(self.ckpt.save(state, self.path))
        self.call_s.append(time.perf_counter() - t)

    def drain(self):
        self.ckpt.wait()
        self.stats.extend(h.wait() for h in self.handles)
        self.handles = []

    def close(self):
        self.drain()
        self.ckpt.close()

    def metrics(self):
        m = super().metrics()
        fields = ("bytes", "blocked_s", "staged_s", "durable_s", "write_s", "write_gbps", "guard_wait_s")
        for f in fields:
            m[f] = median([getattr(s, f, None) for s in self.stats])
        m["guard_wait_s_total"] = sum(getattr(s, "guard_wait_s", 0.0) or 0.0 for s in self.stats)
        m["skipped"] = sum(bool(getattr(s, "skipped", False)) for s in self.stats)
        return m


# --------------------------------------------------------------------------------------------- raw baselines
def make_payload(nbytes: int) -> torch.Tensor:
    """A warm (touched) host buffer of incompressible bytes, allocated once. 4 KiB aligned, and 4 KiB longer
    than ``nbytes`` rounded up to 4 KiB, so that it can also be written with O_DIRECT."""
    n_al = -(-nbytes // 4096) * 4096
    raw = torch.empty(n_al + 4096, dtype=torch.uint8)
    off = -raw.data_ptr() % 4096
    buf = raw[off : off + n_al]
    gen = torch.Generator().manual_seed(1)
    block = torch.randint(0, 256, (min(n_al, 64 << 20),), dtype=torch.uint8, generator=gen)
    for o in range(0, n_al, block.numel()):
        n = min(block.numel(), n_al - o)
        buf[o : o + n].copy_(block[:n])
    return buf


def raw_write(payload: torch.Tensor, nbytes: int, path: Path, direct: bool = False, chunk: int = 64 << 20) -> dict:
    """Sequential write of ``nbytes`` of the payload with one thread (64 MiB writes), fsync file and directory.
    ``direct``: O_DIRECT (no page cache; the length is rounded up to 4 KiB). Returns seconds, GB/s, CPU seconds."""
    if direct:
        nbytes = -(-nbytes // 4096) * 4096
    mv = memoryview(payload.numpy()).cast("B")[:nbytes]
    t, c = time.perf_counter(), time.process_time()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    except (OSError, AttributeError):
        return {"bytes": nbytes, "s": None, "gbps": None, "cpu_s": None}  # no O_DIRECT on this filesystem
    try:
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, mv[off : off + chunk], off)
        os.fsync(fd)
    except OSError:
        if not direct:
            raise
        return {"bytes": nbytes, "s": None, "gbps": None, "cpu_s": None}
    finally:
        os.close(fd)
        fsync_dir(path.parent)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    os.unlink(path)
    return {"bytes": nbytes, "s": dt, "gbps": nbytes / dt / GB, "cpu_s": dc}


def crc_throughput(payload: torch.Tensor, nbytes: int = 256 << 20, reps: int = 3) -> dict:
    mv = memoryview(payload.numpy()).cast("B")[: min(nbytes, payload.numel())]
    out = {"bytes": len(mv)}
    impls = {"zlib": zlib.crc32}
    try:
        from isal import isal_zlib

        impls["isal"] = isal_zlib.crc32
    except ImportError:
        out["isal"] = None
    for name, fn in impls.items():
        times, ref = [], None
        for _ in range(reps):
            t = time.perf_counter()
            c = fn(mv)
            times.append(time.perf_counter() - t)
            assert ref is None or c == ref
            ref = c
        out[name] = len(mv) / min(times) / GB
    try:  # which implementation lazyckpt itself picked, if it says
        from lazyckpt import _crc

        out["lazyckpt_backend"] = str(getattr(_crc, "CRC_IMPL", "?"))
    except Exception:  # noqa: BLE001
        pass
    return out


def raw_d2h(tensors: list[torch.Tensor], reps: int = 3) -> dict:
    """Device-to-host copy of the same tensors into one pinned host buffer (allocated and pinned once,
    outside the timing), on a side stream, non_blocking. Best of ``reps`` after one warm-up."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append((host[off : off + n], t))
        off += n
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for dst, src in views:
                dst.copy_(src.detach().reshape(-1).view(torch.uint8), non_blocking=True)
        stream.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    del views, host
    return {"bytes": total, "s": min(times), "gbps": total / min(times) / GB}


# --------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="100m", choices=sorted(_gpt.SIZES))
    p.add_argument("--steps", type=int, default=None, help="counted steps (= checkpoints) per segment")
    p.add_argument("--rounds", type=int, default=None, help="repetitions of all modes (order rotates)")
    p.add_argument("--warmup", type=int, default=None, help="uncounted checkpointing steps per segment")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)} (none is always run)")
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out-dir", default=None, help="where checkpoints go (default: a fresh temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    p.add_argument("--json", default=None, help="also write all measurements to this file")
    args = p.parse_args(argv)

    steps, rounds, warmup = DEFAULTS[args.size]
    steps = args.steps or steps
    rounds = args.rounds or rounds
    warmup = warmup if args.warmup is None else args.warmup
    modes = [m for m in MODES if m == "none" or m in args.modes.split(",")]
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")

    if args.out_dir:
        out_dir = Path(args.out_dir).resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        made_dir = False
    else:
        out_dir = Path(tempfile.mkdtemp(prefix="lazyckpt-bench-"))
        made_dir = True

    overrides = {"batch_size": args.batch_size} if args.batch_size else {}
    cfg = _gpt.config_for(args.size, **overrides)
    model = _gpt.build(cfg, seed=0, device=device)
    opt = _gpt.make_optimizer(model)
    batches = _gpt.BatchStream(cfg, seed=0, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # per step: wait for the compute stream only (as loss.item() would), not for copy/staging streams
    step_sync = (lambda: torch.cuda.current_stream().synchronize()) if device.type == "cuda" else (lambda: None)

    facts = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
        "out_dir": str(out_dir),
        "filesystem": _fs_of(out_dir),
    }
    try:
        import lazyckpt

        facts["lazyckpt"] = getattr(lazyckpt, "__version__", "?")
    except ImportError:
        if "lazyckpt" in modes:
            raise
    log(
        f"# bench_core: size={args.size} params={_gpt.num_params(model) / 1e6:.1f}M layers={cfg.n_layer} "
        f"width={cfg.n_embd} vocab={cfg.vocab_size} seq={cfg.block_size} batch={cfg.batch_size} "
        f"device={facts['device']}"
    )
    log(
        f"# steps={steps} rounds={rounds} warmup={warmup} modes={','.join(modes)} out_dir={out_dir} "
        f"torch={torch.__version__} threads={torch.get_num_threads()} cpus={os.cpu_count()}"
    )

    step_no = 0

    def make_state():
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step_no}

    # steps without checkpoints: create the AdamW state, fault in the memory the step needs (the first
    # steps of a fresh process are several times slower here)
    for _ in range(3):
        _gpt.train_step(model, opt, batches.next())
        step_no += 1
    sync()
    ckpt_bytes = _gpt.state_bytes(make_state())
    log(f"# checkpoint tensors: {ckpt_bytes / GB:.3f} GB")

    impl = {"none": NoCheckpoint(out_dir), "torch.save": TorchSave(out_dir)}
    if "dcp" in modes:
        impl["dcp"] = DCPAsync(out_dir, device)
    if "lazyckpt" in modes:
        impl["lazyckpt"] = Lazy(out_dir, opt, args.writer_threads)

    def segment(mode: Mode, n: int, n_warm: int) -> dict:
        nonlocal step_no
        for _ in range(n_warm):
            _gpt.train_step(model, opt, batches.next(), before_step=mode.before_step)
            step_no += 1
            mode.save(make_state(), step_no)
        mode.drain()
        sync()
        mode.reset_metrics()
        gc.collect()
        step_s = []
        c0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(n):
            ts = time.perf_counter()
            _gpt.train_step(model, opt, batches.next(), before_step=mode.before_step)
            step_no += 1
            mode.save(make_state(), step_no)
            step_sync()
            step_s.append(time.perf_counter() - ts)
        td = time.perf_counter()
        mode.drain()
        sync()
        t1 = time.perf_counter()
        cpu_s = time.process_time() - c0
        return {"total_s": t1 - t0, "drain_s": t1 - td, "cpu_s": cpu_s, "step_s": step_s, **mode.metrics()}

    results: dict[str, list[dict]] = {m: [] for m in modes}
    psi0, load0 = _cpu_pressure_total(), os.getloadavg()
    raw_runs, direct_runs, iso_runs = [], [], []
    payload = None
    t_start = time.perf_counter()
    try:
        for r in range(rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for m in order:
                res = segment(impl[m], steps, warmup)
                results[m].append(res)
                extra = ""
                if m == "lazyckpt":
                    extra = (
                        f" guard_wait={res['guard_wait_s_total']:.2f}s write={_fmt(res['write_gbps'])}GB/s"
                        f" staged={_fmt(res['staged_s'])}s durable={_fmt(res['durable_s'])}s"
                    )
                log(
                    f"round {r + 1}/{rounds} {m:<10} total={res['total_s']:7.2f}s drain={res['drain_s']:5.2f}s "
                    f"median step+save={statistics.median(res['step_s']):5.2f}s{extra}"
                )
            # raw sequential writes of as many bytes as one lazyckpt (else torch.save) checkpoint file, and the
            # same bytes through lazyckpt with nothing else running. One write first, not counted: the first
            # write after a while of other work pays for page-cache pages the VM has to fault in again.
            ref_file = impl["lazyckpt"].path if "lazyckpt" in impl else impl["torch.save"].path
            nbytes = ref_file.stat().st_size if ref_file.exists() else ckpt_bytes
            if payload is None or payload.numel() < nbytes:
                payload = make_payload(nbytes)
            gc.collect()
            raw_write(payload, nbytes, out_dir / "raw.bin")
            io_order = ["raw", "raw_direct", "lazyckpt"] if r % 2 == 0 else ["lazyckpt", "raw_direct", "raw"]
            for what in io_order:
                if what == "raw" or what == "raw_direct":
                    res = raw_write(payload, nbytes, out_dir / "raw.bin", direct=what == "raw_direct")
                    (raw_runs if what == "raw" else direct_runs).append(res)
                    label = "raw write" if what == "raw" else "raw O_DIRECT write"
                    log(
                        f"round {r + 1}/{rounds} {label} {res['bytes'] / GB:.3f} GB + fsync: "
                        + ("unsupported" if res["s"] is None else
                           f"{res['s']:.2f}s = {res['gbps']:.2f} GB/s, {res['cpu_s']:.2f} CPU-s")
                    )  # fmt: skip
                elif "lazyckpt" in impl:
                    lz = impl["lazyckpt"]
                    lz.reset_metrics()
                    sync()
                    gc.collect()
                    t, c = time.perf_counter(), time.process_time()
                    h = lz.ckpt.save(make_state(), out_dir / "lazy_isolated.pt")
                    st = h.wait()
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    nb = getattr(st, "file_bytes", None) or (out_dir / "lazy_isolated.pt").stat().st_size
                    fields = ("write_gbps", "write_s", "staged_s", "durable_s", "blocked_s")
                    iso = {
                        "bytes": nb,
                        "e2e_s": dt,
                        "e2e_gbps": nb / dt / GB,
                        "cpu_s": dc,
                        **{f: getattr(st, f, None) for f in fields},
                    }
                    iso_runs.append(iso)
                    log(
                        f"round {r + 1}/{rounds} lazyckpt isolated save {nb / GB:.3f} GB: save->durable {dt:.2f}s"
                        f" = {iso['e2e_gbps']:.2f} GB/s; its write_gbps={_fmt(iso['write_gbps'])}; {dc:.2f} CPU-s"
                    )
        if payload is None or payload.numel() < (64 << 20):
            payload = make_payload(256 << 20)
        crc = crc_throughput(payload)
        d2h = None
        if device.type == "cuda":
            d2h = {"raw_pinned": raw_d2h(_distinct_tensors(make_state()))}
            if "lazyckpt" in impl:
                staged = [i["staged_s"] for i in iso_runs if i.get("staged_s")]
                d2h["lazyckpt_staged_s"] = median(staged)
                d2h["lazyckpt_gbps"] = ckpt_bytes / median(staged) / GB if staged else None
    finally:
        for m in impl.values():
            try:
                m.close()
            except Exception as e:  # noqa: BLE001
                log(f"# closing {m.name} failed: {e!r}")
    wall = time.perf_counter() - t_start
    psi1 = _cpu_pressure_total()
    # share of the run during which some runnable task waited for a CPU; includes our own threads
    facts["cpu_pressure"] = None if psi0 is None or psi1 is None else (psi1 - psi0) / 1e6 / wall
    facts["loadavg_start"], facts["loadavg_end"] = load0, os.getloadavg()

    # ------------------------------------------------------------------ summary
    base = [r["total_s"] for r in results["none"]]
    summary = {}
    for m in modes:
        stalls = [(res["total_s"] - b) / steps for res, b in zip(results[m], base, strict=True)]
        summary[m] = {
            "segment_s": median([x["total_s"] for x in results[m]]),
            "step_s": median([s for x in results[m] for s in x["step_s"]]),
            "stall_s": median(stalls),
            "stall_rounds": stalls,
            "save_call_s": median([x.get("save_call_s") for x in results[m]]),
            "drain_s": median([x["drain_s"] for x in results[m]]),
        }
    none_step = summary["none"]["step_s"]
    cpu_base = [r["cpu_s"] for r in results["none"]]
    for m in modes:  # a cross-check robust to bursts of load: median step cost + drain spread over the saves
        summary[m]["stall_step_median_s"] = summary[m]["step_s"] - none_step + summary[m]["drain_s"] / steps
        # CPU seconds (all threads of this process) each checkpoint costs: what it takes away from training
        # on a machine whose cores the training already uses; insensitive to other processes' load
        extra = [(res["cpu_s"] - c) / steps for res, c in zip(results[m], cpu_base, strict=True)]
        summary[m]["extra_cpu_s"] = median(extra)
    raw_gbps = median([r["gbps"] for r in raw_runs])
    lazy = summary.get("lazyckpt")
    if lazy:
        lazy["write_gbps_in_training"] = median([x.get("write_gbps") for x in results["lazyckpt"]])
        lazy["guard_wait_s_per_ckpt"] = median([x["guard_wait_s_total"] / steps for x in results["lazyckpt"]])
        lazy["skipped"] = sum(x["skipped"] for x in results["lazyckpt"])
        lazy["isolated_e2e_gbps"] = median([i["e2e_gbps"] for i in iso_runs])
        lazy["isolated_write_gbps"] = median([i.get("write_gbps") for i in iso_runs])
        lazy["isolated_cpu_s"] = median([i["cpu_s"] for i in iso_runs])

    log("")
    log(
        f"== checkpoint every step: {args.size} ({_gpt.num_params(model) / 1e6:.1f}M params, "
        f"{ckpt_bytes / GB:.2f} GB of tensors), {steps} checkpoints x {rounds} rounds, median over rounds =="
    )
    log(
        f"{'mode':<12}{'step+save s':>12}{'stall/ckpt s':>14}{'in save() s':>13}{'final drain s':>15}"
        f"{'vs torch.save':>15}{'cross-check':>13}{'CPU-s/ckpt':>12}   stall per round"
    )
    ts_stall = summary["torch.save"]["stall_s"] if "torch.save" in summary else None
    for m in modes:
        s = summary[m]
        rel = "" if m == "none" or not ts_stall else f"{s['stall_s'] / ts_stall:.3f}x"
        log(
            f"{m:<12}{s['step_s']:>12.2f}{s['stall_s']:>14.3f}{_fmt(s['save_call_s'], 3):>13}"
            f"{s['drain_s']:>15.2f}{rel:>15}{s['stall_step_median_s']:>13.3f}{s['extra_cpu_s']:>12.2f}   "
            f"{' '.join(f'{x:.3f}' for x in s['stall_rounds'])}"
        )
    ratios = {}
    if lazy and ts_stall:
        ratios["lazy_vs_torchsave"] = lazy["stall_s"] / ts_stall
    if lazy and "dcp" in summary and summary["dcp"]["stall_s"]:
        ratios["lazy_vs_dcp"] = lazy["stall_s"] / summary["dcp"]["stall_s"]
    log("")
    for m in ("torch.save", "dcp"):  # a ratio to a non-positive stall means nothing
        if m in summary and summary[m]["stall_s"] is not None and summary[m]["stall_s"] <= 0:
            ratios.pop("lazy_vs_torchsave" if m == "torch.save" else "lazy_vs_dcp", None)
            log(f"{m} stall <= 0: the machine's load changed between segments; ratio to {m} undefined, rerun")
    if "lazy_vs_torchsave" in ratios:
        log(
            f"lazyckpt stall / torch.save stall = {ratios['lazy_vs_torchsave']:.3f}  (target <= 0.15) "
            f"{'OK' if ratios['lazy_vs_torchsave'] <= 0.15 else 'MISSED'}"
        )
    if "lazy_vs_dcp" in ratios:
        log(
            f"lazyckpt stall / DCP async_save stall = {ratios['lazy_vs_dcp']:.3f}  (target <= 0.5) "
            f"{'OK' if ratios['lazy_vs_dcp'] <= 0.5 else 'MISSED'}"
        )
    if lazy:
        log(f"lazyckpt per checkpoint: guard wait {lazy['guard_wait_s_per_ckpt']:.3f}s, skipped {lazy['skipped']}")
    if raw_runs and none_step:
        bound = max(0.0, raw_runs[0]["bytes"] / (raw_gbps * GB) - none_step)
        summary["storage_bound_stall_s"] = bound
        log(
            f"storage bound: a checkpoint takes {raw_runs[0]['bytes'] / (raw_gbps * GB):.2f}s to write raw vs "
            f"{none_step:.2f}s per step, so any background checkpointer stalls >= {bound:.3f}s per checkpoint "
            f"in steady state"
        )
    log("")
    log(
        f"write throughput (same bytes, same run): raw sequential write+fsync {raw_gbps:.2f} GB/s "
        f"(runs: {', '.join(f'{r:.2f}' for r in (x['gbps'] for x in raw_runs))}), "
        f"{median([r['cpu_s'] for r in raw_runs]):.2f} CPU-s"
    )
    direct_gbps = median([r["gbps"] for r in direct_runs])
    if direct_gbps:
        log(
            f"  raw O_DIRECT write+fsync (no page cache): {direct_gbps:.2f} GB/s "
            f"(runs: {', '.join(f'{r:.2f}' for r in (x['gbps'] for x in direct_runs))}), "
            f"{median([r['cpu_s'] for r in direct_runs]):.2f} CPU-s"
        )
    if lazy:
        iso = lazy["isolated_e2e_gbps"]
        log(
            f"  lazyckpt isolated, save() -> durable: {iso:.2f} GB/s = {iso / raw_gbps:.0%} of raw  (target >= 80%) "
            f"{'OK' if iso >= 0.8 * raw_gbps else 'MISSED'}"
        )
        if lazy["isolated_write_gbps"]:
            log(
                f"  lazyckpt isolated, SaveStats.write_gbps: {lazy['isolated_write_gbps']:.2f} GB/s = "
                f"{lazy['isolated_write_gbps'] / raw_gbps:.0%} of raw"
            )
        log(f"  lazyckpt isolated save, CPU time of all threads: {lazy['isolated_cpu_s']:.2f} CPU-s")
        if lazy["write_gbps_in_training"]:
            log(
                f"  lazyckpt during training (CPU shared with the step), SaveStats.write_gbps: "
                f"{lazy['write_gbps_in_training']:.2f} GB/s = {lazy['write_gbps_in_training'] / raw_gbps:.0%} of raw"
            )
    uses = f"; lazyckpt uses {crc['lazyckpt_backend']}" if "lazyckpt_backend" in crc else ""
    log(f"CRC32 over {crc['bytes'] >> 20} MiB: zlib {crc['zlib']:.2f} GB/s, isal {_fmt(crc.get('isal'))} GB/s{uses}")
    if d2h:
        log(
            f"D2H: raw pinned copy {d2h['raw_pinned']['gbps']:.1f} GB/s; "
            f"lazyckpt save() -> staged, isolated: {_fmt(d2h.get('lazyckpt_gbps'), 1)} GB/s"
        )
    log(
        f"# wall time {wall:.0f}s; load average {load0[0]:.1f} at start, {facts['loadavg_end'][0]:.1f} at end; "
        f"CPU pressure {_fmt(facts['cpu_pressure'] and 100 * facts['cpu_pressure'], 0)}% of the time "
        "(some task waiting for a CPU; high values mean a busy machine and noisy numbers)"
    )
    log("# cross-check = median(step+save) - median(step without checkpoint) + final drain / checkpoints")
    log("# CPU-s/ckpt = extra CPU time of this process (all threads) per checkpoint, vs the no-checkpoint segment")

    if args.json:
        doc = {
            "args": vars(args),
            "facts": facts,
            "config": cfg.to_dict(),
            "params": _gpt.num_params(model),
            "ckpt_tensor_bytes": ckpt_bytes,
            "steps": steps,
            "rounds": rounds,
            "warmup": warmup,
            "summary": summary,
            "ratios": ratios,
            "raw_write": raw_runs,
            "raw_direct_write": direct_runs,
            "lazy_isolated": iso_runs,
            "crc_gbps": crc,
            "d2h": d2h,
            "segments": results,
            "wall_s": wall,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
        log(f"# wrote {args.json}")
    if made_dir and not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _distinct_tensors(obj) -> list[torch.Tensor]:
    """One tensor per storage (tied weights appear twice in a state dict)."""
    seen, out = set(), []
    for t in _tensors(obj):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _cpu_pressure_total() -> float | None:
    """Cumulative microseconds some task waited for a CPU (Linux PSI), None when unavailable."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def _fmt(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _fs_of(path: Path) -> str:
    try:
        best = ("", "?")
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, f"{fstype} on {dev} ({mnt})")
        return best[1]
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
