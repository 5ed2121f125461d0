"""Multi-level checkpoints (issue 22): a checkpoint EVERY step to node memory, every 10th also to disk,
against the single-level ways; and the time to resume from each level.

Run from the repository root::

    python -m benchmarks.bench_levels --size 100m --threads 1 --json levels_spare.json   # spare core
    python -m benchmarks.bench_levels --size 100m --json levels_busy.json                # busy
    python -m benchmarks.bench_levels --size 100m --resume-only                          # resume only

Training modes (same GPT, AdamW and batches; interleaved in rounds whose order rotates; ``_run.Bench``):

  none                   no checkpoint (the baseline)
  torch.save             torch.save + fsync + rename to disk, every step
  dcp                    DCP async_save to disk, every step
  copy-only              not a checkpointer: the memory level's floor, measured in place (below)
  lazy-disk              LazyCheckpointer(levels=[Level(disk, every=1, keep=2)])
  lazy-mem               LazyCheckpointer(levels=[Level(memory, every=1, keep=2)])   (no disk level)
  lazy-mem+disk          LazyCheckpointer(levels=[Level(memory, 1, keep=2), Level(disk, every=10, keep=2)])
  lazy-mem+disk-nice     lazy-mem+disk with the disk level's copy thread at nice 19 (a proposal: it
                         then runs when the training's threads leave a core idle)
  lazy-mem[+disk]-idle   lazy-mem[+disk] with EVERY lazyckpt background thread (writers, committer,
                         level copies, remover) at nice 19 (a proposal for the spare-core regime)
  lazy-mem-nocrc         lazy-mem with crc=False (a diagnostic, not a checkpointer to use: no CRC in the
                         zip, so latest(verify=True) cannot check the file): what the CRC pass costs
  lazy-mem+disk-inline   lazy-mem, plus the same copy of the memory file to disk every 10th step made
                         on the training thread inside the save (the other placement of that copy)
  lazy-mem-fresh         lazy-mem with Level(reuse_pages=False): every checkpoint a new tmpfs file,
  lazy-mem+disk-fresh    lazy-mem+disk likewise (the way before page reuse, side by side)
  lazy-mem-staged        lazy-mem with zero_copy=False: every tensor copied into the staging buffers,
  lazy-mem+disk-staged   then written to tmpfs from there (the way before zero copy on tmpfs)
  lazy-mem[+disk]-bg     the memory level's file always written by the background threads, and
  lazy-mem[+disk]-insave always inside save() (the two placements that lazyckpt's rule chooses
                         between: inside save() when every core trains, ``core/plan.write_in_save``)

Per mode: steady stall per step = (counted steps' time - the baseline's) / steps, the final drain
apart (one-time drain: waiting for the last saves after the last step). Counted steps are numbered
so that the disk level is due at the 5th and 15th of 20: its copies overlap the steps after them,
as in a long run. The disk's own write+fsync of one checkpoint's bytes is timed each round.

Resume (``_resume.py``; each case in a fresh process, page cache dropped as root):
``latest()`` + ``load()`` + ``load_state_dict`` into model and optimizer from each level, verified
or not, 8 readers or 1, against stock ``torch.load`` of the same file from disk and from /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lazyckpt.core.engine import memory_at
from lazyckpt.storage.fs import pwrite_all

from . import _resume
from ._baselines import distinct_tensors
from ._levels_report import PEERS, print_report
from ._modes import Mode, OneThreadInBackground, make_modes, write_in_save
from ._progress import ProgressBar
from ._run import Bench, BenchOptions, add_json_argument, add_loop_arguments, cli, emit_json

LEVEL_MODES = (
    "copy-only", "lazy-disk", "lazy-mem", "lazy-mem+disk", "lazy-mem+disk-nice", "lazy-mem-idle", "lazy-mem+disk-idle",
    "lazy-mem-nocrc", "lazy-mem+disk-inline",
    "lazy-mem-fresh", "lazy-mem+disk-fresh", "lazy-mem-staged", "lazy-mem+disk-staged",
    "lazy-mem-bg", "lazy-mem+disk-bg", "lazy-mem-insave", "lazy-mem+disk-insave",
)  # fmt: skip
MODES = ("none", "torch.save", "dcp", *LEVEL_MODES)


class CopyOnly(OneThreadInBackground):
    """Not a checkpointer: the memory level's floor, measured in place. After each step one
    background thread writes the state's tensor bytes, read from the tensors' own memory, over the
    pages of one reused tmpfs file (8 MiB ``pwrite`` calls): the one memory copy that any checkpoint
    held in node memory makes, with no CRC, no pickling, no consistency (the tensors may change under
    it). A save first waits for the previous copy. Its stall is what that copy takes from the
    training on this machine (a core, memory bandwidth, cache); a memory level's stall minus this is
    the engine's own cost."""

    name = "copy-only"
    PIECE = 8 << 20

    def __init__(self, out_dir: Path, memory_dir: Path) -> None:
        super().__init__(out_dir)
        memory_dir.mkdir(parents=True, exist_ok=True)
        self.path = memory_dir / "copy-only.bin"

    def _copy(self, tensors: list[torch.Tensor]) -> int:
        total = 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for x in tensors:
                n = x.numel() * x.element_size()
                view = memory_at(x.data_ptr(), n)
                for off in range(0, n, self.PIECE):
                    pwrite_all(fd, view[off : off + self.PIECE], total + off)
                total += n
        finally:
            os.close(fd)
        return total

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        tensors = [x.detach() for x in distinct_tensors(state) if x.is_contiguous() and x.device.type == "cpu"]
        self._start("copy", self._copy, (tensors,))

    def close(self) -> None:
        self.drain()
        self.path.unlink(missing_ok=True)


class Levels(Mode):
    """``LazyCheckpointer(levels=...)`` saving ``save(state, step=n)`` after every step. With
    ``inline_every``, the memory level's file of every such step is also copied to ``inline_dir``
    on the calling thread, inside the save (waiting for that file first); with ``nice``, the level
    copy threads (or, with ``nice_all``, every lazyckpt thread) run at that nice value; ``in_save``:
    the placement of the memory level's write
    (``_modes.write_in_save``; None: lazyckpt's rule)."""

    def __init__(self, name: str, out_dir: Path, levels: list[Any], optimizer: torch.optim.Optimizer,
                 writer_threads: int, *, inline_dir: Path | None = None, inline_every: int = 0,
                 nice: int | None = None, nice_all: bool = False, zero_copy: bool = True,
                 in_save: bool | None = None, crc: bool = True) -> None:  # fmt: skip
        from lazyckpt import LazyCheckpointer

        self.step = 0
        self.period = max([lv.every for lv in levels] + [inline_every or 1])
        super().__init__(out_dir)
        self.name, self.levels, self.nice, self.reniced = name, levels, nice, set[int]()
        self.nice_prefix = "lazyckpt-" if nice_all else "lazyckpt-level-"
        self.inline_dir, self.inline_every, self.in_save = inline_dir, inline_every, in_save
        if inline_dir is not None:
            inline_dir.mkdir(parents=True, exist_ok=True)
        options = {"fsync": True, "on_backpressure": "block", "crc": crc, "zero_copy": zero_copy}
        self.ckpt = LazyCheckpointer(levels=levels, writer_threads=writer_threads, **options)
        self.ckpt.track(optimizer)
        self.handles: list[Any] = []

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self.handles = []
        # the counted steps start at 6 (mod 10): the slow level is due at the 5th and the 15th
        self.step += (self.period // 2 - self.step) % self.period

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        self.step += 1
        t = time.perf_counter()
        with write_in_save(self.in_save):
            handle = self.ckpt.save(state, step=self.step)
        if self.inline_every and self.step % self.inline_every == 0:
            self._copy_inline(handle)
        if self.nice is not None:
            self._renice()
        t1 = time.perf_counter()
        self.handles.append(handle)
        self.call_s.append(t1 - t)
        self._blocked(t, t1, "save")

    def _copy_inline(self, handle: Any) -> None:
        from lazyckpt.schedule import _copy

        assert self.inline_dir is not None
        handle.wait()
        _copy.copy_file(self.levels[0].file(self.step), str(self.inline_dir / f"step-{self.step:08d}.pt"), True)
        for old in sorted(self.inline_dir.glob("step-*.pt"))[:-2]:  # keep=2, as the disk level
            old.unlink()

    def _renice(self) -> None:
        """The level copy threads (named ``lazyckpt-level-<i>``, started by the first copy), or every
        lazyckpt thread, at ``nice``."""
        for th in threading.enumerate():
            if th.name.startswith(self.nice_prefix) and th.native_id and th.native_id not in self.reniced:
                os.setpriority(os.PRIO_PROCESS, th.native_id, self.nice)
                self.reniced.add(th.native_id)

    def drain(self) -> None:
        t = time.perf_counter()
        self.ckpt.wait()
        if self.handles:
            self._blocked(t, time.perf_counter(), "drain")
        for handle in self.handles:
            stats = handle.wait()
            if stats is not None and stats.write_gbps:
                self.write_gbps.append(stats.write_gbps)
        self.handles = []

    def release(self) -> None:
        """Between segments: the memory level's files go (every mode's at once would not fit in RAM)."""
        if _is_memory(self.levels[0].path):
            for f in Path(self.levels[0].path).glob("step-*.pt"):
                f.unlink(missing_ok=True)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.ckpt.close()


def _is_memory(path: str) -> bool:
    from lazyckpt.storage.fs import is_memory_filesystem

    return is_memory_filesystem(path)


class LevelsBench(Bench):
    all_modes = MODES

    def __init__(self, opts: BenchOptions, progress: Any, memory_dir: Path, disk_every: int) -> None:
        super().__init__(opts, progress)
        self.memory_dir, self.disk_every = memory_dir, disk_every

    def make_modes(self, out_dir: Path) -> dict[str, Mode]:
        from lazyckpt import Level

        stock = [m for m in self.modes if m not in LEVEL_MODES]
        impl = make_modes(stock, out_dir, self.device, self.opt, self.opts.writer_threads)
        mem, disk, every = self.memory_dir, out_dir, self.disk_every

        def both(folder: str, reuse: bool = True, **kw: Any) -> Levels:
            levels = [
                Level(mem / folder, every=1, keep=2, reuse_pages=reuse),
                Level(disk / folder, every=every, keep=2),
            ]
            return Levels(folder, out_dir, levels, self.opt, self.opts.writer_threads, **kw)

        def one(where: Path, folder: str, reuse: bool = True, **kw: Any) -> Levels:
            return Levels(folder, out_dir, [Level(where / folder, every=1, keep=2, reuse_pages=reuse)], self.opt,
                          self.opts.writer_threads, **kw)  # fmt: skip

        factories = {
            "copy-only": lambda: CopyOnly(out_dir, mem / "copy-only"),
            "lazy-disk": lambda: one(disk, "lazy-disk"),
            "lazy-mem": lambda: one(mem, "lazy-mem"),
            "lazy-mem+disk": lambda: both("lazy-mem+disk"),
            "lazy-mem+disk-nice": lambda: both("lazy-mem+disk-nice", nice=19),
            "lazy-mem-idle": lambda: one(mem, "lazy-mem-idle", nice=19, nice_all=True),
            "lazy-mem-nocrc": lambda: one(mem, "lazy-mem-nocrc", crc=False),
            "lazy-mem+disk-idle": lambda: both("lazy-mem+disk-idle", nice=19, nice_all=True),
            "lazy-mem+disk-inline": lambda: one(
                mem, "lazy-mem+disk-inline", inline_dir=disk / "inline", inline_every=every
            ),  # fmt: skip
            "lazy-mem-fresh": lambda: one(mem, "lazy-mem-fresh", reuse=False),
            "lazy-mem+disk-fresh": lambda: both("lazy-mem+disk-fresh", reuse=False),
            "lazy-mem-staged": lambda: one(mem, "lazy-mem-staged", zero_copy=False),
            "lazy-mem+disk-staged": lambda: both("lazy-mem+disk-staged", zero_copy=False),
            "lazy-mem-bg": lambda: one(mem, "lazy-mem-bg", in_save=False),
            "lazy-mem+disk-bg": lambda: both("lazy-mem+disk-bg", in_save=False),
            "lazy-mem-insave": lambda: one(mem, "lazy-mem-insave", in_save=True),
            "lazy-mem+disk-insave": lambda: both("lazy-mem+disk-insave", in_save=True),
        }
        impl.update({name: factories[name]() for name in self.modes if name in factories})
        return impl

    def _segment(self, mode: Mode, round_no: int) -> dict[str, Any]:
        res = super()._segment(mode, round_no)
        if isinstance(mode, Levels):
            mode.release()
        return res


def main(argv: list[str] | None = None) -> int:
    return cli("python -m benchmarks.bench_levels", __doc__, add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # warm-up 3: a memory level (keep 2) writes new tmpfs files for its first 3 saves and overwrites
    # the dropped file's pages from then on; counting those first saves would charge a one-time cost
    # (on this VM up to 4 CPU s per 1.17 GB file: new guest pages fault in the host) to every step
    add_loop_arguments(p, MODES, MODES, steps=20, rounds=3, warmup=3)
    p.add_argument("--disk-every", type=int, default=10, help="the disk level's period in steps (default 10)")
    p.add_argument("--out-dir", default=None, help="the disk level's folder (default: a temporary one)")
    p.add_argument("--memory-dir", default=None, help="the memory level's folder (default: one in /dev/shm)")
    p.add_argument("--resume-rounds", type=int, default=3, help="rounds of the resume cases (default 3; 0: none)")
    p.add_argument("--resume-only", action="store_true", help="only the resume cases")
    p.add_argument("--resume-cases", default=None, help="subset of the resume cases' names, separated by ',' (or ';')")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before each resume")
    add_json_argument(p, "the tables")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if unknown := sorted(set(modes) - set(MODES)):
        print(f"bench_levels: unknown mode(s) {unknown}; choose from {','.join(MODES)}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    disk = Path(args.out_dir or tempfile.mkdtemp(prefix="lazyckpt-levels-")).resolve()
    memory = Path(args.memory_dir or tempfile.mkdtemp(prefix="lazyckpt-levels-", dir="/dev/shm")).resolve()
    disk.mkdir(parents=True, exist_ok=True)
    memory.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "size": args.size,
        "memory_dir": str(memory),
        "disk_dir": str(disk),
        "memory_is_tmpfs": _is_memory(str(memory)),
        "disk_is_tmpfs": _is_memory(str(disk)),
    }
    bar = ProgressBar(1, enabled=not args.no_progress)
    try:
        if not args.resume_only:
            doc["training"] = _train(args, modes, disk, memory, bar)
        if args.resume_rounds > 0:
            doc["resume"] = _resume_all(args, disk, memory, bar)
    finally:
        bar.close()
        if not args.out_dir:
            shutil.rmtree(disk, ignore_errors=True)
        if not args.memory_dir:
            shutil.rmtree(memory, ignore_errors=True)
    if emit_json(doc, args.json):
        return 0
    print_report(doc)
    return 0


def _train(args: argparse.Namespace, modes: tuple[str, ...], disk: Path, memory: Path, bar: ProgressBar) -> dict:
    opts = BenchOptions(
        size=args.size,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        modes=modes,
        writer_threads=args.writer_threads,
        out_dir=str(disk / "training"),
    )
    bench = LevelsBench(opts, lambda done, what: None, memory / "training", args.disk_every)
    bar.total = max(1, bench.total_units)
    bench.progress = bar.update
    doc = bench.run()
    doc["levels"] = summarize_training(doc)
    return doc


def summarize_training(doc: dict[str, Any]) -> dict[str, Any]:
    """Per mode: steady stall per step (the final drain apart), the one-time drain, and the steady
    stall's ratio to each peer's; the disk's own write+fsync of one checkpoint."""
    import statistics

    segs, steps = doc["segments"], doc["steps"]
    base = [r["total_s"] - r["drain_s"] for r in segs["none"]]
    out: dict[str, Any] = {}
    for m in doc["modes"]:
        steady = [(r["total_s"] - r["drain_s"] - b) / steps for r, b in zip(segs[m], base, strict=True)]
        out[m] = {
            "steady_stall_s": statistics.median(steady),
            "steady_rounds": steady,
            "drain_s": statistics.median(r["drain_s"] for r in segs[m]),
            "stall_with_drain_s": doc["summary"][m]["stall_s"],
            "step_s": doc["summary"][m]["step_s"],
            "train_cpu_s": doc["summary"][m].get("train_cpu_s"),
            "extra_cpu_s": doc["summary"][m].get("extra_cpu_s"),
        }
    for s in out.values():
        s["vs"] = {
            p: s["steady_stall_s"] / out[p]["steady_stall_s"]
            for p in PEERS
            if p in out and out[p]["steady_stall_s"] > 0
        }
    raw = doc["raw_write"]
    out["disk_write"] = (
        {
            "bytes": raw[0]["bytes"],
            "s": statistics.median(r["s"] for r in raw),
            "gbps": doc["summary"]["raw_write_gbps"],
        }
        if raw
        else None
    )
    return out


def _resume_all(args: argparse.Namespace, disk: Path, memory: Path, bar: ProgressBar) -> dict[str, Any]:
    mem_dir, disk_dir = memory / "resume", disk / "resume"
    mem_file, disk_file, nbytes = _resume.make_files(args.size, str(mem_dir), str(disk_dir))
    chosen = _resume.cases(str(mem_dir), str(disk_dir), mem_file, disk_file)
    if args.resume_cases:
        sep = ";" if ";" in args.resume_cases else ","  # ";" where names hold commas
        wanted = {c.strip() for c in args.resume_cases.split(sep)}
        chosen = [c for c in chosen if c.name in wanted]
    total = len(chosen) * args.resume_rounds
    done = [0]

    def progress(what: str) -> None:
        bar.total, done[0] = total, done[0] + 1
        bar.update(done[0] - 1, what)

    runs = _resume.run_cases(args.size, args.threads, chosen, args.resume_rounds, not args.no_drop_caches, progress)
    return {
        "bytes": nbytes,
        "memory_file": mem_file,
        "disk_file": disk_file,
        "runs": runs,
        "summary": _resume.summarize(runs),
    }


if __name__ == "__main__":
    sys.exit(main())
