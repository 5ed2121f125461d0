"""The measurement loop of ``bench_core``: same model, same batches, every mode, rounds that rotate.

Each segment = warm-up steps (checkpointing, not counted) + drain, then ``steps`` counted steps, each
followed by a checkpoint, then the final drain (inside the timed window). Per round,
``stall per checkpoint = (segment time of the mode - segment time of "none") / checkpoints``; the
summary takes the median over rounds. Each round also times a raw sequential write (+fsync) of as
many bytes as one checkpoint file, and an isolated lazyckpt save (nothing else running).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lazyckpt.cli._format import dump_json

from . import _baselines as baselines
from . import gpt as _gpt
from ._modes import Mode, make_modes, unavailable_peers

logger = logging.getLogger(__name__)

GB = 1e9
# lazyckpt-bg: lazyckpt with the write inside save() on memory filesystems turned off (an A/B of that choice)
# write-only: no checkpointer, the disk's write in the background (the storage floor measured in place)
MODES = ("none", "torch.save", "dcp", "write-only", "lazyckpt", "lazyckpt-bg")
DEFAULT_MODES = ("none", "torch.save", "dcp", "write-only", "lazyckpt")
# counted steps, rounds, warm-up steps per segment, per model size
DEFAULTS = {"tiny": (10, 3, 2), "small": (6, 4, 1), "100m": (5, 4, 1), "1b": (4, 2, 1)}


def cli(prog: str, doc: str | None, add_arguments: Any, run: Any, argv: list[str] | None) -> int:
    """A benchmark's ``main()``: its parser (``add_arguments``) over ``argv``, handed to ``run``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return int(run(parser.parse_args(argv)))


def add_json_argument(p: argparse.ArgumentParser, what: str = "the table") -> None:
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help=f"all measurements as JSON: to stdout instead of {what}, or to FILE")  # fmt: skip


def emit_json(doc: dict[str, Any], where: str | None) -> bool:
    """``--json``: ``-`` prints ``doc`` instead of the report (True: nothing else to print); a FILE
    gets it beside the report. The doc records the command line that made it (``command``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    doc.setdefault("command", " ".join(["python -m", spec.name if spec else sys.argv[0], *sys.argv[1:]]))
    if where == "-":
        dump_json(doc)
        return True
    if where:
        with open(where, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
    return False


def add_loop_arguments(
    p: argparse.ArgumentParser,
    modes: tuple[str, ...],
    default_modes: tuple[str, ...],
    steps: int | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
) -> None:
    """The options of every training benchmark on this loop (``None`` defaults: ``DEFAULTS`` by size)."""

    def number(flag: str, value: int | None, what: str) -> None:
        p.add_argument(flag, type=int, default=value, help=what + ("" if value is None else f" (default {value})"))

    p.add_argument("--size", default="100m", choices=sorted(_gpt.SIZES), help="model size (default 100m, ~1.2 GB)")
    number("--steps", steps, "counted steps (= checkpoints) per segment")
    number("--rounds", rounds, "repetitions of all modes (order rotates)")
    number("--warmup", warmup, "uncounted checkpointing steps per segment")
    p.add_argument("--modes", default=",".join(default_modes), help=f"subset of {','.join(modes)} (none always runs)")
    p.add_argument("--writer-threads", type=int, default=4, help="lazyckpt writer threads (default 4)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for training (1 on 2 cores: the spare-core regime; default: torch's)",
    )


@dataclass
class BenchOptions:
    size: str = "100m"
    steps: int | None = None
    rounds: int | None = None
    warmup: int | None = None
    batch_size: int | None = None
    modes: tuple[str, ...] = DEFAULT_MODES
    writer_threads: int = 4
    device: str = "cpu"
    out_dir: str | None = None
    keep: bool = False

    def resolved(self) -> tuple[int, int, int]:
        steps, rounds, warmup = DEFAULTS[self.size]
        return self.steps or steps, self.rounds or rounds, warmup if self.warmup is None else self.warmup


Progress = Callable[[int, str], None]  # (units done, what is running)


class Bench:
    """One benchmark run; ``run()`` returns the JSON-ready document. A subclass may compare other
    modes: ``all_modes`` (in the order they run) and ``make_modes``."""

    all_modes: tuple[str, ...] = MODES

    def __init__(self, opts: BenchOptions, progress: Progress) -> None:
        self.opts, self.progress = opts, progress
        self.steps, self.rounds, self.warmup = opts.resolved()
        self.device = torch.device(opts.device)
        self.skipped = unavailable_peers(list(opts.modes))
        self.modes = [m for m in self.all_modes if m == "none" or (m in opts.modes and m not in self.skipped)]
        self.done_units = 0

    @property
    def total_units(self) -> int:
        return self.rounds * (len(self.modes) * (self.warmup + self.steps) + 2)

    def _tick(self, what: str, n: int = 1) -> None:
        self.done_units += n
        self.progress(self.done_units, what)

    def run(self) -> dict[str, Any]:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        out_dir, made = self._out_dir()
        try:
            return self._run(out_dir)
        finally:
            if made and not self.opts.keep:
                shutil.rmtree(out_dir, ignore_errors=True)

    def _out_dir(self) -> tuple[Path, bool]:
        if self.opts.out_dir:
            path = Path(self.opts.out_dir).resolve()
            path.mkdir(parents=True, exist_ok=True)
            return path, False
        return Path(tempfile.mkdtemp(prefix="lazyckpt-bench-")), True

    def _setup(self) -> None:
        overrides = {"batch_size": self.opts.batch_size} if self.opts.batch_size else {}
        self.cfg = _gpt.config_for(self.opts.size, **overrides)
        self.model = _gpt.build(self.cfg, seed=0, device=self.device)
        self.opt = _gpt.make_optimizer(self.model)
        self.batches = _gpt.BatchStream(self.cfg, seed=0, device=self.device)
        self.step_no = 0
        for _ in range(3):  # create the AdamW state; fault in the memory a step needs
            _gpt.train_step(self.model, self.opt, self.batches.next())
            self.step_no += 1
        self._sync()
        self.ckpt_bytes = _gpt.state_bytes(self.state())

    def make_modes(self, out_dir: Path) -> dict[str, Mode]:
        return make_modes(self.modes, out_dir, self.device, self.opt, self.opts.writer_threads)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step_no}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _step_sync(self) -> None:  # as loss.item() would: the compute stream only, not copy streams
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _run(self, out_dir: Path) -> dict[str, Any]:
        self._setup()
        impl = self.make_modes(out_dir)
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in self.modes}
        raw_runs: list[dict[str, Any]] = []
        iso_runs: list[dict[str, Any]] = []
        psi0, load0, t_start = baselines.cpu_pressure_total(), os.getloadavg(), time.perf_counter()
        try:
            for r in range(self.rounds):
                order = self.modes[r % len(self.modes) :] + self.modes[: r % len(self.modes)]
                for name in order:
                    results[name].append(self._segment(impl[name], r))
                raw_runs.append(self._raw_write(impl, out_dir))
                self._tick(f"round {r + 1}: raw write")
                if "lazyckpt" in impl:
                    iso_runs.append(self._isolated(impl["lazyckpt"], out_dir))
                self._tick(f"round {r + 1}: isolated save")
            extras = self._extras()
        finally:
            for mode in impl.values():
                try:
                    mode.close()
                except Exception as exc:  # the measurements are in; say what failed and go on
                    logger.warning("closing %s failed: %r", mode.name, exc)
        wall = time.perf_counter() - t_start
        facts = self._facts(out_dir, psi0, load0, wall)
        summary, ratios = summarize(results, raw_runs, iso_runs, self.steps, self.modes)
        return {
            "options": asdict(self.opts), "facts": facts, "config": self.cfg.to_dict(),
            "params": _gpt.num_params(self.model), "ckpt_tensor_bytes": self.ckpt_bytes, "steps": self.steps,
            "rounds": self.rounds, "warmup": self.warmup, "modes": self.modes, "skipped": self.skipped,
            "summary": summary, "ratios": ratios, "raw_write": raw_runs, "lazy_isolated": iso_runs, **extras,
            "timeline": {m: results[m][-1]["timeline"] for m in self.modes}, "segments": _strip(results),
            "wall_s": wall,
        }  # fmt: skip

    # -- one segment ---------------------------------------------------------------------------

    def _segment(self, mode: Mode, round_no: int) -> dict[str, Any]:
        for _ in range(self.warmup):
            self._train_and_save(mode)
            self._tick(f"round {round_no + 1}: {mode.name} warm-up")
        mode.drain()
        self._sync()
        mode.reset_metrics()
        gc.collect()
        steps: list[tuple[float, float]] = []
        sched0 = thread_sched()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(self.steps):
            ts = time.perf_counter()
            self._train_and_save(mode)
            self._step_sync()
            steps.append((ts, time.perf_counter()))
            self._tick(f"round {round_no + 1}: {mode.name}")
        td = time.perf_counter()
        sched1 = thread_sched()
        mode.drain()
        self._sync()
        t1 = time.perf_counter()
        res = {"total_s": t1 - t0, "drain_s": t1 - td, "cpu_s": time.process_time() - c0,
               "step_s": [e - s for s, e in steps], **mode.metrics()}  # fmt: skip
        if sched0 and sched1:  # the training thread over the steps (its saves included, not the drain)
            res["train_cpu_s"] = (sched1[0] - sched0[0]) / self.steps
            res["train_runqueue_s"] = (sched1[1] - sched0[1]) / self.steps
        res["timeline"] = timeline(mode, steps, t0, td, t1)
        return res

    def _train_and_save(self, mode: Mode) -> None:
        marks: dict[str, float] = {}

        def before_step() -> None:
            mode.before_step()
            marks["before"] = time.perf_counter()

        def hook(*_: Any) -> None:  # runs after lazyckpt's global guard: the end of its wait
            marks["hook"] = time.perf_counter()

        handle = self.opt.register_step_pre_hook(hook)
        try:
            _gpt.train_step(self.model, self.opt, self.batches.next(), before_step=before_step)
        finally:
            handle.remove()
        if marks.get("hook", 0) - marks.get("before", 0) > 1e-4:
            mode.blocked.append((marks["before"], marks["hook"], "guard"))
        self.step_no += 1
        mode.save(self.state(), self.ckpt_bytes)

    # -- baselines --------------------------------------------------------------------------------

    def _raw_write(self, impl: dict[str, Mode], out_dir: Path) -> dict[str, Any]:
        ref = getattr(impl.get("lazyckpt"), "path", None) or getattr(impl.get("torch.save"), "path", None)
        nbytes = ref.stat().st_size if ref is not None and ref.exists() else self.ckpt_bytes
        payload = self._payload(nbytes)
        gc.collect()
        dt, dc = baselines.raw_write(payload, out_dir / "raw.bin")
        return {"bytes": nbytes, "s": dt, "gbps": nbytes / dt / GB, "cpu_s": dc}

    def _payload(self, nbytes: int) -> torch.Tensor:
        cached = getattr(self, "_payload_buf", None)
        if cached is None or cached.numel() != nbytes:
            self._payload_buf = baselines.make_payload(nbytes)
        return self._payload_buf

    def _isolated(self, lazy: Any, out_dir: Path) -> dict[str, Any]:
        """The same bytes through lazyckpt with nothing else running."""
        lazy.reset_metrics()
        self._sync()
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        stats = lazy.ckpt.save(self.state(), out_dir / "lazy_isolated.pt").wait()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        nb = stats.file_bytes
        fields = ("write_gbps", "write_s", "staged_s", "durable_s", "blocked_s")
        return {
            "bytes": nb,
            "e2e_s": dt,
            "e2e_gbps": nb / dt / GB,
            "cpu_s": dc,
            **{f: getattr(stats, f) for f in fields},
        }

    def _extras(self) -> dict[str, Any]:
        payload = getattr(self, "_payload_buf", None)
        if payload is None or payload.numel() < (64 << 20):
            payload = baselines.make_payload(64 << 20)
        out: dict[str, Any] = {"crc_gbps": baselines.crc_throughput(payload), "d2h": None}
        if self.device.type == "cuda":
            out["d2h"] = {"raw_pinned": baselines.raw_d2h(baselines.distinct_tensors(self.state()))}
        return out

    def _facts(self, out_dir: Path, psi0: float | None, load0: tuple[float, float, float], wall: float) -> dict:
        from lazyckpt import __version__

        psi1 = baselines.cpu_pressure_total()
        device = str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name()
        return {
            "lazyckpt": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu": baselines.cpu_name(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": device, "out_dir": str(out_dir),
            "filesystem": baselines.filesystem_of(out_dir),
            # share of the run some runnable task waited for a CPU (our own threads included)
            "cpu_pressure": None if psi0 is None or psi1 is None else (psi1 - psi0) / 1e6 / wall,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        }  # fmt: skip


def thread_sched() -> tuple[float, float] | None:
    """The calling thread's (CPU seconds, seconds runnable but waiting for a CPU) from
    ``/proc/thread-self/schedstat``; None where the kernel does not keep it."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            run_ns, wait_ns = fh.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


def timeline(mode: Mode, steps: list[tuple[float, float]], t0: float, t_drain: float, t1: float) -> dict[str, Any]:
    """Per step: compute vs blocked seconds; spans relative to the segment start (for the plot)."""
    blocked = [(s - t0, e - t0, what) for s, e, what in mode.blocked if e >= t0]
    rows = []
    for s, e in steps:
        b = sum(max(0.0, min(e, be + t0) - max(s, bs + t0)) for bs, be, _ in blocked)
        rows.append({"start": s - t0, "duration": e - s, "blocked": b, "compute": max(0.0, e - s - b)})
    background = sorted((s - t0, e - t0, what) for s, e, what in mode.background if e >= t0)
    return {"steps": rows, "blocked": blocked, "background": background, "drain": (t_drain - t0, t1 - t0)}


def summarize(results: dict[str, list[dict[str, Any]]], raw_runs: list[dict[str, Any]],
              iso_runs: list[dict[str, Any]], steps: int, modes: list[str]) -> tuple[dict, dict]:  # fmt: skip
    """Medians over rounds per mode; stall ratios of every mode to every peer."""
    base = [r["total_s"] for r in results["none"]]
    cpu_base = [r["cpu_s"] for r in results["none"]]
    raw_gbps = _median([r["gbps"] for r in raw_runs])
    summary: dict[str, Any] = {}
    for m in modes:
        runs = results[m]
        stalls = [(res["total_s"] - b) / steps for res, b in zip(runs, base, strict=True)]
        s = summary[m] = {
            "segment_s": _median([x["total_s"] for x in runs]),
            "step_s": _median([t for x in runs for t in x["step_s"]]),
            "stall_s": _median(stalls), "stall_rounds": stalls,
            "save_call_s": _median([x.get("save_call_s") for x in runs]),
            "drain_s": _median([x["drain_s"] for x in runs]),
            "write_gbps": _median([x.get("write_gbps") for x in runs]),
            "extra_cpu_s": _median([(res["cpu_s"] - c) / steps for res, c in zip(runs, cpu_base, strict=True)]),
            "train_cpu_s": _median([x.get("train_cpu_s") for x in runs]),
            "train_runqueue_s": _median([x.get("train_runqueue_s") for x in runs]),
        }  # fmt: skip
        s["write_vs_raw"] = s["write_gbps"] / raw_gbps if s["write_gbps"] and raw_gbps else None
    none_step = summary["none"]["step_s"]
    for m in modes:  # robust to bursts of load: median step cost + the drain spread over the saves
        summary[m]["stall_step_median_s"] = summary[m]["step_s"] - none_step + summary[m]["drain_s"] / steps
    if "lazyckpt" in summary:
        lazy, runs = summary["lazyckpt"], results["lazyckpt"]
        lazy["guard_wait_s_per_ckpt"] = _median([x["guard_wait_s_total"] / steps for x in runs])
        lazy["skipped"] = sum(x["skipped"] for x in runs)
        lazy["isolated_e2e_gbps"] = _median([i["e2e_gbps"] for i in iso_runs])
        lazy["isolated_write_gbps"] = _median([i.get("write_gbps") for i in iso_runs])
    summary["raw_write_gbps"] = raw_gbps
    ratios = {m: {p: summary[m]["stall_s"] / summary[p]["stall_s"] for p in modes
                  if p not in ("none", m) and summary[p]["stall_s"] and summary[p]["stall_s"] > 0}
              for m in modes if m != "none"}  # fmt: skip
    return summary, ratios


def _strip(results: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {m: [{k: v for k, v in r.items() if k != "timeline"} for r in runs] for m, runs in results.items()}


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
